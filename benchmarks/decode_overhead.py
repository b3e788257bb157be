"""Decode-step cost of the hybrid path against transformers itself, side by side in one run.

For each architecture's tiny model: per-token greedy decode time of the unpatched model (eager, and
compiled with Inductor over a static cache), and of the patched model compiled with the hybrid_moe
backend at expert budgets 0, 0.25 and 1.0. Median of several timed generate() calls after a warm-up
that compiles. On a CPU-only machine this measures the dispatch overhead (host sync, CPU share),
not an accelerator speedup.

    python benchmarks/decode_overhead.py [--arch deepseek_v3] [--tokens 32] [--repeats 5] [--json]
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
from torch_hybrid_moe.tiny_models import ARCHITECTURES, tiny_model


def per_token_ms(model: torch.nn.Module, ids: torch.Tensor, tokens: int, repeats: int, **gen: object) -> float:
    run = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, **gen)
    with torch.no_grad():
        model.generate(ids, **run)  # warm-up: compiles where compiling
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model.generate(ids, **run)
            times.append(time.perf_counter() - start)
    return statistics.median(times) / tokens * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=ARCHITECTURES, action="append")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    records = []
    for arch in args.arch or ARCHITECTURES:
        ref = tiny_model(arch)
        ids = torch.randint(3, 96, (1, 16), generator=torch.Generator().manual_seed(0))
        inductor = CompileConfig(fullgraph=True, mode="default")
        inductor._compile_all_devices = True
        rows = {
            "transformers eager": per_token_ms(ref, ids, args.tokens, args.repeats),
            "transformers + inductor": per_token_ms(
                copy.deepcopy(ref), ids, args.tokens, args.repeats, cache_implementation="static",
                compile_config=inductor,
            ),
        }
        for budget in (0.0, 0.25, 1.0):
            model = thm.patch_model(copy.deepcopy(ref), expert_budget=budget)
            rows[f"hybrid_moe budget {budget}"] = per_token_ms(model, ids, args.tokens, args.repeats)
        torch._dynamo.reset()
        base = rows["transformers eager"]
        for impl, ms in rows.items():
            records.append({"arch": arch, "impl": impl, "ms_per_token": ms, "vs_eager": ms / base})
    if args.json:
        print(json.dumps(records, indent=1))
        return
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'arch':<12} {'implementation':<26} {'ms/token':>9} {'x eager':>8}")
    for r in records:
        print(f"{r['arch']:<12} {r['impl']:<26} {r['ms_per_token']:>9.2f} {r['vs_eager']:>8.2f}")


if __name__ == "__main__":
    main()
