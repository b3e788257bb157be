"""CPU MoE layer cost against the machine's memory-bandwidth floor and its matmul rate.

Measures read bandwidth first, then for real layer shapes (DeepSeek-V2-Lite, Qwen3-30B-A3B, one Mixtral
8x7B layer) times decode (1 and 8 tokens: bandwidth-bound, reported as GB/s of weights read and % of the
measured bandwidth) and a 512-token prefill (compute-bound: TFLOP/s and % of a large bf16 matmul's rate,
plus % of fp32's), side by side in one run: a per-expert torch loop, our kernel (`hybrid_moe::cpu_experts`)
with bf16, int8 and int4 weights, and KTransformers' CPU MoE when `kt-kernel` is installed. Every
repetition draws fresh routing and hidden states and runs every implementation on them; medians are
reported. Each implementation is first checked against a float64 reference of the weights it holds
(dequantised ones for int8 / int4). Prefill is also put against F.linear alone on the projections of the experts
each routing activates, at the rows it gives each, timed in the same turns (this host's speed moves between
minutes): each expert's own weights streamed from DRAM as a layer's are, or one expert's every time (cached).

    python benchmarks/cpu_moe.py [--shape deepseek-v2-lite] [--repeats 7] [--json]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import torch_hybrid_moe  # noqa: F401  (registers the ops)
from torch_hybrid_moe.ops import cpu_kernel, kernel_build
from torch_hybrid_moe.ops.quantize import QuantizedWeight, kernel_operands, to_cpu_format
from torch_hybrid_moe.runtime.expert_store import laid_out_for_kernel

sys.path.insert(0, str(Path(__file__).parent))
import kt_kernel_baseline

from torch_hybrid_moe.cli import bounded


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


def linear_bars(gate_up: torch.Tensor, down: torch.Tensor, tokens: int) -> list[Bar]:
    """F.linear alone on each active expert's two projections at the rows a routing of `tokens` tokens gives it: no
    gather, SiLU or scatter; torch's GEMM rate on these matrices, the bar for the kernel's prefill route.
    Weights in bf16 and in fp32 (the faster on CPUs without native bf16 arithmetic); "streamed" takes each expert's
    own weights, from DRAM as a layer does, "cached" expert 0's every time (in the caches where they fit)."""
    gen = torch.Generator().manual_seed(1)
    bars = []
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        gu, dn = gate_up.to(dtype), down.to(dtype)
        x = torch.randn(tokens, gu.shape[2], generator=gen).to(dtype)
        h = torch.randn(tokens, dn.shape[2], generator=gen).to(dtype)

        def run(ids: torch.Tensor, cached: bool, gu=gu, dn=dn, x=x, h=h) -> None:
            for e, n in zip(*ids.unique(return_counts=True), strict=True):
                e = 0 if cached else int(e)
                F.linear(x[:n], gu[e])
                F.linear(h[:n], dn[e])

        bars += [Bar(name, w, functools.partial(run, cached=w == "cached")) for w in ("streamed", "cached")]
    return bars


def torch_loop(
    hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The baseline: one pass over the activated experts with plain torch ops."""
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gate, up = F.linear(hidden[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]).float()
        out.index_add_(0, tok, y * weights[tok, slot, None])
    return out


@dataclass
class Impl:
    """One implementation on one shape: its call, the bytes one expert's weights occupy, and the float64
    weights it stands for (for the correctness check)."""

    name: str
    dtype: str
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    expert_bytes: int
    reference_weights: Callable[[int], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Bar:
    """F.linear on the experts a routing activates (`linear_bars`), timed in the same turns as the
    implementations: this host's speed moves between minutes, so a bar timed apart says little."""

    dtype: str
    weights: str  # "streamed" or "cached"
    run: Callable[[torch.Tensor], None]  # on a routing's expert ids


def implementations(gate_up: torch.Tensor, down: torch.Tensor) -> list[Impl]:
    """The torch loop and our kernel in each CPU weight format."""

    def dense(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return gate_up[e].double(), down[e].double()

    bf16_bytes = gate_up[0].nbytes + down[0].nbytes

    def ours(gu: torch.Tensor | QuantizedWeight, dn: torch.Tensor | QuantizedWeight):
        (g, gs), (d, ds) = kernel_operands(gu), kernel_operands(dn)

        def run(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(hidden.shape, dtype=torch.float32)
            torch.ops.hybrid_moe.cpu_experts(hidden, ids, weights, g, d, gs, ds, out)
            return out

        return run

    impls = [
        Impl("torch_loop", "bf16", lambda h, i, w: torch_loop(h, i, w, gate_up, down), bf16_bytes, dense),
        Impl("hybrid_moe", "bf16", ours(gate_up, down), bf16_bytes, dense),
    ]
    for fmt in ("int8", "int4"):
        # int4 laid out for the lanes where the patched model's CPU-only stores would be (measured once per shape)
        gu, dn = laid_out_for_kernel(*(to_cpu_format(w, fmt, 64) for w in (gate_up, down)))
        impls.append(
            Impl(
                "hybrid_moe",
                fmt,
                ours(gu, dn),
                gu.nbytes_per_expert() + dn.nbytes_per_expert(),
                lambda e, gu=gu, dn=dn: (gu[e].double(), dn[e].double()),
            )
        )
    return impls


def kt_kernel_impl(gate_up: torch.Tensor, down: torch.Tensor, top_k: int) -> Impl:
    """KTransformers' BF16 CPU MoE on the same weights. Its worker threads are pinned and stay busy while it
    lives, which would slow everything else on a small machine: build it only for its own timing block."""
    kt = kt_kernel_baseline.KTMoE(gate_up, down, top_k, max_tokens=512, threads=torch.get_num_threads())
    return Impl(
        "kt-kernel",
        "bf16",
        lambda h, i, w: kt(h, i, w).float(),
        gate_up[0].nbytes + down[0].nbytes,
        lambda e: (gate_up[e].double(), down[e].double()),
    )


def reference(
    hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, expert: Callable, rows: list[int]
) -> torch.Tensor:
    """float64 result for the given token rows."""
    out = torch.zeros(len(rows), hidden.shape[1], dtype=torch.float64)
    for i, t in enumerate(rows):
        for k in range(ids.shape[1]):
            gate_up, down = expert(int(ids[t, k]))
            gate, up = (gate_up @ hidden[t].double()).chunk(2)
            out[i] += float(weights[t, k]) * (down @ (F.silu(gate) * up))
    return out


def routing(shape: Shape, tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(shape.experts, generator=gen)[: shape.top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, shape.top_k, generator=gen).softmax(-1)
    hidden = torch.randn(tokens, shape.hidden, generator=gen).bfloat16()
    return hidden, ids, weights


def check(impl: Impl, shape: Shape, regime: str, tokens: int, gen: torch.Generator) -> None:
    """Two token rows against float64 of the weights the implementation holds."""
    inputs = routing(shape, tokens, gen)
    rows = list(range(min(tokens, 2)))
    want = reference(*inputs, impl.reference_weights, rows)
    got = impl.run(*inputs)[rows].double()
    err = ((got - want).abs().max() / want.abs().max()).item()
    if err > 2e-2:
        raise AssertionError(f"{impl.name} {impl.dtype} on {shape.name} {regime} {tokens}: relative error {err:.3g}")


def median_ms(
    impls: list[Impl], bars: list[Bar], shape: Shape, tokens: int, repeats: int, gen: torch.Generator
) -> tuple[list[float], list[float], float]:
    """Median ms per implementation and per F.linear bar, every repetition running all of them on the same fresh
    routing (interleaved, so machine noise hits them alike, in a rotating order), and the mean number of distinct
    experts it activated."""
    runs = [impl.run for impl in impls] + [lambda h, i, w, bar=bar: bar.run(i) for bar in bars]
    times: list[list[float]] = [[] for _ in runs]
    active = []
    for rep in range(repeats):
        inputs = routing(shape, tokens, gen)
        active.append(len(inputs[1].unique()))
        # the order rotates each repetition: the bf16 rows share their weights, and a row right after another
        # on the same weights would find them in the last-level cache where it holds a decode step's working set
        for i in [(rep + k) % len(runs) for k in range(len(runs))]:
            start = time.perf_counter()
            runs[i](*inputs)
            times[i].append(time.perf_counter() - start)
    ms = [statistics.median(t) * 1e3 for t in times]
    return ms[: len(impls)], ms[len(impls) :], statistics.mean(active)


def bench_shape(shape: Shape, repeats: int, bandwidth: float, mm_bf16: float, mm_fp32: float) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(shape.experts, 2 * shape.inter, shape.hidden, generator=gen) * 0.02).bfloat16()
    down = (torch.randn(shape.experts, shape.hidden, shape.inter, generator=gen) * 0.02).bfloat16()
    groups = [implementations(gate_up, down)]
    if kt_kernel_baseline.available():
        groups.append(lambda: [kt_kernel_impl(gate_up, down, shape.top_k)])
    records: list[dict] = []
    loop_ms: dict[int, float] = {}
    bar_best: dict[int, dict[str, float]] = {}  # per token count: the best F.linear TFLOP/s, cached and streamed
    for group in groups:
        impls = group if isinstance(group, list) else group()
        for regime, tokens in REGIMES:
            for impl in impls:
                check(impl, shape, regime, tokens, gen)
            # the bars run in the first group's turns; kt-kernel's own block is put against those
            bars = linear_bars(gate_up, down, tokens) if regime == "prefill" and tokens not in bar_best else []
            reps = repeats if regime == "decode" else max(3, repeats // 2)
            ms, bar_ms, active = median_ms(impls, bars, shape, tokens, reps, gen)
            loop_ms.setdefault(tokens, ms[0])
            flop = 2 * 3 * shape.hidden * shape.inter * tokens * shape.top_k
            if bars:
                bar_best[tokens] = {
                    w: max(flop / m / 1e9 for b, m in zip(bars, bar_ms) if b.weights == w)
                    for w in ("cached", "streamed")
                }
            best = bar_best.get(tokens, {})
            for impl, m in zip(impls, ms):
                gb_s = active * impl.expert_bytes / m / 1e6
                tflops = flop / m / 1e9
                records.append(
                    {
                        "shape": shape.name,
                        "regime": regime,
                        "tokens": tokens,
                        "impl": impl.name,
                        "dtype": impl.dtype,
                        "ms": m,
                        "gb_per_s": gb_s,
                        "pct_of_bandwidth": 100 * gb_s / bandwidth,
                        "tflops": tflops,
                        "pct_of_matmul": 100 * tflops / mm_bf16,
                        "pct_of_fp32_matmul": 100 * tflops / mm_fp32,
                        "x_torch_loop": loop_ms[tokens] / m,
                    }
                    | {f"pct_of_{w}_linear": 100 * tflops / b for w, b in best.items()}
                )
            for bar, m in zip(bars, bar_ms):
                records.append(
                    {
                        "shape": shape.name,
                        "regime": regime,
                        "tokens": tokens,
                        "impl": "linear",
                        "dtype": bar.dtype,
                        "weights": bar.weights,
                        "expert_tokens": tokens * shape.top_k / active,
                        "ms": m,
                        "tflops": flop / m / 1e9,
                    }
                )
            del bars  # their fp32 copies of every expert, before the next timings
        del impls
        gc.collect()  # ends kt-kernel's worker pool before the next shape
    order = {(r["impl"], r["dtype"], r.get("weights")): i for i, r in enumerate(records)}
    return sorted(records, key=lambda r: (r["tokens"], order[(r["impl"], r["dtype"], r.get("weights"))]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), action="append")
    parser.add_argument("--repeats", type=bounded(int, 1), default=7)
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
        records += bench_shape(SHAPES[name], args.repeats, bandwidth, mm, mm32)
    if args.json:
        print(json.dumps(records, indent=1))
        return
    print(
        f"{torch.get_num_threads()} threads, kernel ISA {kernel_build.ISA_NAMES.get(cpu_kernel.best_isa(), 'none')}; "
        f"read bandwidth {bandwidth:.1f} GB/s; matmul bf16 {mm:.4f} / fp32 {mm32:.4f} TFLOP/s"
    )
    print(
        f"{'shape':<17} {'regime':<8} {'tok':>4} {'impl':<11} {'dtype':<5} {'ms':>9} {'GB/s':>6} {'%bw':>4} "
        f"{'TFLOP/s':>8} {'%mm':>5} {'%mm32':>5} {'x loop':>6}"
    )
    for r in records[3:]:
        if r["impl"] == "linear":
            print(
                f"{r['shape']:<17} {r['regime']:<8} {r['tokens']:>4} {'F.linear':<11} {r['dtype']:<5} {r['ms']:>9.2f} "
                f"{'':>11} {r['tflops']:>8.4f}   (the active experts' projections alone, "
                f"{r['expert_tokens']:.0f} rows on average, {r['weights']} weights)"
            )
            continue
        print(
            f"{r['shape']:<17} {r['regime']:<8} {r['tokens']:>4} {r['impl']:<11} {r['dtype']:<5} {r['ms']:>9.2f} "
            f"{r['gb_per_s']:>6.1f} {r['pct_of_bandwidth']:>4.0f} {r['tflops']:>8.4f} {r['pct_of_matmul']:>5.0f} "
            f"{r['pct_of_fp32_matmul']:>5.0f} {r['x_torch_loop']:>6.2f}"
            + (
                f" {r['pct_of_cached_linear']:>4.0f}% / {r['pct_of_streamed_linear']:>3.0f}%"
                " of F.linear cached / streamed"
                if "pct_of_cached_linear" in r
                else ""
            )
        )


if __name__ == "__main__":
    main()
