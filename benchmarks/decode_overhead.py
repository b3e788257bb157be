"""Decode-step cost of the hybrid path against transformers itself, side by side in one run.

For each model (the embedded trained ones by default, or tiny:ARCH): per-token greedy decode time of
the unpatched model (eager, and compiled with Inductor over a static cache), and of the patched model
compiled with the hybrid_moe backend at expert budgets 0, 0.25 and 1.0, with its decode steps' cache hit rate. A
decode step's time is the median over repeats of a generate() call of 1 + N tokens less one of 1 token (prefill and
setup cancel), after a warm-up that compiles. On a CPU-only machine this measures the dispatch
overhead (host sync, CPU share), not an accelerator speedup.

    python benchmarks/decode_overhead.py [--model deepseek-tiny] [--tokens 32] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time

import torch
from transformers import CompileConfig

import torch_hybrid_moe as thm
from torch_hybrid_moe.cli import bounded
from torch_hybrid_moe.embedded import embedded_models, load_model
from torch_hybrid_moe.errors import InputError


def _generate(model: torch.nn.Module, ids: torch.Tensor, new: int, **gen: object) -> float:
    """Seconds of one generate() call of exactly `new` greedy tokens."""
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, **gen)
    return time.perf_counter() - start


def per_token_ms(model: torch.nn.Module, ids: torch.Tensor, tokens: int, repeats: int, **gen: object) -> float:
    """Median ms of one decode step: a call of 1 + `tokens` new tokens minus a call of 1, paired in each repeat, so
    the prompt's prefill and the call's own setup cancel. Both lengths are warmed up first (a static cache compiles
    for each)."""
    with torch.no_grad():
        _generate(model, ids, tokens + 1, **gen), _generate(model, ids, 1, **gen)
        gaps = [_generate(model, ids, tokens + 1, **gen) - _generate(model, ids, 1, **gen) for _ in range(repeats)]
    return statistics.median(gaps) / tokens * 1e3


def decode_hit_rate(model: torch.nn.Module, ids: torch.Tensor, tokens: int) -> float:
    """The slot hit rate of the decode steps alone: the counters of a 1 + `tokens` call less those of a 1-token
    call (its prompt's prefill step)."""

    def counted(new: int) -> tuple[int, int]:
        thm.reset_stats(model)
        with torch.no_grad():
            _generate(model, ids, new)
        layers = thm.stats(model).values()
        return sum(s.hits for s in layers), sum(s.hits + s.misses for s in layers)

    (hits, seen), (prompt_hits, prompt_seen) = counted(tokens + 1), counted(1)
    return (hits - prompt_hits) / max(1, seen - prompt_seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="embedded name, local directory or tiny:ARCH")
    parser.add_argument("--tokens", type=bounded(int, 1), default=32)
    parser.add_argument("--repeats", type=bounded(int, 1), default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    records = []
    try:  # all loaded before any timing: a mistyped name is a usage error, not a traceback after minutes
        models = {name: load_model(name)[0] for name in args.model or list(embedded_models())}
    except InputError as err:
        parser.error(str(err))
    for name, ref in models.items():
        ids = torch.randint(3, ref.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
        inductor = CompileConfig(fullgraph=True, mode="default")
        inductor._compile_all_devices = True
        rows = {
            "transformers eager": per_token_ms(ref, ids, args.tokens, args.repeats),
            "transformers + inductor": per_token_ms(
                copy.deepcopy(ref),
                ids,
                args.tokens,
                args.repeats,
                cache_implementation="static",
                compile_config=inductor,
            ),
        }
        hit_rates = {}
        for budget in (0.0, 0.25, 1.0):
            model = thm.patch_model(copy.deepcopy(ref), expert_budget=budget)
            impl = f"hybrid_moe budget {budget}"
            rows[impl] = per_token_ms(model, ids, args.tokens, args.repeats)
            hit_rates[impl] = decode_hit_rate(model, ids, args.tokens)
        torch._dynamo.reset()
        base = rows["transformers eager"]
        for impl, ms in rows.items():
            records.append(
                {
                    "model": name,
                    "impl": impl,
                    "ms_per_token": ms,
                    "vs_eager": ms / base,
                    "hit_rate": hit_rates.get(impl),
                }
            )
    if args.json:
        print(json.dumps(records, indent=1))
        return
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'model':<14} {'implementation':<26} {'ms/token':>9} {'x eager':>8} {'hit rate':>9}")
    for r in records:
        hit = "" if r["hit_rate"] is None else f"{r['hit_rate']:.1%}"
        print(f"{r['model']:<14} {r['impl']:<26} {r['ms_per_token']:>9.2f} {r['vs_eager']:>8.2f} {hit:>9}")


if __name__ == "__main__":
    main()
