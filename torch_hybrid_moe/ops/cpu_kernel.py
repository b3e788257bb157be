"""Call the C++ CPU side (built by ops/kernel_build.py): the expert kernel's routes, measured per machine and
shape, and its dense matrix-vector products."""

from __future__ import annotations

import functools
import itertools
import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from . import kernel_build
from .kernel_build import extension
from .measured import count, last_level_cache_bytes, measured
from .quantize import LANE_ROWS, kernel_operands, to_cpu_format, weight_rows


def best_isa() -> int:
    """The highest ISA level the kernel runs at here (-1: none), with this machine's lane starts measured and set
    first (`lane_starts`): the Python paths to the kernel ask this (or `gemm_route`, as a captured step's CPU task
    does) before their first call."""
    level = kernel_build.best_isa()
    if level > 0:
        lane_starts()
    return level


def _level(isa: int | None) -> int:
    """The ISA level to run at: the CPU's best, or one below it (for tests)."""
    best = best_isa()
    level = best if isa is None else isa
    if not 0 <= level <= best:
        raise ValueError(f"ISA level {level} not available here (best: {best})")
    return level


GEMM_KERNELS = ("fp32", "bf16", "amx")  # the C++ kernel's gemm_kernel codes, in order


@dataclass(frozen=True)
class GemmRoute:
    """Where an expert leaves the micro-kernels for a GEMM (from `tokens` tokens on), and which: torch's on fp32
    panels ("fp32"), torch's in bf16 on bf16 weights as stored or int8 / int4 weights dequantised to bf16 ("bf16"),
    or our AMX tiles on bf16 rows in place or int8 / int4 rows dequantised to bf16 panels ("amx",
    csrc/amx_gemm.h). Which is fastest depends on the CPU (native bf16 arithmetic, AMX, VNNI for the integer
    micro-kernels) and the shape: measured, not assumed."""

    tokens: int
    kernel: str = "fp32"

    def __post_init__(self) -> None:
        if self.kernel not in GEMM_KERNELS:
            raise ValueError(f"unknown GEMM kernel {self.kernel!r}: choose one of {', '.join(GEMM_KERNELS)}")

    @property
    def code(self) -> int:
        """The kernel as the C++ side numbers it."""
        return GEMM_KERNELS.index(self.kernel)


UNLIMITED = 2**62  # a token count no input reaches
MICRO_KERNELS = GemmRoute(UNLIMITED)  # no expert reaches the GEMM
ROUTE_TOKENS = (16, 32, 64, 128, 256, 512)  # tokens per expert at which the routes are compared
COLD_BYTES = 2**30  # at most this much memory for the copies that keep a route's measurement out of the caches
ROUTE_INTER = 512  # time scales with an expert's rows: wider experts are timed on this many intermediate columns
LANE_FORMATS = {1: ("int4",), 2: ("bf16", "int8", "int4")}  # the formats each ISA level has lanes for
LANE_TOKENS = (8, 16, 32, 64)  # tokens a call at which the lanes are timed against the per-row loop
LANE_HIDDEN = 2048  # the lanes are timed on experts of this many columns (and ROUTE_INTER intermediate ones)
LANE_GROUP = 64  # int8 / int4 experts timed in groups of this many columns (HybridMoEConfig's default)
LANE_STORAGE = {"bf16": (torch.bfloat16, 0), "int8": (torch.int8, LANE_GROUP), "int4": (torch.uint8, LANE_GROUP)}


def moe_experts(
    hidden: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    out: torch.Tensor,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    isa: int | None = None,
    route: GemmRoute | None = None,
) -> None:
    """out[t] += sum_k weights[t, k] * FFN_{ids[t, k]}(hidden[t]). `route` (default: the one measured fastest here for
    this shape, `gemm_route`) and `isa` below the CPU's best are for tests and benchmarks."""
    level = _level(isa)
    if route is None:
        route = gemm_route(hidden, gate_up, gate_up_scale)
    extension().moe_experts(
        hidden.contiguous(),
        ids.long().contiguous(),
        weights.float().contiguous(),
        gate_up,
        gate_up_scale,
        down,
        down_scale,
        level,
        route.tokens,
        route.code,
        out,
    )


def routed(tokens: int) -> bool:
    """Whether a batch of `tokens` rows can reach a GEMM route, so that its route is measured (decode's cannot)."""
    return tokens >= ROUTE_TOKENS[0]


def gemm_route(hidden: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor | None) -> GemmRoute:
    """The prefill route measured fastest on this machine for experts shaped and stored like these (see `GemmRoute`),
    timed once per process and shape on experts of the same format; the micro-kernels for batches too small to
    reach any GEMM threshold (decode), which need no measurement. Sets this machine's lane starts first (`best_isa`):
    a captured decode step's CPU task calls the kernel with this route directly."""
    best_isa()
    if not routed(hidden.shape[0]):
        return MICRO_KERNELS
    hidden_size = hidden.shape[1]
    laid = gate_up.dim() == 4  # int4 laid out for the lanes ([E, 2I / 16, H / 8, 64]; scales [E, 2I / 16, groups, 16])
    group = 0 if gate_up_scale is None else hidden_size // gate_up_scale.shape[-2 if laid else -1]
    inter = gate_up.shape[1] * (LANE_ROWS if laid else 1) // 2
    return _measure_route(hidden_size, inter, gate_up.dtype, group, hidden.dtype, torch.get_num_threads(), ROUTE_TOKENS)


def _stored_kernel(value: object) -> str:
    """A stored route's kernel, or ValueError (measured again): unknown, or AMX where this process cannot use it (the
    same CPU model under a kernel that refuses the tile state)."""
    if value not in GEMM_KERNELS or (value == "amx" and not amx_fits(32, 32)):
        raise ValueError(f"not a GEMM kernel for this machine: {value!r}")
    return str(value)


def amx_fits(hidden_size: int, inter: int) -> bool:
    """Whether the AMX tiles can take experts of this shape on this CPU (32 rows of both projections at a time)."""
    ext = extension()
    return ext is not None and bool(ext.amx_available()) and hidden_size % 32 == 0 and inter % 32 == 0


@measured(encode=lambda r: [r.tokens, r.kernel], decode=lambda v: GemmRoute(count(v[0]), _stored_kernel(v[1])))
def _measure_route(
    hidden_size: int,
    inter: int,
    stored: torch.dtype,
    group: int,
    activations: torch.dtype,
    threads: int,
    counts: tuple[int, ...],
    repeats: int = 3,
) -> GemmRoute:
    # `counts` is part of the stored key: a route measured at other counts is measured again. Up to 512 tokens: a lead
    # at 256 alone was extrapolated to every larger expert, and a stored route sent int4 experts from 207 tokens on to
    # fp32 panels, which ran at 52 GMAC/s at 256 against the micro-kernels' 61 (AVX2; benchmarks/RESULTS.md, 11-28).
    amx = amx_fits(hidden_size, inter)  # the model's own width decides: the stand-in below may fit where it does not
    if inter > ROUTE_INTER:  # a whole number of the model's groups (96 does not divide 512)
        inter = max(group, ROUTE_INTER - ROUTE_INTER % group) if group else ROUTE_INTER
    g = torch.Generator().manual_seed(0)
    (gu, gus, dn, dns), pairs = _cold_experts(hidden_size, inter, stored, group, g)
    turn = itertools.count()
    gemms = [GemmRoute(1, "fp32")]
    if activations == torch.bfloat16 and (stored == torch.bfloat16 or group):  # bf16 holds them, or they are rounded
        gemms.append(GemmRoute(1, "bf16"))
        if amx:
            gemms.append(GemmRoute(1, "amx"))
    micro: list[float] = []  # per token count: the micro-kernels' seconds, and each GEMM's
    gemm: list[list[float]] = []
    for n in counts:
        hidden, ids, weights, out = _timed_inputs(n, hidden_size, activations, pairs, g)
        seconds = interleaved_medians(
            [
                lambda r=r, x=hidden, i=ids, w=weights, o=out: extension().moe_experts(
                    x, i[next(turn) % pairs], w, gu, gus, dn, dns, best_isa(), r.tokens, r.code, o
                )
                for r in (MICRO_KERNELS, *gemms)
            ],
            repeats,
        )
        micro.append(seconds[0])
        gemm.append(seconds[1:])
    return _crossover(counts, micro, gemm, [r.kernel for r in gemms])


def _cold_experts(
    hidden_size: int, inter: int, stored: torch.dtype, group: int, g: torch.Generator
) -> tuple[list[torch.Tensor | None], int]:
    """Kernel operands (gate_up, its scales, down, its scales) of `pairs` pairs of random experts stored as `stored`
    (int8 / int4 in groups of `group` columns where `group`): a layer's experts stream from DRAM, which favours the
    routes that read each weight once, so each timed call takes the next pair of copies, spread over twice the largest
    cache (tiles that win on cached weights can lose here)."""
    gate_up = torch.randn(2, 2 * inter, hidden_size, generator=g) * hidden_size**-0.5
    down = torch.randn(2, hidden_size, inter, generator=g) * inter**-0.5
    if group:  # int8, or int4 packed in uint8
        fmt = "int8" if stored == torch.int8 else "int4"
        operands = [t for w in (gate_up, down) for t in kernel_operands(to_cpu_format(w, fmt, group))]
    else:
        operands = [gate_up.to(stored), None, down.to(stored), None]
    pair_bytes = sum(t.numel() * t.element_size() for t in operands if t is not None)
    pairs = max(1, min(-(-2 * last_level_cache_bytes() // pair_bytes), COLD_BYTES // pair_bytes))
    return [None if t is None else t.repeat(pairs, *[1] * (t.dim() - 1)) for t in operands], pairs


def lane_starts() -> dict[str, int]:
    """From how many tokens a call the kernel sums each format's rows as lanes at this CPU's best ISA level, measured
    here (once per machine, kept with the routes; at the thread count of the first call) and set in the kernel. The
    lanes lay a panel of rows out once per call and then run several times the per-row loop's rate: where that pays
    depends on the CPU (csrc/moe_cpu.cpp, lane_start). bf16 only where the CPU has AVX512-BF16 (the prefill
    attention's requirement too). One thread measures; the others wait for it (the timing sets the kernel's table)."""
    with _LANES_LOCK:
        return _lane_starts()


_LANES_LOCK = threading.Lock()


def _timed_inputs(
    n: int, hidden_size: int, activations: torch.dtype, pairs: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A timed call's hidden rows (n tokens), its routing for each of `pairs` pairs of cold experts (ids[j]: every
    token to pair j's two experts, weight 0.5 each) and its fp32 output."""
    hidden = torch.randn(n, hidden_size, generator=g).to(activations)
    ids = (2 * torch.arange(pairs)[:, None, None] + torch.tensor([0, 1])).expand(pairs, n, 2).contiguous()
    return hidden, ids, torch.full((n, 2), 0.5), torch.zeros(n, hidden_size)


@functools.cache
def _lane_starts() -> dict[str, int]:
    level, ext = kernel_build.best_isa(), extension()
    starts = {}
    for fmt in LANE_FORMATS.get(level, ()):
        if fmt == "bf16" and not ext.prefill_attention_available():
            continue
        starts[fmt] = _measure_lane_start(fmt, level, torch.get_num_threads(), LANE_TOKENS)
        ext.set_lane_start(level, fmt, starts[fmt])
    return starts


def _lane_count(value: object) -> int:
    """A stored lane start, or ValueError (measured again): a token count of at least 1."""
    if count(value) < 1:
        raise ValueError(f"not a lane start: {value!r}")
    return count(value)


@measured(decode=_lane_count)
def _measure_lane_start(fmt: str, level: int, threads: int, counts: tuple[int, ...], repeats: int = 3) -> int:
    # `counts` is part of the stored key, as for the routes
    stored, group = LANE_STORAGE[fmt]
    g = torch.Generator().manual_seed(0)
    (gu, gus, dn, dns), pairs = _cold_experts(LANE_HIDDEN, ROUTE_INTER, stored, group, g)
    activations = torch.bfloat16 if fmt == "bf16" else torch.float32  # bf16 lanes need bf16 values
    ext, turn, before = extension(), itertools.count(), extension().get_lane_start(level, fmt)
    rows: list[float] = []
    lanes: list[float] = []
    try:
        for n in counts:
            hidden, ids, weights, out = _timed_inputs(n, LANE_HIDDEN, activations, pairs, g)

            def run(start: int, x: torch.Tensor = hidden, i: torch.Tensor = ids, w: torch.Tensor = weights) -> None:
                ext.set_lane_start(level, fmt, start)
                ext.moe_experts(x, i[next(turn) % pairs], w, gu, gus, dn, dns, level, UNLIMITED, 0, out)

            row_s, lane_s = interleaved_medians([lambda: run(UNLIMITED), lambda: run(1)], repeats)
            rows.append(row_s)
            lanes.append(lane_s)
    finally:
        ext.set_lane_start(level, fmt, before)
    return lane_start_from(counts, rows, lanes)


def lane_start_from(counts: Sequence[int], rows: Sequence[float], lanes: Sequence[float]) -> int:
    """The lanes' start from measured seconds per token count: the smallest count from which the lanes beat the
    per-row loop at every larger one; UNLIMITED where they lose at the largest."""
    start = UNLIMITED
    for n, row_s, lane_s in reversed(list(zip(counts, rows, lanes, strict=True))):
        if lane_s >= row_s:
            break
        start = n
    return start


def _crossover(
    counts: Sequence[int], micro: Sequence[float], gemm: Sequence[Sequence[float]], kernels: Sequence[str]
) -> GemmRoute:
    """The route from measured seconds per token count: the GEMM fastest at the largest count, from the
    smallest count from which it beats the micro-kernels at every larger one. Between a losing and a winning count
    the start is where the two times cross, linearly interpolated: the counts are a factor 2 apart, and a layer's
    experts spread around its mean count, so half a step is a tenth of the layer's time."""
    k = min(range(len(kernels)), key=lambda i: gemm[-1][i])
    margin = [g[k] - m for m, g in zip(micro, gemm, strict=True)]  # < 0 where the GEMM wins
    if margin[-1] >= 0:
        return MICRO_KERNELS
    start = len(margin) - 1
    while start > 0 and margin[start - 1] < 0:
        start -= 1
    tokens = counts[start]
    if start > 0:
        low, lose, win = counts[start - 1], margin[start - 1], margin[start]
        tokens = low + math.ceil((tokens - low) * lose / (lose - win))
    return GemmRoute(tokens, kernels[k])


def interleaved_medians(runs: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    """Median seconds of each run, taking turns; the first round warms them up."""
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats + 1):
        for i, run in enumerate(runs):
            start = time.perf_counter()
            run()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t[1:]) for t in times]


def dense_matvec(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None, isa: int | None = None
) -> torch.Tensor:
    """x [T, K] @ weight.T in fp32: a bf16 / fp16 / fp32 weight [N, K], or int8 [N, K] / packed int4 [N, K / 2]
    with fp16 group scales [N, K / group] (ops/quantize.py; int4 maybe laid out: [N / 16, K / 8, 64] with scales
    [N / 16, K / group, 16]), streaming the weight once per few tokens."""
    level = _level(isa)
    out = torch.empty(x.shape[0], weight_rows(weight), dtype=torch.float32)
    extension().dense_matvec(x.contiguous(), weight, scale, level, out)
    return out


def dense_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] times an int8 [N, K] / packed int4 [N, K / 2] weight with its fp16 group scales, plus bias, in x's
    dtype: the activations rounded as the micro-kernels round them, the weight dequantised a panel of rows at a time
    for torch's fp32 GEMM (the many-row route of a quantised linear)."""
    return extension().dense_gemm(x, weight, scale, bias)
