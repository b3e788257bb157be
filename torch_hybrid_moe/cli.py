"""`hybrid-moe` command line: patch, compile with the hybrid_moe backend, generate, report placement."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm
from transformers.generation.streamers import BaseStreamer

import torch_hybrid_moe as thm
from torch_hybrid_moe.tiny_models import ARCHITECTURES, tiny_model

DEFAULT_MODEL = "tiny:deepseek_v3"


class _TimingStreamer(BaseStreamer):
    """Timestamps generate()'s token pushes: the first push is the prompt, the second ends prefill."""

    def __init__(self, total: int) -> None:
        self.times: list[float] = []
        self.bar = tqdm(total=total, desc="generating", unit="tok", leave=False)

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())
        if len(self.times) > 1:
            self.bar.update(1)

    def end(self) -> None:
        self.bar.close()


def _load(name: str, dtype: torch.dtype) -> tuple[torch.nn.Module, object | None]:
    if name.startswith("tiny:"):
        arch = name.removeprefix("tiny:")
        if arch not in ARCHITECTURES:
            raise SystemExit(f"unknown tiny model {arch!r}; choose from {', '.join(ARCHITECTURES)}")
        return tiny_model(arch, dtype=dtype), None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tqdm(total=2, desc="loading", leave=False) as bar:
        tokenizer = AutoTokenizer.from_pretrained(name)
        bar.update()
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype).eval()
        bar.update()
    return model, tokenizer


def _prompt_ids(tokenizer: object | None, prompt: str, vocab_size: int) -> torch.Tensor:
    if tokenizer is None:  # random-weight model without a tokenizer: bytes folded into the vocabulary
        return torch.tensor([[3 + b % (vocab_size - 3) for b in prompt.encode()]])
    return tokenizer(prompt, return_tensors="pt").input_ids


def generate(args: argparse.Namespace) -> int:
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model, tokenizer = _load(args.model, dtype)
    thm.patch_model(model, thm.HybridMoEConfig(expert_budget=args.expert_budget, device=args.device))
    device = next(model.parameters()).device
    ids = _prompt_ids(tokenizer, args.prompt, model.config.vocab_size).to(device)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(ids, **gen)  # compiles the decode step for this static-cache size
        compile_s = time.perf_counter() - start
        thm.reset_stats(model)
        streamer = _TimingStreamer(args.max_new_tokens)
        start = time.perf_counter()
        out = model.generate(ids, streamer=streamer, **gen)
    times = streamer.times
    prefill_s = times[1] - start
    decode_s = times[-1] - times[1]
    new = out[0, ids.shape[1] :]
    text = tokenizer.decode(new, skip_special_tokens=True) if tokenizer else " ".join(map(str, new.tolist()))
    print(f"model {args.model}  budget {args.expert_budget}  device {device}  dtype {args.dtype}")
    print(f"output: {text}")
    print(f"warm-up with decode compile: {compile_s:.1f} s")
    print(f"prefill: {ids.shape[1] / prefill_s:8.1f} tok/s   decode: {(len(times) - 2) / max(decode_s, 1e-9):8.1f} tok/s")
    print(format_stats(thm.stats(model)))
    return 0


def format_stats(per_layer: dict[int, thm.LayerStats]) -> str:
    rows = [f"{'layer':>5} {'tokens':>7} {'hit rate':>8} {'on accel':>8} {'on CPU':>7} {'MB moved':>9}"]
    for idx, s in per_layer.items():
        ran = s.accelerator_experts + s.cpu_experts
        rows.append(
            f"{idx:>5} {s.tokens:>7} {s.hit_rate:>8.1%} {s.accelerator_experts / max(ran, 1):>8.1%} "
            f"{s.cpu_experts / max(ran, 1):>7.1%} {s.bytes_transferred / 1e6:>9.2f}"
        )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybrid-moe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="patch, compile and generate; print speed and expert placement")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"local transformers directory or hub id, or tiny:ARCH ({', '.join(ARCHITECTURES)})")
    g.add_argument("--prompt", default="def fibonacci(n):")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--expert-budget", type=float, default=0.25)
    g.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    if args.max_new_tokens < 2:
        parser.error("--max-new-tokens must be at least 2 (one prefill token, one decode token)")
    return generate(args)


if __name__ == "__main__":
    sys.exit(main())
