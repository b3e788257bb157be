"""Schedulers: which activated experts run on the accelerator and which on the CPU.

Cost-aware schedulers weigh a placement by DALI's 0-1 objective (`makespan`): the CPU runs its experts
one after another, the GPU its own plus, for each expert not in a slot, a PCIe transfer; the layer
takes as long as the slower side. They need a `CostModel` (`costs=`); the simulator passes one.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from ..cost_model import CostModel
from .base import LayerInfo, Placement, Scheduler, Timeline
from .registry import Registry

SCHEDULERS: Registry = Registry("scheduler")


def makespan(counts: Sequence[int], resident: Sequence[bool], on_gpu: Iterable[int], costs: CostModel) -> float:
    """DALI's objective for one layer step: max(CPU time, GPU time including transfers of missing experts)."""
    gpu = set(on_gpu)
    cpu_time = sum(costs.t_cpu(c) for e, c in enumerate(counts) if c and e not in gpu)
    gpu_time = sum(costs.t_gpu(counts[e]) + (0.0 if resident[e] else costs.t_transfer()) for e in gpu)
    return max(cpu_time, gpu_time)


class StepTimer:
    """`layer_time` of one step's counts for any GPU set, with each expert's CPU, GPU and copy times and the
    link's state read once: local search and the exhaustive oracle time hundreds of sets per step."""

    def __init__(self, counts: Sequence[int], resident: Sequence[bool], costs: CostModel, timeline: Timeline) -> None:
        self.active = [e for e, n in enumerate(counts) if n]
        self.resident = resident
        self.cpu = {e: costs.t_cpu(counts[e]) for e in self.active}
        self.gpu = {e: costs.t_gpu(counts[e]) for e in self.active}
        self.transfer = costs.t_transfer()
        self.link = timeline.link_free_in()
        self.timeline = timeline
        self.ready = {e: timeline.ready_in(e) for e in self.active if resident[e]}

    def __call__(self, on_gpu: Iterable[int]) -> float:
        """The step's time as the simulator plays it: the CPU's experts back to back; on the GPU each expert
        once its weights are there (resident copies finishing, then fetches queued behind the link's backlog)."""
        gpu = set(on_gpu)
        cpu_time = sum(self.cpu[e] for e in self.active if e not in gpu)
        link = self.link
        ready = []
        for e in sorted(gpu, key=lambda e: (not self.resident[e], e)):
            if self.resident[e]:
                ready.append((self.ready[e] if e in self.ready else self.timeline.ready_in(e), e))
            else:
                link += self.transfer
                ready.append((link, e))
        gpu_time = 0.0
        for at, e in sorted(ready):
            gpu_time = max(gpu_time, at) + self.gpu.get(e, 0.0)
        return max(cpu_time, gpu_time)


def layer_time(
    counts: Sequence[int], resident: Sequence[bool], on_gpu: Sequence[int], costs: CostModel, timeline: Timeline
) -> float:
    """The step's time as the simulator plays it (see `StepTimer`)."""
    return StepTimer(counts, resident, costs, timeline)(on_gpu)


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
        raise ValueError(
            f"scheduler {name!r} weighs placements by cost: pass costs=CostModel(...) (live: "
            "HybridMoEConfig(hardware=<a cost_model.HARDWARE preset or 'local'>))"
        )
    return costs


def place_step(scheduler: Scheduler, info: LayerInfo, counts: Sequence[int], resident: Sequence[bool]) -> Placement:
    """The step's placement, as the live layer and the simulator take it: at a full budget every active expert
    runs from its slot (the store fills every slot when patching; one not in a slot would run on the CPU),
    without asking the scheduler. A cost-aware one would send some to an idle CPU, pricing the
    GPU's share per expert, but the slot share runs as one grouped call and the CPU's carries copies and a round
    trip it does not price: ours did so in prefill on an H200 and ran 4.6x slower than the default (RESULTS.md,
    2026-11-27, midday)."""
    if info.full:
        return _plan(counts, resident, {e for e, c in enumerate(counts) if c and resident[e]})
    return scheduler.place(counts, resident)


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


@SCHEDULERS.register("on_demand")
class OnDemand:
    """GPU-centric offloading (MoE-Infinity, accelerate-style): every activated expert runs on the GPU, a
    missing one after an on-demand fetch, heaviest first; only what cannot get a slot this step (more
    missing experts than slots free) falls back to the CPU."""

    def __init__(self, info: LayerInfo) -> None:
        self.info = info

    def place(self, counts: Sequence[int], resident: Sequence[bool]) -> Placement:
        room = _fetch_capacity(self.info, counts, resident)
        missing = sorted((e for e, n in enumerate(counts) if n and not resident[e]), key=lambda e: (-counts[e], e))
        return _plan(counts, resident, {e for e, n in enumerate(counts) if n and resident[e]} | set(missing[:room]))


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


@SCHEDULERS.register("hybrimoe")
class HybriMoE:
    """HybriMoE's simulation scheduler (its priority rules, as its released code plays them): the activated
    experts in one queue, cached ones by load descending, then missing ones by load descending. The GPU takes
    from the head (heavy cached experts first, then heavy missing ones, each after its copy on the link's own
    timeline), the CPU from the tail (light missing experts first, then light cached ones); at every step the
    side that would finish its next expert earlier takes it, until the queue is empty. Sees the link's backlog
    when given a timeline."""

    def __init__(self, info: LayerInfo, costs: CostModel | None = None, timeline: Timeline | None = None) -> None:
        self.info = info
        self.costs = _need_costs("hybrimoe", costs)
        self.timeline = timeline

    def place(self, counts: Sequence[int], resident: Sequence[bool]) -> Placement:
        c = self.costs
        queue = sorted((e for e, n in enumerate(counts) if n), key=lambda e: (not resident[e], -counts[e], e))
        room = _fetch_capacity(self.info, counts, resident)
        link = self.timeline.link_free_in() if self.timeline else 0.0
        cpu_t = gpu_t = 0.0
        gpu: set[int] = set()
        head, tail = 0, len(queue) - 1
        while head <= tail:
            e = queue[head]
            ready = self.timeline.ready_in(e) if self.timeline and resident[e] else 0.0
            if not resident[e]:
                ready = link + c.t_transfer() if room > 0 else float("inf")
            gpu_end = max(gpu_t, ready) + c.t_gpu(counts[e])
            cpu_end = cpu_t + c.t_cpu(counts[queue[tail]])
            if gpu_end <= cpu_end:
                gpu_t = gpu_end
                gpu.add(e)
                if not resident[e]:
                    link, room = ready, room - 1
                head += 1
            else:
                cpu_t = cpu_end
                tail -= 1
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
        res = milp(
            objective,
            constraints=constraints,
            integrality=np.r_[np.ones(n), 0],
            bounds=Bounds(np.r_[np.zeros(n), 0.0], np.r_[np.ones(n), np.inf]),
        )
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


def local_search(timer: StepTimer, gpu: set[int], room: int) -> tuple[float, set[int]]:
    """From the GPU set `gpu`, flip the single expert that shortens the step's time most until none does
    (never more than `room` missing experts on the GPU), at most as many flips as active experts (the bound the
    tensor form, `ops.placement_walks.queue_search`, runs under); returns (time, GPU set)."""
    missing = sum(not timer.resident[e] for e in gpu)
    best = timer(gpu)
    for _ in timer.active:
        trials = []
        for e in timer.active:
            change = 0 if timer.resident[e] else (-1 if e in gpu else 1)
            if missing + change <= room:
                flipped = gpu ^ {e}
                trials.append((timer(flipped), e, flipped, change))
        if not trials:
            return best, gpu
        t, _, flipped, change = min(trials, key=lambda x: x[:2])
        if t >= best * (1 - 1e-9):
            return best, gpu
        best, gpu, missing = t, flipped, missing + change
    return best, gpu


@SCHEDULERS.register("queue_aware")
class QueueAware:
    """Ours: local search on the step's real time (`layer_time`), which sees the link's backlog and the
    copies still in flight, so it neither queues fetches behind background traffic nor waits on a slot
    that is not filled yet. Starts from the best of cached-on-GPU, DALI's greedy and HybriMoE's rules (all
    cheap), then flips the single expert that helps most until nothing helps: never worse than any of them."""

    def __init__(self, info: LayerInfo, costs: CostModel | None = None, timeline: Timeline | None = None) -> None:
        self.info = info
        self.costs = _need_costs("queue_aware", costs)
        if timeline is None:
            raise ValueError("scheduler 'queue_aware' plans around in-flight copies: pass timeline=...")
        self.timeline = timeline
        self.starts: tuple[Scheduler, ...] = (DaliGreedy(info, self.costs), HybriMoE(info, self.costs, timeline))

    def start(self, counts: Sequence[int], resident: Sequence[bool], timer: StepTimer) -> set[int]:
        """The best of the cheap placements, by the step's time."""
        cached = {e for e, n in enumerate(counts) if n and resident[e]}
        starts = [cached] + [set(s.place(counts, resident).accelerator) for s in self.starts]
        return min(starts, key=timer)

    def place(self, counts: Sequence[int], resident: Sequence[bool]) -> Placement:
        room = _fetch_capacity(self.info, counts, resident)
        timer = StepTimer(counts, resident, self.costs, self.timeline)
        return _plan(counts, resident, local_search(timer, self.start(counts, resident, timer), room)[1])


@SCHEDULERS.register("oracle")
class OraclePlacement(QueueAware):
    """The least `layer_time` found for the step (what the simulator plays, link backlog included): exhaustive
    over every assignment up to `exhaustive_up_to` active experts; beyond, local search from the best of
    queue_aware's starts and the exact makespan optimum (a faster start can lead to a slower local optimum than
    ours reaches: searching from every start was measured and dropped, slower in the replay's later steps and 2.6x
    the time at batch 16, benchmarks/RESULTS.md 2026-12-01). The placement half of the oracle stack."""

    def __init__(
        self,
        info: LayerInfo,
        costs: CostModel | None = None,
        timeline: Timeline | None = None,
        exhaustive_up_to: int = 10,
    ) -> None:
        super().__init__(info, costs, timeline)
        self.exhaustive_up_to = exhaustive_up_to
        self.starts = (*self.starts, Optimal(info, self.costs))

    def place(self, counts: Sequence[int], resident: Sequence[bool]) -> Placement:
        active = [e for e, n in enumerate(counts) if n]
        if len(active) > self.exhaustive_up_to:
            return super().place(counts, resident)
        room = _fetch_capacity(self.info, counts, resident)
        candidates = (
            {e for e, g in zip(active, mask) if g} for mask in itertools.product((False, True), repeat=len(active))
        )
        fits = (g for g in candidates if sum(not resident[e] for e in g) <= room)
        timer = StepTimer(counts, resident, self.costs, self.timeline)
        gpu = min(fits, key=lambda g: (timer(g), len(g)))
        return _plan(counts, resident, gpu)
