"""DAOP's per-sequence expert allocation: which experts a sequence's prefill used most decides the slots, and
decode swaps an expert in only when the sequence has used it clearly more than a resident one."""

from __future__ import annotations

from collections.abc import Sequence

from .base import LayerInfo
from .caching import CACHE_POLICIES, RankedCache
from .requests import RequestActivations


@CACHE_POLICIES.register("daop")
class SequenceAllocation(RankedCache):
    """value = tokens the request in flight routed to the expert at this layer (prefill included). At the
    request's first step (its prefill) the slots are re-allocated to its hottest experts; afterwards a missing
    active expert displaces the least-used resident one only when it has `swap_threshold` (DAOP: 1.05) times its
    tokens, pair by pair, at most `max_swaps` per step."""

    def __init__(
        self,
        info: LayerInfo,
        request: RequestActivations | None = None,
        swap_threshold: float = 1.05,
        max_swaps: int = 1,
    ) -> None:
        super().__init__(info)
        if request is None:
            raise ValueError(
                "cache policy 'daop' follows the request in flight: pass request=RequestActivations(...) "
                "(the simulator does; the live runtime does not yet)"
            )
        if swap_threshold < 1 or max_swaps < 1:
            raise ValueError(f"daop needs swap_threshold >= 1 and max_swaps >= 1, got {swap_threshold}, {max_swaps}")
        self.request, self.swap_threshold, self.max_swaps = request, swap_threshold, max_swaps

    def observe(self, counts: Sequence[int], scores: Sequence[float]) -> bool:
        return True

    def value(self, expert: int) -> float:
        return float(self.request.matrix[self.request.row[self.info.layer_idx], expert])

    def admit(self, counts: Sequence[int], resident: Sequence[bool], scores: Sequence[float]) -> list[int]:
        everyone = range(self.info.num_experts)
        if self.request.steps == 1:  # the prefill: allocate the slots from scratch
            return self.paired([e for e in everyone if self.value(e) > 0], resident, self.info.num_slots)
        active = [e for e, c in enumerate(counts) if c]
        return self.paired(active, resident, self.max_swaps, self.swap_threshold)
