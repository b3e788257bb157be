"""Schedulers: which activated experts run on the accelerator and which on the CPU.

Cost-aware schedulers weigh a placement by DALI's 0-1 objective (`makespan`): the CPU runs its experts
one after another, the GPU its own plus, for each expert not in a slot, a PCIe transfer; the layer
takes as long as the slower side. They need a `CostModel` (`costs=`); the simulator passes one.
"""

from __future__ import annotations

from collections.abc import Sequence

import itertools

from ..cost_model import CostModel
from .base import LayerInfo, Placement, Timeline
from .registry import Registry

SCHEDULERS: Registry = Registry("scheduler")


def makespan(counts: Sequence[int], resident: Sequence[bool], on_gpu: Sequence[int], costs: CostModel) -> float:
    """DALI's objective for one layer step: max(CPU time, GPU time including transfers of missing experts)."""
    gpu = set(on_gpu)
    cpu_time = sum(costs.t_cpu(c) for e, c in enumerate(counts) if c and e not in gpu)
    gpu_time = sum(costs.t_gpu(counts[e]) + (0.0 if resident[e] else costs.t_transfer()) for e in gpu)
    return max(cpu_time, gpu_time)


def layer_time(
    counts: Sequence[int], resident: Sequence[bool], on_gpu: Sequence[int], costs: CostModel, timeline: Timeline
) -> float:
    """The step's time as the simulator plays it: the CPU's experts back to back; on the GPU each expert once
    its weights are there (resident copies finishing, then fetches queued behind the link's backlog)."""
    cpu_time = sum(costs.t_cpu(c) for e, c in enumerate(counts) if c and e not in set(on_gpu))
    link = timeline.link_free_in()
    ready = []
    for e in sorted(on_gpu, key=lambda e: (not resident[e], e)):
        if resident[e]:
            ready.append((timeline.ready_in(e), e))
        else:
            link += costs.t_transfer()
            ready.append((link, e))
    gpu_time = 0.0
    for at, e in sorted(ready):
        gpu_time = max(gpu_time, at) + costs.t_gpu(counts[e])
    return max(cpu_time, gpu_time)


def _plan(counts: Sequence[int], resident: Sequence[bool], on_gpu: set[int]) -> Placement:
    plan = Placement()
    for e, c in enumerate(counts):
        if c:
            (plan.accelerator if e in on_gpu else plan.cpu).append(e)
    plan.fetch = [e for e in plan.accelerator if not resident[e]]
    return plan


def _fetch_capacity(info: LayerInfo, counts: Sequence[int], resident: Sequence[bool]) -> int:
    """How many missing experts can be fetched this step: slots not holding an active resident expert."""
    return info.num_slots - sum(1 for e, c in enumerate(counts) if c and resident[e])


def _need_costs(name: str, costs: CostModel | None) -> CostModel:
    if costs is None:
        raise ValueError(f"scheduler {name!r} weighs placements by cost: pass costs=CostModel(...)")
    return costs


@SCHEDULERS.register("cached_on_accelerator")
class CachedOnAccelerator:
    """Experts already in a slot run on the accelerator, the rest on the CPU; nothing waits on a copy."""

    def __init__(self, info: LayerInfo, costs: CostModel | None = None) -> None:
        self.info = info

    def place(self, counts: Sequence[int], resident: Sequence[bool]) -> Placement:
        return _plan(counts, resident, {e for e, c in enumerate(counts) if c and resident[e]})


@SCHEDULERS.register("all_cpu")
class AllOnCPU:
    """Every routed expert on the CPU (KTransformers' layout, llama.cpp's --n-cpu-moe): slots unused."""

    def __init__(self, info: LayerInfo, costs: CostModel | None = None) -> None:
        self.info = info

    def place(self, counts: Sequence[int], resident: Sequence[bool]) -> Placement:
        return _plan(counts, resident, set())


@SCHEDULERS.register("fiddler")
class Fiddler:
    """Fiddler's rule: a cached expert runs on the GPU; a missing one on the CPU unless copying it over and
    running it there is faster (cpu(n) > transfer + gpu(n))."""

    def __init__(self, info: LayerInfo, costs: CostModel | None = None) -> None:
        self.info = info
        self.costs = _need_costs("fiddler", costs)

    def place(self, counts: Sequence[int], resident: Sequence[bool]) -> Placement:
        c = self.costs
        gpu = {e for e, n in enumerate(counts) if n and resident[e]}
        room = _fetch_capacity(self.info, counts, resident)
        for e in sorted((e for e, n in enumerate(counts) if n and not resident[e]), key=lambda e: -counts[e]):
            if room > 0 and c.t_cpu(counts[e]) > c.t_transfer() + c.t_gpu(counts[e]):
                gpu.add(e)
                room -= 1
        return _plan(counts, resident, gpu)


@SCHEDULERS.register("dali_greedy")
class DaliGreedy:
    """DALI's greedy assignment (Algorithm 1): experts by workload, heaviest first, each to the side that
    finishes earlier with it; a cached expert costs the GPU no transfer."""

    def __init__(self, info: LayerInfo, costs: CostModel | None = None) -> None:
        self.info = info
        self.costs = _need_costs("dali_greedy", costs)

    def place(self, counts: Sequence[int], resident: Sequence[bool]) -> Placement:
        c = self.costs
        cpu_t = gpu_t = 0.0
        gpu: set[int] = set()
        room = _fetch_capacity(self.info, counts, resident)
        for e in sorted((e for e, n in enumerate(counts) if n), key=lambda e: (-counts[e], not resident[e], e)):
            on_gpu = c.t_gpu(counts[e]) + (0.0 if resident[e] else c.t_transfer())
            if (resident[e] or room > 0) and gpu_t + on_gpu <= cpu_t + c.t_cpu(counts[e]):
                gpu_t += on_gpu
                gpu.add(e)
                room -= not resident[e]
            else:
                cpu_t += c.t_cpu(counts[e])
        return _plan(counts, resident, gpu)


@SCHEDULERS.register("optimal")
class Optimal:
    """The exact minimum of DALI's 0-1 problem (`makespan`): the reference other schedulers are measured
    against. Exhaustive search up to `exhaustive_up_to` active experts, a mixed-integer program (HiGHS,
    through scipy) beyond."""

    def __init__(self, info: LayerInfo, costs: CostModel | None = None, exhaustive_up_to: int = 12) -> None:
        self.info = info
        self.costs = _need_costs("optimal", costs)
        self.exhaustive_up_to = exhaustive_up_to

    def place(self, counts: Sequence[int], resident: Sequence[bool]) -> Placement:
        active = [e for e, n in enumerate(counts) if n]
        room = _fetch_capacity(self.info, counts, resident)
        if len(active) <= self.exhaustive_up_to:
            gpu = exhaustive_optimum(counts, resident, room, self.costs)
        else:
            gpu = self._milp(counts, resident, active, room)
        return _plan(counts, resident, gpu)

    def _milp(self, counts: Sequence[int], resident: Sequence[bool], active: list[int], room: int) -> set[int]:
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, milp

        c = self.costs
        cpu = np.array([c.t_cpu(counts[e]) for e in active])
        gpu = np.array([c.t_gpu(counts[e]) + (0.0 if resident[e] else c.t_transfer()) for e in active])
        missing = np.array([0.0 if resident[e] else 1.0 for e in active])
        n = len(active)  # variables: x_0..x_{n-1} (1 = GPU), then z (the makespan)
        objective = np.r_[np.zeros(n), 1.0]
        rows = np.vstack([np.r_[-cpu, -1.0], np.r_[gpu, -1.0], np.r_[missing, 0.0]])
        constraints = LinearConstraint(rows, -np.inf, [-cpu.sum(), 0.0, room])
        res = milp(objective, constraints=constraints, integrality=np.r_[np.ones(n), 0],
                   bounds=Bounds(np.r_[np.zeros(n), 0.0], np.r_[np.ones(n), np.inf]))
        if not res.success:
            raise RuntimeError(f"optimal scheduler: MILP failed ({res.message})")
        return {e for e, x in zip(active, res.x[:n]) if x > 0.5}


def exhaustive_optimum(counts: Sequence[int], resident: Sequence[bool], room: int, costs: CostModel) -> set[int]:
    """Every assignment of the active experts tried; the GPU set with the least makespan (ties: fewest transfers)."""
    active = [e for e, n in enumerate(counts) if n]
    best: tuple[float, int, set[int]] = (float("inf"), 0, set())
    for mask in itertools.product((False, True), repeat=len(active)):
        gpu = {e for e, g in zip(active, mask) if g}
        fetches = sum(not resident[e] for e in gpu)
        if fetches > room:
            continue
        key = (makespan(counts, resident, gpu, costs), fetches)
        if key < best[:2]:
            best = (*key, gpu)
    return best[2]


@SCHEDULERS.register("queue_aware")
class QueueAware:
    """Ours: local search on the step's real time (`layer_time`), which sees the link's backlog and the
    copies still in flight, so it neither queues fetches behind background traffic nor waits on a slot
    that is not filled yet. Starts from cached-on-GPU and flips the single expert that helps most until
    nothing helps."""

    def __init__(self, info: LayerInfo, costs: CostModel | None = None, timeline: Timeline | None = None) -> None:
        self.info = info
        self.costs = _need_costs("queue_aware", costs)
        if timeline is None:
            raise ValueError("scheduler 'queue_aware' plans around in-flight copies: pass timeline=...")
        self.timeline = timeline

    def place(self, counts: Sequence[int], resident: Sequence[bool]) -> Placement:
        active = [e for e, n in enumerate(counts) if n]
        room = _fetch_capacity(self.info, counts, resident)
        gpu = {e for e in active if resident[e]}
        best = layer_time(counts, resident, gpu, self.costs, self.timeline)
        while True:
            trials = []
            for e in active:
                flipped = gpu ^ {e}
                if sum(not resident[x] for x in flipped) <= room:
                    trials.append((layer_time(counts, resident, flipped, self.costs, self.timeline), e, flipped))
            if not trials:
                break
            t, _, flipped = min(trials, key=lambda x: x[:2])
            if t >= best * (1 - 1e-9):
                break
            best, gpu = t, flipped
        return _plan(counts, resident, gpu)
