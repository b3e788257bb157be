"""`hybrid-moe` command line: patch, compile with the hybrid_moe backend, generate, report placement."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers.generation.streamers import BaseStreamer

import torch_hybrid_moe as thm
from torch_hybrid_moe.config import CPU_WEIGHT_DTYPES
from torch_hybrid_moe.cost_model import EXPERT_SHAPES, HARDWARE
from torch_hybrid_moe.embedded import DEFAULT_MODEL, embedded_models, load_model
from torch_hybrid_moe.tiny_models import TINY_ARCHITECTURES


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


def _prompt_ids(tokenizer: object | None, prompt: str, vocab_size: int) -> torch.Tensor:
    if tokenizer is None:  # random-weight model without a tokenizer: bytes folded into the vocabulary
        return torch.tensor([[3 + b % (vocab_size - 3) for b in prompt.encode()]])
    return tokenizer(prompt, return_tensors="pt").input_ids


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _config(args: argparse.Namespace) -> thm.HybridMoEConfig:
    return thm.HybridMoEConfig(
        expert_budget=args.expert_budget, device=args.device, cpu_weight_dtype=args.cpu_weight_dtype,
        cpu_weight_group_size=args.cpu_weight_group_size,
    )


def _load_with_tokenizer(name: str, dtype: torch.dtype, command: str) -> tuple[torch.nn.Module, object]:
    model, tokenizer = load_model(name, dtype)
    if tokenizer is None:
        raise SystemExit(f"{command} needs a model with a tokenizer (an embedded model or a local directory)")
    return model, tokenizer


def generate(args: argparse.Namespace) -> int:
    model, tokenizer = load_model(args.model, _DTYPES[args.dtype])
    thm.patch_model(model, _config(args))
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


def eval_ppl(args: argparse.Namespace) -> int:
    """Perplexity of the unpatched model and of the patched model in the chosen mode, on the held-out text."""
    from torch_hybrid_moe.embedded.corpus import heldout_text
    from torch_hybrid_moe.embedded.evaluation import perplexity

    model, tokenizer = _load_with_tokenizer(args.model, _DTYPES[args.dtype], "eval-ppl")
    ids = tokenizer(heldout_text(), add_special_tokens=False, return_tensors="pt").input_ids[0][: args.max_tokens + 1]
    reference = perplexity(model, ids)
    config = _config(args)
    thm.patch_model(model, config)
    patched = perplexity(model, ids)
    mode = args.mode if config.cpu_weight_dtype in ("model", args.dtype) else f"approximate ({config.cpu_weight_dtype} experts)"
    print(f"model {args.model}  held-out tokens {ids.numel() - 1}  mode {mode}  budget {args.expert_budget}")
    print(f"perplexity: unpatched {reference:.4f}   patched {patched:.4f}   ratio {patched / reference:.6f}")
    return 0


def trace(args: argparse.Namespace) -> int:
    from torch_hybrid_moe.embedded.corpus import heldout_text
    from torch_hybrid_moe.traces import record_trace

    model, tokenizer = _load_with_tokenizer(args.model, torch.float32, "trace")
    text = heldout_text()
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    stride = ids.numel() // args.prompts
    prompts = [ids[i * stride + args.offset : i * stride + args.offset + args.prompt_tokens] for i in range(args.prompts)]
    result = record_trace(model, prompts, args.max_new_tokens, args.model, args.hidden_every)
    result.save(args.out)
    print(f"wrote {args.out}: {result.tokens.numel()} token rows x {len(result.layers)} MoE layers")
    return 0


def simulate(args: argparse.Namespace) -> int:
    """Replay a trace through every policy stack on a hardware preset; one row per stack."""
    import json
    from dataclasses import asdict

    from torch_hybrid_moe.cost_model import CostModel
    from torch_hybrid_moe.simulator import STACKS
    from torch_hybrid_moe.simulator import simulate as replay
    from torch_hybrid_moe.traces import Trace

    trace = Trace.load(args.trace)
    costs = CostModel(HARDWARE[args.hardware], EXPERT_SHAPES[args.expert_shape])
    results = [replay(trace, stack, costs, args.batch, args.cache_ratio)
               for stack in tqdm(STACKS.values(), desc="simulating", unit="stack", leave=False)]
    if args.json:
        print(json.dumps([asdict(r) | {"prefetch_accuracy": None} for r in results], indent=1))
        return 0
    print(f"trace {args.trace} ({trace.meta['model']}), hardware {args.hardware}: {costs.hardware.description}")
    print(f"experts sized as {args.expert_shape}; batch {args.batch}; cache ratio {args.cache_ratio}")
    print(f"{'stack':<15} {'decode tok/s':>12} {'prefill tok/s':>13} {'hit rate':>8} {'PCIe GB':>8} "
          f"{'MoE s':>7} {'CPU busy':>8} {'GPU busy':>8}")
    for r in results:
        print(f"{r.stack:<15} {r.decode_tok_s:>12.1f} {r.prefill_tok_s:>13.1f} {r.hit_rate:>8.1%} {r.pcie_gb:>8.2f} "
              f"{r.moe_time_s:>7.3f} {r.cpu_busy:>8.1%} {r.gpu_busy:>8.1%}")
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
    model_help = (
        f"embedded model ({', '.join(embedded_models())}), local transformers directory, hub id, "
        f"or tiny:ARCH for random weights ({', '.join(TINY_ARCHITECTURES)})"
    )
    g = sub.add_parser("generate", help="patch, compile and generate; print speed and expert placement")
    e = sub.add_parser("eval-ppl", help="held-out perplexity, unpatched vs patched in a mode")
    t = sub.add_parser("trace", help="record per-token expert routing on held-out prompts to a trace file")
    s = sub.add_parser("simulate", help="replay a routing trace through every policy stack on a hardware model")
    for p in (g, e, t):
        p.add_argument("--model", default=DEFAULT_MODEL, help=model_help)
    for p in (g, e):
        p.add_argument("--expert-budget", type=float, default=0.25)
        p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
        p.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    for p in (g, e):
        p.add_argument("--cpu-weight-dtype", default="model", choices=CPU_WEIGHT_DTYPES,
                       help="format of the experts' host copy; int8 / int4 are approximate")
        p.add_argument("--cpu-weight-group-size", type=int, default=64)
    g.add_argument("--prompt", default="def fibonacci(n):")
    g.add_argument("--max-new-tokens", type=int, default=32)
    e.add_argument("--mode", default="exact", choices=["exact"], help="approximate modes join here as they land")
    e.add_argument("--max-tokens", type=int, default=16384)
    s.add_argument("--trace", type=Path, required=True)
    s.add_argument("--hardware", default="dali", choices=sorted(HARDWARE))
    s.add_argument("--expert-shape", default="deepseek-v2-lite", choices=sorted(EXPERT_SHAPES),
                   help="expert size the costs assume (the trace gives only the routing)")
    s.add_argument("--batch", type=int, default=1)
    s.add_argument("--cache-ratio", type=float, default=0.25)
    s.add_argument("--json", action="store_true")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--prompts", type=int, default=8)
    t.add_argument("--prompt-tokens", type=int, default=64)
    t.add_argument("--offset", type=int, default=0, help="token offset of each prompt in its held-out slice")
    t.add_argument("--max-new-tokens", type=int, default=64)
    t.add_argument("--hidden-every", type=int, default=1)
    args = parser.parse_args(argv)
    if args.command == "generate" and args.max_new_tokens < 2:
        parser.error("--max-new-tokens must be at least 2 (one prefill token, one decode token)")
    return {"generate": generate, "eval-ppl": eval_ppl, "trace": trace, "simulate": simulate}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
