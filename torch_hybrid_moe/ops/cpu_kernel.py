"""Call the C++ CPU side (built by ops/kernel_build.py): the expert kernel's routes, measured per machine and
shape, and its dense matrix-vector products."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .kernel_build import best_isa, extension
from .measured import count, measured
from .quantize import kernel_operands, to_cpu_format


def _level(isa: int | None) -> int:
    """The ISA level to run at: the CPU's best, or one below it (for tests)."""
    level = best_isa() if isa is None else isa
    if not 0 <= level <= best_isa():
        raise ValueError(f"ISA level {level} not available here (best: {best_isa()})")
    return level


GEMM_KERNELS = ("fp32", "bf16", "amx")  # the C++ kernel's gemm_kernel codes, in order


@dataclass(frozen=True)
class GemmRoute:
    """Where an expert leaves the micro-kernels for a GEMM (from `tokens` tokens on), and which: torch's on fp32
    panels ("fp32"), torch's in bf16 on bf16 weights as stored or int8 / int4 weights dequantised to bf16 ("bf16"),
    or our AMX tiles on bf16 panels ("amx", csrc/amx_gemm.h). Which is fastest depends on the CPU (native bf16
    arithmetic, AMX, VNNI for the integer micro-kernels) and the shape: measured, not assumed."""

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
ROUTE_TOKENS = (16, 32, 64, 128, 256)  # tokens per expert at which the routes are compared
ROUTE_INTER = 512  # time scales with an expert's rows: wider experts are timed on this many intermediate columns


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


def gemm_route(hidden: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor | None) -> GemmRoute:
    """The prefill route measured fastest on this machine for experts shaped and stored like these (see `GemmRoute`),
    timed once per process and shape on experts of the same format; the micro-kernels for batches too small to
    reach any GEMM threshold (decode), which need no measurement."""
    if hidden.shape[0] < ROUTE_TOKENS[0]:
        return MICRO_KERNELS
    hidden_size = hidden.shape[1]
    group = 0 if gate_up_scale is None else hidden_size // gate_up_scale.shape[-1]
    return _measure_route(
        hidden_size, gate_up.shape[1] // 2, gate_up.dtype, group, hidden.dtype, torch.get_num_threads()
    )


def _stored_kernel(value: object) -> str:
    """A stored route's kernel, or ValueError (measured again): unknown, or AMX where this process cannot use it (the
    same CPU model under a kernel that refuses the tile state)."""
    if value not in GEMM_KERNELS or (value == "amx" and not amx_fits(32, 32)):
        raise ValueError(f"not a GEMM kernel for this machine: {value!r}")
    return str(value)


def amx_fits(hidden_size: int, inter: int) -> bool:
    """Whether the AMX tiles can take experts of this shape on this CPU (32-row panels of both projections)."""
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
    repeats: int = 3,
) -> GemmRoute:
    inter = min(inter, ROUTE_INTER)
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(2, 2 * inter, hidden_size, generator=g) * hidden_size**-0.5
    down = torch.randn(2, hidden_size, inter, generator=g) * inter**-0.5
    if group:  # int8, or int4 packed in uint8
        fmt = "int8" if stored == torch.int8 else "int4"
        (gu, gus), (dn, dns) = (kernel_operands(to_cpu_format(w, fmt, group)) for w in (gate_up, down))
    else:
        (gu, gus), (dn, dns) = (gate_up.to(stored), None), (down.to(stored), None)
    gemms = [GemmRoute(1, "fp32")]
    if activations == torch.bfloat16 and (stored == torch.bfloat16 or group):  # bf16 holds them, or they are rounded
        gemms.append(GemmRoute(1, "bf16"))
        if amx_fits(hidden_size, inter):
            gemms.append(GemmRoute(1, "amx"))
    wins: list[tuple[int, GemmRoute | None]] = []  # per token count: the fastest GEMM, or None where it loses
    for n in ROUTE_TOKENS:
        hidden = torch.randn(n, hidden_size, generator=g).to(activations)
        ids, weights = torch.tensor([[0, 1]]).expand(n, 2).contiguous(), torch.full((n, 2), 0.5)
        out = torch.zeros(n, hidden_size)
        seconds = interleaved_medians(
            [
                lambda r=r, x=hidden, i=ids, w=weights, o=out: extension().moe_experts(
                    x, i, w, gu, gus, dn, dns, best_isa(), r.tokens, r.code, o
                )
                for r in (MICRO_KERNELS, *gemms)
            ],
            repeats,
        )
        fastest = min(range(len(gemms)), key=lambda i: seconds[i + 1])
        wins.append((n, gemms[fastest] if seconds[fastest + 1] < seconds[0] else None))
    if wins[-1][1] is None:
        return MICRO_KERNELS
    start = len(wins) - 1  # the GEMM route from the smallest count from which it wins at every larger one
    while start > 0 and wins[start - 1][1] is not None:
        start -= 1
    return GemmRoute(wins[start][0], wins[-1][1].kernel)


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
    with fp32 group scales [N, K / group] (ops/quantize.py), streaming the weight once per few tokens."""
    level = _level(isa)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    extension().dense_matvec(x.contiguous(), weight, scale, level, out)
    return out
