"""Schedulers as tensor functions, for steps replayed from a CUDA graph.

A replayed graph runs no Python, so the placement of a captured decode step is decided by tensor ops on the
device: from the step's token count per expert and the slot map, which activated experts run on the
accelerator (a missing one after an on-demand copy inside the step) and which on the CPU. Each form makes the
same choice as its Python scheduler in `schedulers.py` (compared on random steps in tests/test_graph_path.py);
at a full budget the graph step does not ask it (every expert runs from its slot: runtime/graph_path.py);
the cost-aware ones evaluate the same `CostModel` terms in float64, in the same order, so ties break alike.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..cost_model import CostModel, Terms
from ..ops.placement_walks import dali_walk, hybrimoe_walk, queue_place, queue_search
from .schedulers import SCHEDULERS


class DeviceScheduler:
    """`place(counts [E] float, resident [E] bool, num_slots, max_active) -> on_accelerator [E] bool` without host
    synchronisation; `max_active` bounds the experts one step activates (min(E, routed pairs): a static shape)."""

    fetches = True  # may put a missing expert on the accelerator (the step then copies it into a slot first)

    def place(self, counts: torch.Tensor, resident: torch.Tensor, num_slots: int, max_active: int) -> torch.Tensor:
        raise NotImplementedError


class StepTerms(NamedTuple):
    """What a cost-aware form weighs a step with: each expert's CPU and GPU time [E] (float64, id order) and the
    fetches the slots have room for. Computed once a step where one form builds on others (ours' torch form on
    DALI's and HybriMoE's; on CUDA ours computes them inside its one program)."""

    cpu: torch.Tensor
    gpu: torch.Tensor
    room: torch.Tensor


class CostAwareForm(DeviceScheduler):
    """A form that weighs placements with its Python scheduler's cost model."""

    def __init__(self, costs: CostModel) -> None:
        self.costs = costs

    def place(self, counts: torch.Tensor, resident: torch.Tensor, num_slots: int, max_active: int) -> torch.Tensor:
        c = self.costs
        terms = StepTerms(step_time(c.cpu, counts), step_time(c.gpu, counts), _room(counts, resident, num_slots))
        return self.place_timed(counts, resident, max_active, terms)

    def place_timed(
        self, counts: torch.Tensor, resident: torch.Tensor, max_active: int, terms: StepTerms
    ) -> torch.Tensor:
        """`place`, given the step's `terms`."""
        raise NotImplementedError


def _room(counts: torch.Tensor, resident: torch.Tensor, num_slots: int) -> torch.Tensor:
    """How many missing experts the step may fetch: slots not holding an active resident expert."""
    return num_slots - ((counts > 0) & resident).sum()


def _heaviest(eligible: torch.Tensor, counts: torch.Tensor, room: torch.Tensor) -> torch.Tensor:
    """The first `room` eligible experts by (most tokens, lowest id), as a mask: the Python forms' sort order."""
    order = torch.sort(torch.where(eligible, counts, -1.0), descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))
    return eligible & (rank < room)


def step_time(terms: Terms, counts: torch.Tensor) -> torch.Tensor:
    """`Terms.time` per expert, in float64 like the Python number."""
    n = counts.double()
    compute = terms.experts * n * terms.flops / terms.rate
    return torch.where(n > 0, terms.overhead + torch.clamp(compute, min=terms.read), 0.0)


class CachedOnAcceleratorForm(DeviceScheduler):
    fetches = False

    def place(self, counts: torch.Tensor, resident: torch.Tensor, num_slots: int, max_active: int) -> torch.Tensor:
        return (counts > 0) & resident


class AllOnCPUForm(DeviceScheduler):
    fetches = False

    def place(self, counts: torch.Tensor, resident: torch.Tensor, num_slots: int, max_active: int) -> torch.Tensor:
        return torch.zeros_like(resident)


class OnDemandForm(DeviceScheduler):
    def place(self, counts: torch.Tensor, resident: torch.Tensor, num_slots: int, max_active: int) -> torch.Tensor:
        active = counts > 0
        return (active & resident) | _heaviest(active & ~resident, counts, _room(counts, resident, num_slots))


class FiddlerForm(CostAwareForm):
    def place_timed(
        self, counts: torch.Tensor, resident: torch.Tensor, max_active: int, terms: StepTerms
    ) -> torch.Tensor:
        active = counts > 0
        worth = terms.cpu > self.costs.t_transfer() + terms.gpu
        return (active & resident) | _heaviest(active & ~resident & worth, counts, terms.room)


class DaliGreedyForm(CostAwareForm):
    """DALI's greedy: the step's experts in the Python form's order, walked by `ops.placement_walks`."""

    def place_timed(
        self, counts: torch.Tensor, resident: torch.Tensor, max_active: int, terms: StepTerms
    ) -> torch.Tensor:
        # (most tokens, resident first, lowest id) as one descending stable sort; inactive experts sort last
        order = torch.sort(counts.double() * 2 + resident, descending=True, stable=True).indices
        n, res = counts[order], resident[order]
        fetched = terms.gpu[order] + (~res).double() * self.costs.t_transfer()  # + 0.0 when resident, as in Python
        take = dali_walk(n, res, terms.cpu[order], fetched, terms.room, max_active)
        return torch.zeros_like(take).scatter_(0, order, take)


class HybriMoEForm(CostAwareForm):
    """HybriMoE's two-ended queue (GPU from the head, CPU from the tail), walked by `ops.placement_walks`, with
    the link idle at the step's start as live layers see it."""

    def place_timed(
        self, counts: torch.Tensor, resident: torch.Tensor, max_active: int, terms: StepTerms
    ) -> torch.Tensor:
        active = counts > 0
        # the queue: active cached experts, then active missing ones, each by load descending, then id
        rank = torch.where(active, 1.0 + resident.double(), 0.0) * 2.0**32 + counts.double()
        order = torch.sort(rank, descending=True, stable=True).indices
        take = hybrimoe_walk(
            resident[order],
            terms.cpu[order],
            terms.gpu[order],
            terms.room,
            active.sum(),
            self.costs.t_transfer(),
            max_active,
        )
        return torch.zeros_like(take).scatter_(0, order, take)


class QueueAwareForm(CostAwareForm):
    """Ours: the best of the cached set and the DALI and HybriMoE forms' sets, then local search on the step's time
    (`ops.placement_walks.queue_search`), on the step's active experts in id order (`max_active` of them at most),
    with the link idle at the step's start as live layers see it."""

    def __init__(self, costs: CostModel) -> None:
        super().__init__(costs)
        self.starts = (DaliGreedyForm(costs), HybriMoEForm(costs))

    def place(self, counts: torch.Tensor, resident: torch.Tensor, num_slots: int, max_active: int) -> torch.Tensor:
        if counts.is_cuda:
            return self.place_in_one_program(counts, resident, num_slots, max_active)
        return super().place(counts, resident, num_slots, max_active)

    def place_in_one_program(
        self, counts: torch.Tensor, resident: torch.Tensor, num_slots: int, max_active: int, kernel: object = None
    ) -> torch.Tensor:
        """The CUDA path: the choice `place_timed` makes, as one Triton program (`ops.placement_walks.queue_place`),
        one kernel node of a captured step instead of a hundred. `kernel`: an interpreted stand-in (tests)."""
        c = self.costs
        return queue_place(counts, resident, num_slots, max_active, c.cpu, c.gpu, c.t_transfer(), kernel)

    def place_timed(
        self, counts: torch.Tensor, resident: torch.Tensor, max_active: int, terms: StepTerms
    ) -> torch.Tensor:
        active = counts > 0
        starts = [s.place_timed(counts, resident, max_active, terms) for s in self.starts]
        size = min(max_active, len(counts))
        order = torch.sort((~active).to(torch.uint8), stable=True).indices[:size]  # the active experts in id order
        take = queue_search(
            active[order],
            resident[order],
            terms.cpu[order],
            terms.gpu[order],
            torch.stack([s[order] for s in [active & resident, *starts]]),
            terms.room,
            self.costs.t_transfer(),
        )
        return torch.zeros_like(active).scatter_(0, order, take)


SCHEDULERS.add_tensor_form("cached_on_accelerator", lambda s: CachedOnAcceleratorForm())
SCHEDULERS.add_tensor_form("all_cpu", lambda s: AllOnCPUForm())
SCHEDULERS.add_tensor_form("on_demand", lambda s: OnDemandForm())
SCHEDULERS.add_tensor_form("fiddler", lambda s: FiddlerForm(s.costs))
SCHEDULERS.add_tensor_form("dali_greedy", lambda s: DaliGreedyForm(s.costs))
# the last two plan around the link: live layers' link is the idle one they assume
SCHEDULERS.add_tensor_form("hybrimoe", lambda s: HybriMoEForm(s.costs))
SCHEDULERS.add_tensor_form("queue_aware", lambda s: QueueAwareForm(s.costs))
