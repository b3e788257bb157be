"""CPU MoE layer cost against the machine's memory-bandwidth floor and its matmul rate.

Measures read bandwidth first, then for real layer shapes (DeepSeek-V2-Lite, Qwen3-30B-A3B, one Mixtral
8x7B layer) times decode (1 and 8 tokens: bandwidth-bound, reported as GB/s and % of the measured
bandwidth) and a 512-token prefill (compute-bound: TFLOP/s and % of a large bf16 matmul), for each
implementation side by side: a per-expert torch loop and the `hybrid_moe::cpu_experts` op. Fresh random routing and hidden states every repetition,
median of the repetitions; each implementation is first checked against a float64 reference.

    python benchmarks/cpu_moe.py [--shape deepseek-v2-lite] [--repeats 7] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import torch_hybrid_moe  # noqa: F401  (registers the ops)


@dataclass(frozen=True)
class Shape:
    name: str
    experts: int
    top_k: int
    hidden: int
    inter: int


SHAPES = {
    s.name: s
    for s in (
        Shape("deepseek-v2-lite", 64, 6, 2048, 1408),
        Shape("qwen3-30b-a3b", 128, 8, 2048, 768),
        Shape("mixtral-8x7b", 8, 2, 4096, 14336),
    )
}
REGIMES = (("decode", 1), ("decode", 8), ("prefill", 512))


def _median_seconds(fn: Callable[[], object], repeats: int, setup: Callable[[], None] | None = None) -> float:
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def read_bandwidth_gb_s(repeats: int, mib: int = 1024) -> float:
    """Bytes per second of summing a buffer far larger than the caches."""
    x = torch.ones(mib * 2**20 // 4)
    x.sum()
    return x.nbytes / _median_seconds(x.sum, repeats) / 1e9


def matmul_tflops(repeats: int, dtype: torch.dtype, n: int = 2048) -> float:
    """A large square matmul's rate through F.linear (on CPU builds without a bf16 GEMM, `a @ b` in bf16
    falls to a naive kernel tens of times slower than F.linear's oneDNN path; F.linear is the fair bar)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    F.linear(a, b)
    return 2 * n**3 / _median_seconds(lambda: F.linear(a, b), repeats) / 1e12


def torch_loop(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The baseline: one pass over the activated experts with plain torch ops."""
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gate, up = F.linear(hidden[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]).float()
        out.index_add_(0, tok, y * weights[tok, slot, None])
    return out


def hybrid_moe_op(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    torch.ops.hybrid_moe.cpu_experts(hidden, ids, weights, gate_up, down, out)
    return out


IMPLS: dict[str, Callable] = {"torch_loop": torch_loop, "hybrid_moe": hybrid_moe_op}


def reference(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """float64 result for the given token rows."""
    out = torch.zeros(len(rows), hidden.shape[1], dtype=torch.float64)
    for i, t in enumerate(rows):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = (gate_up[e].double() @ hidden[t].double()).chunk(2)
            out[i] += float(weights[t, k]) * (down[e].double() @ (F.silu(gate) * up))
    return out


def routing(shape: Shape, tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(shape.experts, generator=gen)[: shape.top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, shape.top_k, generator=gen).softmax(-1)
    hidden = torch.randn(tokens, shape.hidden, generator=gen).bfloat16()
    return hidden, ids, weights


def bench_shape(shape: Shape, repeats: int, bandwidth: float, mm_tflops: float) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(shape.experts, 2 * shape.inter, shape.hidden, generator=gen) * 0.02).bfloat16()
    down = (torch.randn(shape.experts, shape.hidden, shape.inter, generator=gen) * 0.02).bfloat16()
    expert_bytes = (gate_up[0].nbytes + down[0].nbytes)
    records = []
    for regime, tokens in REGIMES:
        check = routing(shape, tokens, gen)
        rows = list(range(min(tokens, 4)))
        want = reference(*check, gate_up, down, rows)
        for impl, fn in IMPLS.items():
            got = fn(*check, gate_up, down)[rows].double()
            err = ((got - want).abs().max() / want.abs().max()).item()
            if err > 2e-2:
                raise AssertionError(f"{impl} on {shape.name} {regime} {tokens}: relative error {err:.3g}")
            inputs: list[tuple] = []
            seconds = _median_seconds(lambda: fn(*inputs[-1], gate_up, down), repeats,
                                      setup=lambda: inputs.append(routing(shape, tokens, gen)))
            active = sum(len(inp[1].unique()) for inp in inputs) / len(inputs)
            gb_s = active * expert_bytes / seconds / 1e9
            flops = 2 * 3 * shape.hidden * shape.inter * tokens * shape.top_k
            records.append({
                "shape": shape.name, "regime": regime, "tokens": tokens, "impl": impl, "dtype": "bf16",
                "ms": seconds * 1e3, "gb_per_s": gb_s, "pct_of_bandwidth": 100 * gb_s / bandwidth,
                "tflops": flops / seconds / 1e12, "pct_of_matmul": 100 * flops / seconds / 1e12 / mm_tflops,
            })
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), action="append")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    bandwidth = read_bandwidth_gb_s(args.repeats)
    mm = matmul_tflops(args.repeats, torch.bfloat16)
    mm32 = matmul_tflops(args.repeats, torch.float32)
    records = [
        {"impl": "bandwidth", "gb_per_s": bandwidth},
        {"impl": "bf16_matmul", "tflops": mm},
        {"impl": "fp32_matmul", "tflops": mm32},
    ]
    for name in args.shape or list(SHAPES):
        records += bench_shape(SHAPES[name], args.repeats, bandwidth, mm)
    if args.json:
        print(json.dumps(records, indent=1))
        return
    print(f"{torch.get_num_threads()} threads; read bandwidth {bandwidth:.1f} GB/s; "
          f"matmul bf16 {mm:.4f} / fp32 {mm32:.4f} TFLOP/s")
    print(f"{'shape':<17} {'regime':<8} {'tok':>4} {'impl':<11} {'ms':>8} {'GB/s':>7} {'%bw':>5} {'TFLOP/s':>8} {'%mm':>5}")
    for r in records[3:]:
        print(f"{r['shape']:<17} {r['regime']:<8} {r['tokens']:>4} {r['impl']:<11} {r['ms']:>8.2f} "
              f"{r['gb_per_s']:>7.1f} {r['pct_of_bandwidth']:>5.0f} {r['tflops']:>8.4f} {r['pct_of_matmul']:>5.0f}")


if __name__ == "__main__":
    main()
