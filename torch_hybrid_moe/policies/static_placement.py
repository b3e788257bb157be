"""Static popularity placement (Fiddler's, llama.cpp users' hot-expert pinning): the slots hold the experts a
calibration run routed the most tokens to, and never change; its foresight form (the bound's) pins by the routing
it is judged on."""

from __future__ import annotations

from collections.abc import Sequence

from .base import LayerInfo
from .caching import CACHE_POLICIES, RankedCache


@CACHE_POLICIES.register("static")
class StaticPopularity(RankedCache):
    """value = calibration tokens per expert (`popularity`); the `num_slots` most popular experts are brought in
    once (ties: lower id) and stay: an expert a scheduler fetches is computed from a staging buffer (Fiddler's
    copy-and-compute), never displacing a pinned one (`pinned_slots`, read by the simulator's replay)."""

    pinned_slots = True

    def __init__(self, info: LayerInfo, popularity: Sequence[int] | None = None) -> None:
        super().__init__(info)
        if popularity is None or len(popularity) != info.num_experts:
            raise ValueError(
                f"cache policy 'static' needs popularity=[{info.num_experts} token counts] from a "
                "calibration run (the simulator's Calibration): simulator only for now"
            )
        self.popularity = list(popularity)
        ranked = sorted(range(info.num_experts), key=lambda e: (-self.popularity[e], e))
        self.pinned = ranked[: info.num_slots]

    def observe(self, counts: Sequence[int], scores: Sequence[float]) -> bool:
        return True

    def value(self, expert: int) -> float:
        return self.popularity[expert] if expert in self.pinned else -1.0

    def admit(self, counts: Sequence[int], resident: Sequence[bool], scores: Sequence[float]) -> list[int]:
        return [e for e in self.pinned if not resident[e]]


@CACHE_POLICIES.register("oracle_static")
class FuturePopularity(StaticPopularity):
    """`static` pinning by the tokens each expert gets over the whole replay (`future`, this layer's per-expert
    token counts of every step): the bound's candidate, whose popularity is known ahead. It carries its own
    foresight, so every replay of it (a table's row, a plot's sweep) pins the same experts."""

    def __init__(self, info: LayerInfo, future: Sequence[Sequence[int]] | None = None) -> None:
        if future is None:
            raise ValueError("cache policy 'oracle_static' needs the future routing (future=...): simulator only")
        super().__init__(info, [sum(step[e] for step in future) for e in range(info.num_experts)])
