"""Cache policies and the gate prefetch's admissions as tensor functions, for steps replayed from a CUDA graph.

A replayed graph runs no Python, so the slot decisions of a captured decode step are made by tensor ops on
the device: each cache policy's ranking (`values`, the same numbers its Python form ranks by, tested equal)
is updated in place from the step's per-expert token counts and summed router scores; then `admissions`
pairs the best missed experts with the least valuable slots, at most `fills` per layer step (each admission
is a PCIe copy that must finish inside the step).
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from ..cost_model import CostModel
from ..ops.slot_swaps import swap_in
from .caching import CACHE_POLICIES
from .device_scheduling import step_time
from .prefetching import PREFETCHERS, GatePrefetch


class DeviceRanking:
    """Per-expert values of one layer, kept in device tensors and updated without host synchronisation."""

    max_fills: int | None = None  # a cap on admissions per update, where the policy sets one
    margin: float = 0.0  # how much more than the slot it takes a newcomer must be worth

    def __init__(self, num_experts: int, device: torch.device) -> None:
        self.values = torch.zeros(num_experts, dtype=torch.float32, device=device)
        self.step = torch.zeros((), dtype=torch.int64, device=device)

    def candidates(self, active: torch.Tensor) -> torch.Tensor:
        """Which missing experts may be admitted: the step's active ones, unless the policy ranks others."""
        return active

    def update(self, counts: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Record one step (float counts and scores per expert); returns whether the slots may change now."""
        self.step += 1
        self._observe(counts, scores)
        return torch.ones((), dtype=torch.bool, device=counts.device)

    def _observe(self, counts: torch.Tensor, scores: torch.Tensor) -> None:
        raise NotImplementedError


class LRURanking(DeviceRanking):
    """value = the step an expert was last used (LRU's clock; -1: never)."""

    def __init__(self, num_experts: int, device: torch.device) -> None:
        super().__init__(num_experts, device)
        self.values.fill_(-1)

    def _observe(self, counts: torch.Tensor, scores: torch.Tensor) -> None:
        self.values.copy_(torch.where(counts > 0, self.step.float(), self.values))


class LFURanking(DeviceRanking):
    """value = tokens routed to the expert so far."""

    def _observe(self, counts: torch.Tensor, scores: torch.Tensor) -> None:
        self.values += counts


class MRSRanking(DeviceRanking):
    """HybriMoE's minus-recent score: S = alpha * s + (1 - alpha) * S."""

    def __init__(self, num_experts: int, device: torch.device, alpha: float) -> None:
        super().__init__(num_experts, device)
        self.alpha = alpha

    def _observe(self, counts: torch.Tensor, scores: torch.Tensor) -> None:
        self.values.mul_(1 - self.alpha).add_(scores, alpha=self.alpha)


class WindowRanking(DeviceRanking):
    """DALI's window: tokens summed over a tumbling window of `w_size` steps; when it closes, they and `decay` times
    the previous values become the values and the slots may change (at most `u_size` copies: `admissions` takes
    min(fills, u_size))."""

    def __init__(self, num_experts: int, device: torch.device, w_size: int, u_size: int, decay: float = 0.0) -> None:
        super().__init__(num_experts, device)
        self.w_size, self.max_fills, self.decay = w_size, u_size, decay
        self.window = torch.zeros(num_experts, dtype=torch.float32, device=device)

    def candidates(self, active: torch.Tensor) -> torch.Tensor:
        return self.values > 0  # every expert the closed window saw

    def update(self, counts: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.step += 1
        self.window += counts
        closes = self.step % self.w_size == 0
        self.values.copy_(torch.where(closes, self.window + self.decay * self.values, self.values))
        self.window.mul_((~closes).float())
        return closes


class SavingRanking(DeviceRanking):
    """Ours' cost-aware value: a moving average of the seconds a slot would have saved each step (t_cpu - t_gpu at
    the expert's token count), in float64 and the same order of operations as the Python policy's."""

    def __init__(self, num_experts: int, device: torch.device, costs: CostModel, decay: float, margin: float) -> None:
        super().__init__(num_experts, device)
        self.values = self.values.double()
        self.costs, self.decay, self.margin = costs, decay, margin

    def _observe(self, counts: torch.Tensor, scores: torch.Tensor) -> None:
        c, d = self.costs, self.decay
        saving = step_time(c.cpu, counts) - step_time(c.gpu, counts)
        self.values.copy_(d * self.values + (1 - d) * saving)  # two roundings, as in Python (add_'s alpha may fuse)


CACHE_POLICIES.add_tensor_form("lru", lambda policy, num_experts, device: LRURanking(num_experts, device))
CACHE_POLICIES.add_tensor_form("lfu", lambda policy, num_experts, device: LFURanking(num_experts, device))
CACHE_POLICIES.add_tensor_form("mrs", lambda policy, num_experts, device: MRSRanking(num_experts, device, policy.alpha))
CACHE_POLICIES.add_tensor_form(
    "dali_window",
    lambda policy, num_experts, device: WindowRanking(num_experts, device, policy.w_size, policy.u_size, policy.decay),
)


CACHE_POLICIES.add_tensor_form(
    "cost_aware",
    lambda policy, num_experts, device: SavingRanking(num_experts, device, policy.costs, policy.decay, policy.margin),
)


def _pairs(candidates: torch.Tensor, held: torch.Tensor, fills: int) -> tuple[torch.Tensor, ...]:
    """(value, expert) of the `fills` best candidates [E] and (value, slot) of the `fills` cheapest slots [S]; -inf
    marks an ineligible candidate or a free slot, +inf a slot that must not be given up. Equal values go lowest
    index first, as the Python policies break ties (stable sorts: top-k leaves their order unspecified)."""
    cand_value, cand = torch.sort(candidates, descending=True, stable=True)
    victim_value, victim = torch.sort(held, stable=True)
    return cand_value[:fills], cand[:fills], victim_value[:fills], victim[:fills]


def admissions(
    values: torch.Tensor,
    may_change: torch.Tensor,
    eligible: torch.Tensor,
    expert_slot: torch.Tensor,
    slot_expert: torch.Tensor,
    fills: int,
    margin: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `fills` (missed expert, slot) pairs: the i-th most valuable eligible non-resident expert takes the i-th
    least valuable slot (a free slot first) when it is worth more, by over `margin`; -1 expert where no admission
    happens.

    expert_slot [E] (-1: not resident) and slot_expert [S] (-1: free) are the current tables.
    """
    neg = float("-inf")  # a Python scalar: no host-to-device copy inside a graph capture
    candidates = torch.where(eligible & (expert_slot < 0) & may_change, values, neg)
    held = torch.where(slot_expert >= 0, values[slot_expert.clamp(min=0)], neg)
    cand_value, cand, victim_value, victim = _pairs(candidates, held, fills)
    admit = (cand_value > neg) & (cand_value > victim_value + margin)
    return torch.where(admit, cand, -1), victim


def _swap_in(
    candidates: torch.Tensor,
    keep: torch.Tensor,
    values: torch.Tensor,
    expert_slot: torch.Tensor,
    slot_expert: torch.Tensor,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best candidates (value > -inf, missing experts) each take the slot the cache ranking `values` gives up
    first (a free slot first), never a slot holding a `keep` expert; (expert, slot) pairs, -1 expert where
    nothing is copied."""
    if candidates.is_cuda:  # one program, ties broken as the Python path breaks them (ops/slot_swaps.py)
        return swap_in(candidates, keep, values, slot_expert, k)
    neg, pos = float("-inf"), float("inf")
    held_expert = slot_expert.clamp(min=0)
    held = torch.where(slot_expert >= 0, torch.where(keep[held_expert], pos, values[held_expert].double()), neg)
    cand_value, cand, victim_value, victim = _pairs(candidates, held, k)
    admit = (cand_value > neg) & (victim_value < pos)
    return torch.where(admit, cand, -1), victim


def _gate_on_device(prefetcher: GatePrefetch, device: torch.device) -> GatePrefetch:
    """The gate prefetcher with its router's weights on the device (a capture cannot copy them in); its choice is
    made by `prefetch_admissions`."""
    on_device = copy.copy(prefetcher)
    router = prefetcher.router
    on_device.router = dataclasses.replace(
        router,
        **{
            f: getattr(router, f).to(device, torch.float32)
            for f in ("weight", "bias")
            if getattr(router, f) is not None
        },
    )
    return on_device


PREFETCHERS.add_tensor_form("none", lambda prefetcher, device: None)
PREFETCHERS.add_tensor_form("gate", _gate_on_device)


def prefetch_admissions(
    priority: torch.Tensor,
    size: int,
    values: torch.Tensor,
    expert_slot: torch.Tensor,
    slot_expert: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate prefetch as tensors: the `size` experts of highest `priority` (> 0) are wanted and swapped in, in
    priority order, never displacing a wanted one. The same choice as the Python path's `select` followed by
    `choose_slot` (tests/test_graph_path.py)."""
    top_value, top = (t[:size] for t in torch.sort(priority, descending=True, stable=True))  # ties: lowest id
    wanted = torch.zeros_like(expert_slot, dtype=torch.bool).scatter_(0, top, top_value > 0)
    candidates = torch.where(wanted & (expert_slot < 0), priority, float("-inf"))
    return _swap_in(candidates, wanted, values, expert_slot, slot_expert, min(size, len(slot_expert)))


def fetch_admissions(
    fetch: torch.Tensor,
    keep: torch.Tensor,
    values: torch.Tensor,
    expert_slot: torch.Tensor,
    slot_expert: torch.Tensor,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A scheduler's on-demand fetches (the `fetch` mask, at most k) swapped in lowest id first, never displacing
    an expert the step runs on the accelerator (`keep`): the Python path's `choose_slot` per fetch in plan order."""
    order = torch.arange(len(fetch), 0, -1, device=fetch.device, dtype=torch.float64)  # lowest id ranks first
    return _swap_in(torch.where(fetch, order, float("-inf")), keep, values, expert_slot, slot_expert, k)
