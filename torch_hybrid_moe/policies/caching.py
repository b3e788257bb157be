"""Cache policies: which experts the accelerator slots hold."""

from __future__ import annotations

from collections.abc import Sequence

from .base import LayerInfo
from .registry import Registry

CACHE_POLICIES: Registry = Registry("cache policy")


@CACHE_POLICIES.register("lru")
class LRU:
    """Every missed expert is admitted after its step; the least recently used resident one leaves."""

    def __init__(self, info: LayerInfo, costs: object = None) -> None:
        self.info = info
        self.clock = 0
        self.last_used = [-1] * info.num_experts

    def admit(self, counts: Sequence[int], resident: Sequence[bool]) -> list[int]:
        self.clock += 1
        missing = []
        for e, c in enumerate(counts):
            if c:
                self.last_used[e] = self.clock
                if not resident[e]:
                    missing.append(e)
        missing.sort(key=lambda e: -counts[e])
        return missing[: self.info.num_slots]

    def victim(self, slot_experts: Sequence[int], keep: set[int]) -> int:
        def age(slot: int) -> int:
            e = slot_experts[slot]
            return -2 if e < 0 else self.last_used[e]

        candidates = [s for s, e in enumerate(slot_experts) if e not in keep]
        return min(candidates, key=age) if candidates else -1


@CACHE_POLICIES.register("lfu")
class LFU:
    """Admit a missed expert when it has been used more often (tokens routed, all time) than the least
    used resident one, which leaves: popularity without recency."""

    def __init__(self, info: LayerInfo, costs: object = None) -> None:
        self.info = info
        self.uses = [0] * info.num_experts

    def admit(self, counts: Sequence[int], resident: Sequence[bool]) -> list[int]:
        for e, c in enumerate(counts):
            self.uses[e] += c
        coldest = min((self.uses[e] for e in range(self.info.num_experts) if resident[e]), default=-1)
        free = self.info.num_slots - sum(resident)
        missing = sorted((e for e, c in enumerate(counts) if c and not resident[e]), key=lambda e: -self.uses[e])
        return [e for i, e in enumerate(missing) if i < free or self.uses[e] > coldest][: self.info.num_slots]

    def victim(self, slot_experts: Sequence[int], keep: set[int]) -> int:
        candidates = [s for s, e in enumerate(slot_experts) if e not in keep]
        return min(candidates, key=lambda s: -1 if slot_experts[s] < 0 else self.uses[slot_experts[s]], default=-1)
