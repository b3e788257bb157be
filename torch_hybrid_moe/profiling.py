"""Warm-up cost profile of the machine at hand: one expert's time on the CPU (the project's own kernel,
`hybrid_moe::cpu_experts`), on the GPU and over the pinned host-to-device link, fitted to the cost model's
form so that schedulers and the simulator keep their one interface (`CostModel.t_cpu`, `t_gpu`, `t_transfer`).

`profile_hardware(expert)` measures each side at a few token counts (median of repeats; the CPU in the host format
whose bytes per weight the shape has, bf16, fp32, int8 or int4 (`host_format`), so a fitted bandwidth divides the
bytes its kernel reads; the GPU in its slots' dtype, `slot_format`), fits `overhead + max(read time, tokens x
compute time)` to each curve and returns a `HardwareProfile` whose `hardware` is a `Hardware(name="local", ...)`
preset and whose `cost_model()` is the `CostModel` built from it. Without CUDA the GPU side and the link come from a
named preset, and the profile says so. Measurements are cached on disk as JSON (`$XDG_CACHE_HOME/torch_hybrid_moe/`
or `~/.cache/torch_hybrid_moe/`), keyed by CPU model, thread count, torch version, kernel ISA, expert shape and
format, token counts and GPU name, so the second call measures nothing; `refresh=True` measures again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import cast

import torch
from tqdm.auto import tqdm

from .cost_model import (
    BANDWIDTH_EFFICIENCY,
    COMPUTE_EFFICIENCY,
    HARDWARE,
    PCIE_EFFICIENCY,
    CostModel,
    ExpertShape,
    Hardware,
)
from .errors import InputError
from .ops.measured import cache_dir, cpu_model
from .ops.quantize import BITS, expert_bytes_per_weight, kernel_operands, to_cpu_format

FORMAT = 2  # bump when what a cached measurement means changes (2: GPU experts timed inside a CUDA graph)
DEFAULT_TOKENS = (1, 4, 16, 64)
DEFAULT_PRESET = "rtx4090"  # GPU and link figures where this machine has no CUDA device
POOL_BYTES = 256 * 2**20  # experts cycled through per measurement, so that their weights come from DRAM, not cache
GRAPH_EXPERTS = 64  # at most this many experts of the pool in one timed CUDA graph, computed in turn
TINY_POOL_BYTES = 2**20  # the tiny experts of a call's fixed cost (`_expert_pool(tiny=True)`): all in the caches
SHARE_EXPERTS = 8  # the grouped slot share is timed over 1 and this many experts: its fixed part and one expert's
SMALL_COPY = 64 * 2**10  # bytes of the second, latency-bound copy that separates the link's latency from its rate
# one layer step the schedulers' tensor forms are timed on: DeepSeek-V2-Lite's 64 experts, 16 in slots, the 6 of one
# token active (3 of them resident); PLACEMENT_CALLS such decisions in one timed CUDA graph
PLACEMENT_EXPERTS, PLACEMENT_SLOTS, PLACEMENT_ACTIVE, PLACEMENT_CALLS = 64, 16, 6, 32


@dataclass(frozen=True)
class CurveFit:
    """`overhead_s + max(read_s, tokens * token_s)`: the cost model's form of one expert's time on a device."""

    overhead_s: float
    read_s: float
    token_s: float

    def __call__(self, tokens: int) -> float:
        return self.overhead_s + max(self.read_s, tokens * self.token_s) if tokens > 0 else 0.0


def fit_curve(tokens: Sequence[int], seconds: Sequence[float], overhead_s: float | None = None) -> CurveFit:
    """Least relative squared error fit of `CurveFit` to measured (tokens, seconds), all terms >= 0.

    Each split of the token counts into a read-bound low part and a compute-bound high part is a linear
    least-squares problem (non-negative, rows scaled by 1 / measured); the split whose fitted curve is
    closest to the measurements wins. Where no point is read-bound the read time is put at the smallest
    count's compute time (the least bandwidth the data allows), and likewise the other way round.

    `overhead_s`, a call's fixed cost timed apart (on an expert that stays in the caches), is taken as given: the
    curve alone cannot tell it from the read time (read-bound points all give overhead + read), and a free fit put
    nearly all of a measured 1-token call into the overhead, fitting 917 GB/s on a 20 GB/s machine (capped at 90%
    of the fastest call, so a noisy timing cannot leave the read no time).
    """
    import numpy as np
    from scipy.optimize import minimize, nnls

    pairs = sorted(zip(tokens, seconds))
    if not pairs or any(n <= 0 or s <= 0 for n, s in pairs):
        raise ValueError(f"need positive token counts and times, got {pairs}")
    fixed = None if overhead_s is None else min(max(overhead_s, 0.0), 0.9 * min(s for _, s in pairs))
    best: tuple[float, CurveFit] | None = None
    for split in range(len(pairs) + 1):
        rows = [[1.0, 1.0, 0.0] if i < split else [1.0, 0.0, float(n)] for i, (n, _) in enumerate(pairs)]
        if fixed is None:
            a = [[v / s for v in row] for row, (_, s) in zip(rows, pairs)]
            (overhead, read, token), _ = nnls(np.array(a), np.ones(len(pairs)))
        else:  # the overhead known: the rest of each time is read or compute
            a = [[v / s for v in row[1:]] for row, (_, s) in zip(rows, pairs)]
            (read, token), _ = nnls(np.array(a), np.array([1 - fixed / s for _, s in pairs]))
            overhead = fixed
        if split == 0:
            read = token * pairs[0][0]
        elif split == len(pairs):
            token = read / pairs[-1][0]
        fit = CurveFit(float(overhead), max(float(read), 1e-12), max(float(token), 1e-15))
        error = sum((fit(n) / s - 1) ** 2 for n, s in pairs)
        if best is None or error < best[0] - 1e-15:
            best = (error, fit)
    assert best is not None  # pairs is not empty, so the first split always sets it
    if best[0] < 1e-18:
        return best[1]
    # A split's linear solution may break the max()'s own order (a read-bound point whose compute time is
    # higher): polish the best one on the real objective, in log space (every term stays >= 0).
    start = best[1]
    floor = 1e-9 * min(s for _, s in pairs)

    def curve(x: np.ndarray) -> CurveFit:
        terms = [float(v) for v in np.exp(x)]
        return CurveFit(*terms) if fixed is None else CurveFit(fixed, *terms)

    def objective(x: np.ndarray) -> float:
        f = curve(x)
        return sum((f(n) / s - 1) ** 2 for n, s in pairs)

    x0 = np.log([max(start.overhead_s, floor), start.read_s, start.token_s][0 if fixed is None else 1 :])
    polished = minimize(objective, x0, method="Nelder-Mead", options={"xatol": 1e-6, "fatol": 1e-14, "maxiter": 2000})
    return curve(polished.x) if polished.fun < best[0] else start


@dataclass
class Measurements:
    """What the warm-up measured (seconds): per expert call at each token count, and the link."""

    key: dict
    cpu_s: dict[int, float]
    gpu_s: dict[int, float] | None = None  # None: no CUDA device
    transfer_s: float | None = None  # one expert's bytes, pinned host -> device
    small_transfer_s: float | None = None  # SMALL_COPY bytes, for the link's latency
    seconds: float = 0.0  # how long measuring took
    load: float | None = None  # 1-minute load average when measuring began (other work skews the times)
    # device seconds of each graph-capable scheduler's tensor form deciding one layer step (`measure_placement`);
    # None: no CUDA device, or a profile cached before these were measured
    placement_s: dict[str, float] | None = None
    # device seconds of the decode graph's slot share (`slot_experts_`, one grouped call) over 1 and SHARE_EXPERTS
    # experts, one token each (`measure_share`); None: no CUDA device, or a profile cached before it was measured
    gpu_share_s: dict[int, float] | None = None
    # seconds of one call on experts that stay in the caches (`measure_cpu_overhead`, `measure_gpu`): the fixed cost the
    # fit takes as given; None: a profile cached before it was measured (its fit guesses the split)
    cpu_overhead_s: float | None = None
    gpu_overhead_s: float | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Measurements:
        """Parse a cached measurement; ValueError unless every time is a positive, finite, plausible duration."""
        ints = lambda d: None if d is None else {_count(k): _duration(v) for k, v in d.items()}  # noqa: E731
        m = cls(
            data["key"],
            cast(dict[int, float], ints(data["cpu_s"])),  # None is rejected just below
            ints(data["gpu_s"]),
            data["transfer_s"],
            data["small_transfer_s"],
            data["seconds"],
            data.get("load"),
            None if data.get("placement_s") is None else {str(k): _duration(v) for k, v in data["placement_s"].items()},
            ints(data.get("gpu_share_s")),
            None if data.get("cpu_overhead_s") is None else _duration(data["cpu_overhead_s"]),
            None if data.get("gpu_overhead_s") is None else _duration(data["gpu_overhead_s"]),
        )
        if not m.cpu_s or (m.gpu_s is not None and set(m.gpu_s) != set(m.cpu_s)):
            raise ValueError("no CPU times, or GPU times at other token counts")
        if (m.gpu_s is None) != (m.transfer_s is None) or (m.transfer_s is None) != (m.small_transfer_s is None):
            raise ValueError("GPU times and link times must be present together")
        if m.placement_s is not None and m.gpu_s is None:
            raise ValueError("placement times without GPU times")
        if m.gpu_share_s is not None and m.gpu_s is None:
            raise ValueError("slot share times without GPU times")
        if m.gpu_overhead_s is not None and m.gpu_s is None:
            raise ValueError("a GPU call's overhead without GPU times")
        if m.gpu_share_s is not None and sorted(m.gpu_share_s) != [1, SHARE_EXPERTS]:
            raise ValueError(f"slot share times must be at 1 and {SHARE_EXPERTS} experts")
        if m.transfer_s is not None:
            m.transfer_s, m.small_transfer_s = _duration(m.transfer_s), _duration(m.small_transfer_s)
        return m


_SHORTEST_S = 1e-9  # no timed call is faster; far shorter times overflowed the fit
_LONGEST_S = 10.0  # no single expert call or copy of a real expert takes this long


def _count(key: object) -> int:
    """A token or expert count of a cached measurement, or ValueError."""
    n = int(str(key))
    if n <= 0:
        raise ValueError(f"count {key!r} is not positive")
    return n


def _duration(value: object) -> float:
    """A measured time in seconds, or ValueError: a hand-edited or corrupted cache must not reach the fit."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _SHORTEST_S <= value < _LONGEST_S:
        raise ValueError(f"time {value!r} is not in [{_SHORTEST_S}, {_LONGEST_S}) seconds")
    return float(value)


@dataclass
class HardwareProfile:
    """Measurements of one machine for one expert shape, and the `Hardware` fitted to them."""

    expert: ExpertShape
    measured: Measurements
    preset: str = DEFAULT_PRESET  # where the GPU side and link come from when `measured` has none
    cached: bool = False  # read from the disk cache rather than measured now
    path: Path | None = field(default=None, compare=False)

    @property
    def gpu_measured(self) -> bool:
        return self.measured.gpu_s is not None

    @cached_property
    def cpu_fit(self) -> CurveFit:
        m = self.measured
        return fit_curve(list(m.cpu_s), list(m.cpu_s.values()), m.cpu_overhead_s)

    @cached_property
    def gpu_fit(self) -> CurveFit | None:
        g = self.measured.gpu_s
        return fit_curve(list(g), list(g.values()), self.measured.gpu_overhead_s) if g else None

    @cached_property
    def hardware(self) -> Hardware:
        """The measured machine as a `Hardware` preset: fitted effective figures over the cost model's efficiencies,
        so `CostModel(hardware, expert)` gives back the fitted curves."""
        e, m = self.expert, self.measured
        cpu = self.cpu_fit
        fields = dict(
            cpu_bandwidth_gb_s=e.nbytes / cpu.read_s / 1e9 / BANDWIDTH_EFFICIENCY,
            cpu_tflops=e.flops_per_token / cpu.token_s / 1e12 / COMPUTE_EFFICIENCY,
            cpu_overhead_us=cpu.overhead_s * 1e6,
        )
        where = f"CPU {m.key['cpu']} ({m.key['threads']} threads, kernel {m.key['kernel']})"
        if self.gpu_fit is not None:
            gpu = self.gpu_fit
            # GPU times and link times are present together (Measurements.from_json checks it, measure sets them)
            assert m.transfer_s is not None and m.small_transfer_s is not None
            latency = max(
                0.0,
                m.small_transfer_s - SMALL_COPY * (m.transfer_s - m.small_transfer_s) / max(e.nbytes - SMALL_COPY, 1),
            )
            rate = e.nbytes / max(m.transfer_s - latency, 1e-12)  # bytes per second
            fields |= dict(
                gpu_bandwidth_gb_s=e.slot_nbytes / gpu.read_s / 1e9 / BANDWIDTH_EFFICIENCY,
                gpu_tflops=e.flops_per_token / gpu.token_s / 1e12 / COMPUTE_EFFICIENCY,
                gpu_overhead_us=gpu.overhead_s * 1e6,
                pcie_gb_s=rate / 1e9 / PCIE_EFFICIENCY,
                pcie_latency_us=latency * 1e6,
            )
            if m.gpu_share_s is not None:  # two points: the share's fixed part, and what each expert adds
                one, many = m.gpu_share_s[1], m.gpu_share_s[SHARE_EXPERTS]
                each = max(0.0, (many - one) / (SHARE_EXPERTS - 1))
                fields |= dict(gpu_share_overhead_us=max(0.0, one - each) * 1e6, gpu_share_expert_us=each * 1e6)
            where += f" + GPU {m.key['device']}, measured"
        else:
            p = HARDWARE[self.preset]
            fields |= dict(
                gpu_bandwidth_gb_s=p.gpu_bandwidth_gb_s,
                gpu_tflops=p.gpu_tflops,
                gpu_overhead_us=p.gpu_overhead_us,
                pcie_gb_s=p.pcie_gb_s,
                pcie_latency_us=p.pcie_latency_us,
            )
            where += f"; no CUDA device: GPU and link from preset {self.preset}"
        return Hardware("local", f"measured on this machine: {where}", **fields)

    def cost_model(self) -> CostModel:
        return CostModel(self.hardware, self.expert)

    def fit_errors(self) -> dict[str, dict[int, float]]:
        """Relative error of the fitted cost model at each measured token count (fitted / measured - 1)."""
        costs = self.cost_model()
        out = {"cpu": {n: costs.t_cpu(n) / s - 1 for n, s in self.measured.cpu_s.items()}}
        if self.measured.gpu_s:
            out["gpu"] = {n: costs.t_gpu(n) / s - 1 for n, s in self.measured.gpu_s.items()}
        return out


def profile_key(expert: ExpertShape, tokens: Sequence[int]) -> dict:
    """What a measurement depends on: the cache key."""
    from .ops import cpu_kernel, kernel_build

    isa = cpu_kernel.best_isa()
    return {
        "format": FORMAT,
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "kernel": kernel_build.ISA_NAMES.get(isa, "torch loop"),
        "expert": asdict(expert),
        "weights": weights_label(expert),  # what the CPU side computed from
        "tokens": sorted(int(n) for n in tokens),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
    }


def host_format(expert: ExpertShape) -> tuple[str, int]:
    """(format, group size) of the host copy whose bytes per weight `expert` has: "bfloat16" (2 bytes, fp16 alike),
    "float32", or "int8" / "int4" with one fp16 scale per group. ValueError where no format has that size."""
    b = expert.bytes_per_weight
    if b in (2, 4):
        return ("bfloat16" if b == 2 else "float32"), 0
    widest = max(expert.hidden, expert.inter)
    for fmt, bits in BITS.items():
        for group in range(32, widest + 32, 32):  # the smallest group whose expert has these bytes
            try:
                if abs(expert_bytes_per_weight(bits, group, expert.hidden, expert.inter) - b) < 1e-9:
                    return fmt, group
            except ValueError:  # a group some projection cannot be quantised in
                continue
    raise ValueError(
        f"no host format has {b} bytes per weight for {expert.hidden} x {expert.inter} experts (bf16: 2, fp32: 4, "
        "int8 / int4: 1 / 0.5 + 2 / group)"
    )


def weights_label(expert: ExpertShape) -> str:
    """The host format the CPU side of a profile of `expert` is measured in, as its key and report name it."""
    fmt, group = host_format(expert)
    return f"{fmt} (groups of {group})" if group else fmt


def slot_format(expert: ExpertShape) -> str:
    """The dtype an accelerator slot holds `expert` in: fp32 for 4-byte slots, else bf16 (quantised host copies are
    dequantised to the model's dtype, bf16 or fp16, on arrival)."""
    return "float32" if (expert.slot_bytes_per_weight or expert.bytes_per_weight) == 4 else "bfloat16"


Operands = tuple[torch.Tensor, torch.Tensor | None]  # weights and, where quantised, their scales


def _expert_pool(
    expert: ExpertShape, pool_bytes: int, device: str = "cpu", tiny: bool = False
) -> tuple[Operands, Operands]:
    """gate_up [E, 2I, H] and down [E, H, I] of enough experts to fill `pool_bytes` (at least 2), as kernel operands:
    on the CPU in the shape's host format (`host_format`), on the GPU as its slots hold them (`slot_format`).
    `tiny`: experts of the same format but the least width it takes (one group, at least 32), for a call's fixed
    cost."""
    fmt, group = host_format(expert) if device == "cpu" else (slot_format(expert), 0)
    g = torch.Generator().manual_seed(0)
    h, i = (max(32, group),) * 2 if tiny else (expert.hidden, expert.inter)

    def one(w: torch.Tensor) -> Operands:
        return kernel_operands(to_cpu_format(w, fmt, group)) if fmt in BITS else (w.to(getattr(torch, fmt)), None)

    gate_up = one(torch.randn(1, 2 * i, h, generator=g) * h**-0.5)
    down = one(torch.randn(1, h, i, generator=g) * i**-0.5)
    count = max(2, -(-pool_bytes // sum(t.nbytes for t in (*gate_up, *down) if t is not None)))

    def pool(operands: Operands) -> Operands:  # every page written: no first-touch faults
        data, scale = (None if t is None else t.to(device).expand(count, *t.shape[1:]).contiguous() for t in operands)
        assert data is not None
        return data, scale

    return pool(gate_up), pool(down)


def measure_cpu(
    expert: ExpertShape,
    tokens: Sequence[int],
    repeats: int,
    pool_bytes: int,
    bar: tqdm | None = None,
    budget_s: float = 3.0,
    tiny: bool = False,
) -> dict[int, float]:
    """Median seconds of one CPU expert call (`cpu_experts_into`, as the dispatch runs it) computing one expert
    for n tokens, each n in `tokens`. Consecutive calls use different experts of the pool, so weights are read from
    memory; the token counts take turns (one round = one call of each), so a burst of load from elsewhere skews all
    alike. After one warm-up round, `repeats` rounds, or at least 3 once `budget_s` has passed. `tiny`: on experts
    of the same format that stay in the caches (`_expert_pool`)."""
    from .ops.library import cpu_experts_into

    (gate_up, gate_up_scale), (down, down_scale) = _expert_pool(expert, pool_bytes, tiny=tiny)
    count, width = gate_up.shape[0], down.shape[1]  # down is [E, H, I]: its rows are the hidden size, unpacked
    g = torch.Generator().manual_seed(0)
    cases = {
        int(n): (
            torch.randn(n, width, generator=g).to(torch.bfloat16),
            torch.ones(n, 1),
            torch.zeros(n, width),
        )
        for n in tokens
    }
    ids = {n: [torch.full((n, 1), e, dtype=torch.long) for e in range(count)] for n in cases}
    times: dict[int, list[float]] = {n: [] for n in cases}
    call = 0
    started = time.perf_counter()
    for round_ in range(repeats + 1):
        for n, (hidden, weights, acc) in cases.items():
            t = time.perf_counter()
            cpu_experts_into(hidden, ids[n][call % count], weights, gate_up, down, gate_up_scale, down_scale, acc)
            if round_:  # round 0 warms up
                times[n].append(time.perf_counter() - t)
            call += 1
        if bar is not None and round_:
            bar.update(1)
        if round_ >= 3 and time.perf_counter() - started > budget_s:
            if bar is not None:
                bar.update(repeats - round_)
            break
    return {n: statistics.median(ts) for n, ts in times.items()}


OVERHEAD_CALLS = 50  # timed calls of the tiny expert: each takes microseconds


def measure_cpu_overhead(expert: ExpertShape) -> float:
    """Median seconds of one CPU expert call as `measure_cpu` makes it, on one token of experts of the same format
    small enough to stay in the caches: the call's fixed cost, which the fit takes as given (`fit_curve`)."""
    return measure_cpu(expert, (1,), OVERHEAD_CALLS, TINY_POOL_BYTES, tiny=True)[1]


def captured(run: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """`run` as one CUDA graph, captured after a warm-up run on a side stream (library handles and workspaces are
    created outside the capture, as torch asks)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def measure_gpu(
    expert: ExpertShape, tokens: Sequence[int], repeats: int, pool_bytes: int, bar: tqdm | None = None
) -> tuple[dict[int, float], float, float, float]:
    """On CUDA device 0: median seconds of one expert for n tokens with the runtime's GPU expert math, of one token
    of a tiny expert of the same format (the fixed cost, as `measure_cpu_overhead`), and of copying one expert's
    bytes and SMALL_COPY bytes from pinned host memory (CUDA events).

    The experts run inside a CUDA graph, so the time is the GPU's, not Python's launches: one captured graph
    computes up to GRAPH_EXPERTS experts of the pool in turn (the per-expert math of the staging ring and the
    eager path; the decode graph batches its slot experts, `slot_experts_`), and a replay's time is divided among
    them. Timed eagerly, the launches (~0.34 ms an expert on an H100) made every GPU expert look dearer than a
    CPU one."""
    from .ops.expert_math import expert_into_

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(fn: Callable[[int], object]) -> float:
        times = []
        fn(0)
        for i in range(1, repeats + 1):
            torch.cuda.synchronize()
            start.record()
            fn(i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    def experts(n: int, tiny: bool = False) -> float:  # the pool is freed on return, before the copies are timed
        (gate_up, _), (down, _) = _expert_pool(expert, TINY_POOL_BYTES if tiny else pool_bytes, "cuda", tiny)
        width = down.shape[1]  # down is [E, H, I]: its rows are the hidden size
        hidden = torch.randn(n, width, device="cuda", dtype=gate_up.dtype)
        tokens = torch.arange(n, device="cuda")
        weights = torch.ones(n, device="cuda")
        acc = torch.zeros(n, width, device="cuda")
        chain = range(min(GRAPH_EXPERTS, gate_up.shape[0]))  # distinct experts: each one's weights read from memory

        def run() -> None:
            for e in chain:
                expert_into_(acc, hidden, tokens, weights, gate_up[e], down[e], False)

        graph = captured(run)
        return timed(lambda i: graph.replay()) / len(chain)

    gpu: dict[int, float] = {}
    for n in tokens:
        gpu[int(n)] = experts(n)
        if bar is not None:
            bar.update(1)
    overhead = experts(1, tiny=True)
    copies = []
    for nbytes in (expert.nbytes, SMALL_COPY):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        copies.append(timed(lambda i: dev.copy_(host, non_blocking=True)))
        if bar is not None:
            bar.update(1)
    return gpu, overhead, copies[0], copies[1]


def measure_share(expert: ExpertShape, repeats: int, pool_bytes: int) -> dict[int, float]:
    """On CUDA device 0: median device seconds of the decode graph's slot share (`slot_experts_`, a grouped GEMM per
    projection where torch has one for these weights) for one token routed to 1 and to SHARE_EXPERTS distinct slots
    of a pool, each inside a captured graph. The per-expert profile (`measure_gpu`) cannot tell how much of an
    expert call is fixed cost and how much reading its weights, which the grouped call pays once and per expert."""
    from .ops.expert_math import GROUPED_MM_MAX_GROUPS, slot_experts_

    # at least SHARE_EXPERTS distinct experts, however large (a small pool holds 2 of Mixtral's), and no more than
    # the grouped GEMM takes as slots (a pool of tiny experts would hold thousands)
    each = 3 * expert.hidden * expert.inter * getattr(torch, slot_format(expert)).itemsize  # as the slots hold them
    pool_bytes = min(max(pool_bytes, SHARE_EXPERTS * each), GROUPED_MM_MAX_GROUPS * each)
    (gate_up, _), (down, _) = _expert_pool(expert, pool_bytes, "cuda")
    hidden = torch.randn(1, expert.hidden, device="cuda", dtype=gate_up.dtype)
    out = torch.zeros(1, expert.hidden, device="cuda")
    share: dict[int, float] = {}
    for k in (1, SHARE_EXPERTS):
        ids = torch.arange(k, device="cuda").unsqueeze(0)
        weights = torch.ones(1, k, device="cuda")

        def run(ids: torch.Tensor = ids, weights: torch.Tensor = weights) -> None:
            slot_experts_(out, hidden, ids, weights, gate_up, down)

        share[k] = replay_seconds(run, repeats)
    return share


def replay_seconds(run: Callable[[], None], repeats: int) -> float:
    """Median device seconds of one replay of `run` captured as a CUDA graph (CUDA events), after one untimed."""
    graph = captured(run)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measure_placement(costs: CostModel, expert: ExpertShape, repeats: int) -> dict[str, float]:
    """On CUDA device 0: median device seconds of each graph-capable scheduler's tensor form deciding one layer step
    (`PLACEMENT_*`), as the decode graph replays it: PLACEMENT_CALLS decisions captured in one CUDA graph, its
    replay's time divided among them. A cost-aware form's many small kernels are device time the step waits for
    before either share starts, which the simulator adds in its graph mode (`simulator.replay.GraphStep`)."""
    from .policies import SCHEDULERS, IdleLink, LayerInfo

    order = torch.randperm(PLACEMENT_EXPERTS, generator=torch.Generator().manual_seed(0))
    counts = torch.zeros(PLACEMENT_EXPERTS, device="cuda")
    counts[order[:PLACEMENT_ACTIVE]] = 1.0
    resident = torch.zeros(PLACEMENT_EXPERTS, dtype=torch.bool)
    resident[order[PLACEMENT_ACTIVE // 2 : PLACEMENT_ACTIVE // 2 + PLACEMENT_SLOTS]] = True  # 3 active, 13 idle
    resident = resident.cuda()
    info = LayerInfo(0, PLACEMENT_EXPERTS, PLACEMENT_SLOTS, expert.nbytes)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    seconds = {}
    for name in SCHEDULERS.graph_names():
        form = SCHEDULERS.tensor_form(name)(SCHEDULERS.create(name, info=info, costs=costs, timeline=IdleLink()))

        def run(place: Callable[..., torch.Tensor] = form.place) -> None:
            for _ in range(PLACEMENT_CALLS):
                place(counts, resident, PLACEMENT_SLOTS, PLACEMENT_ACTIVE)

        graph = captured(run)
        times = []
        for _ in range(repeats):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / PLACEMENT_CALLS)
        seconds[name] = statistics.median(times)
    return seconds


def measure(
    expert: ExpertShape,
    tokens: Sequence[int] = DEFAULT_TOKENS,
    repeats: int = 7,
    pool_bytes: int = POOL_BYTES,
    progress: bool = True,
) -> Measurements:
    """Measure this machine now (no cache): the CPU kernel, and where CUDA exists the GPU and the link."""
    tokens = sorted(int(n) for n in tokens)
    cuda = torch.cuda.is_available()
    began = time.perf_counter()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    with tqdm(
        total=repeats + (len(tokens) + 2) * cuda,
        desc=f"profiling {expert.name}",
        unit="run",
        leave=False,
        disable=not progress,
    ) as bar:
        m = Measurements(profile_key(expert, tokens), measure_cpu(expert, tokens, repeats, pool_bytes, bar))
        m.cpu_overhead_s = measure_cpu_overhead(expert)
        if cuda:
            m.gpu_s, m.gpu_overhead_s, m.transfer_s, m.small_transfer_s = measure_gpu(
                expert, tokens, repeats, pool_bytes, bar
            )
            m.gpu_share_s = measure_share(expert, repeats, pool_bytes)
            try:
                m.placement_s = measure_placement(HardwareProfile(expert, m).cost_model(), expert, repeats)
            except Exception as err:  # what it adds is a simulator figure: its failure must not stop a patch
                warnings.warn(
                    f"the schedulers' placement was not timed ({err}); simulate --graph counts it as 0", stacklevel=2
                )
                m.placement_s = {}
    m.seconds, m.load = time.perf_counter() - began, load
    return m


def missing(m: Measurements) -> bool:
    """Whether a cached measurement lacks a figure `measure` takes now (it was cached by an earlier version)."""
    gpu = m.gpu_s is not None
    return m.cpu_overhead_s is None or (gpu and (m.placement_s is None or m.gpu_overhead_s is None))


def profile_hardware(
    expert: ExpertShape,
    *,
    tokens: Sequence[int] = DEFAULT_TOKENS,
    preset: str = DEFAULT_PRESET,
    refresh: bool = False,
    directory: str | Path | None = None,
    repeats: int = 7,
    pool_bytes: int = POOL_BYTES,
    progress: bool = True,
) -> HardwareProfile:
    """This machine's cost profile for experts of `expert` size, from the disk cache when it has one for this
    machine (unless `refresh`), else measured now (a few seconds) and cached. `preset`: the `HARDWARE` entry
    the GPU side and link come from where no CUDA device exists. `directory`: the cache (default `cache_dir()`)."""
    if preset not in HARDWARE:
        raise ValueError(f"unknown preset {preset!r}; one of {', '.join(HARDWARE)}")
    key = profile_key(expert, tokens)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(directory or cache_dir()) / f"profile-{expert.name}-{digest}.json"
    if not refresh and (path.exists() or path.is_symlink()):
        try:
            m = Measurements.from_json(json.loads(path.read_text()))
            if m.key == key and not missing(m):
                return HardwareProfile(expert, m, preset, cached=True, path=path)
            warnings.warn(
                f"cached profile {path} was measured for another machine or setting, or before the schedulers' "
                "placement or a call's overhead was timed: measuring again",
                stacklevel=2,
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            warnings.warn(f"cached profile {path} is unusable ({err}): measuring again", stacklevel=2)
    m = measure(expert, tokens, repeats, pool_bytes, progress)
    result = HardwareProfile(expert, m, preset, cached=False, path=path)
    doubt = _doubtful(result)
    if doubt:
        warnings.warn(
            f"profile not cached: {doubt}; it is used for this run only (measure again on a quiet machine "
            "with `hybrid-moe profile --refresh`)",
            stacklevel=2,
        )
        result.path = None
        return result
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(m.to_json(), indent=1))
        tmp.replace(path)
    except OSError as err:
        warnings.warn(f"profile not cached: cannot write {path} ({err}); it is used for this run only", stacklevel=2)
        result.path = None
    return result


MAX_DIM = 2**20  # an expert's hidden or intermediate size no model comes near


def load_profile(path: Path, preset: str = DEFAULT_PRESET) -> HardwareProfile:
    """A profile measured elsewhere (a cache file `profile_hardware` wrote, e.g. on the GPU machine a trace was
    recorded on), for its expert shape: so that machine's costs can be replayed here. One-line InputError if the
    file is not such a profile."""
    try:
        m = Measurements.from_json(json.loads(Path(path).read_text()))
        expert = ExpertShape(**m.key["expert"])
        sizes = (expert.hidden, expert.inter)
        shares = (expert.dense, expert.dense_bytes_per_weight or 1, expert.slot_bytes_per_weight or 1)
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_DIM for v in sizes) or not all(
            isinstance(v, (int, float)) and 0 <= v < math.inf for v in shares
        ):
            raise ValueError(f"expert shape {m.key['expert']} is not sizes in [1, {MAX_DIM}] and finite shares")
        if m.small_transfer_s is not None and m.transfer_s is not None and m.small_transfer_s > m.transfer_s:
            raise ValueError(f"a small copy ({m.small_transfer_s} s) is timed slower than a whole expert's")
        label = weights_label(expert)
        profile = HardwareProfile(expert, m, preset, cached=True, path=Path(path))
        profile.hardware  # noqa: B018  (fitted now: a file that cannot be fitted fails here, in one line)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise InputError(f"{path} is not a readable cost profile ({err!r}); `hybrid-moe profile` writes one") from None
    if m.key.get("weights", "bfloat16") != label:  # profiles before the key measured bf16
        raise InputError(
            f"{path} was measured with {m.key.get('weights', 'bfloat16')} weights but its expert shape has "
            f"{expert.bytes_per_weight} bytes per weight ({label}): measure it again with `hybrid-moe profile`"
        )
    if m.key.get("format") != FORMAT:
        raise InputError(
            f"{path} is a cost profile of format {m.key.get('format')}, not {FORMAT}: measure it again with "
            "`hybrid-moe profile --refresh` on its machine"
        )
    return profile


FIT_TOLERANCE = 0.25  # a fitted curve further than this from a measured point means the times were disturbed


def _doubtful(profile: HardwareProfile) -> str:
    """Why a fresh measurement should not be cached (other work on the machine skews it), or ""."""
    m = profile.measured
    cores = os.cpu_count() or 1
    if m.load is not None and m.load > cores:
        return f"load average {m.load:.1f} above the {cores} cores while measuring"
    worst = max((abs(err), side, n) for side, errs in profile.fit_errors().items() for n, err in errs.items())
    if worst[0] > FIT_TOLERANCE:
        times = m.cpu_s if worst[1] == "cpu" else m.gpu_s or {}
        measured = ", ".join(f"{n}: {s * 1e3:.3g}" for n, s in sorted(times.items()))
        return (
            f"the fitted {worst[1]} curve misses the {worst[2]}-token measurement by {worst[0]:.0%} (ms an expert by "
            f"tokens: {measured})"
        )
    return ""
