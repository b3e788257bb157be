"""Which expert each accelerator slot holds: the bookkeeping the live store and the simulator share."""

from __future__ import annotations

from ..policies import CachePolicy


class SlotMap:
    """slot -> expert and expert -> slot (-1: empty / not resident), changed only through `assign`, so the
    live runtime and the trace simulator evolve their slots identically."""

    def __init__(self, num_slots: int, num_experts: int) -> None:
        self.slot_experts: list[int] = [-1] * num_slots
        self.expert_slot: list[int] = [-1] * num_experts

    @property
    def num_slots(self) -> int:
        return len(self.slot_experts)

    def resident(self) -> list[bool]:
        return [s >= 0 for s in self.expert_slot]

    def assign(self, expert: int, slot: int) -> None:
        """Put `expert` in `slot`, evicting its occupant."""
        old = self.slot_experts[slot]
        if old >= 0:
            self.expert_slot[old] = -1
        self.slot_experts[slot] = expert
        self.expert_slot[expert] = slot

    def choose_slot(self, cache_policy: CachePolicy, keep: set[int]) -> int:
        """The slot the cache policy gives up for a newcomer, never one holding `keep`; -1 when none may go."""
        return cache_policy.victim(self.slot_experts, keep) if self.slot_experts else -1
