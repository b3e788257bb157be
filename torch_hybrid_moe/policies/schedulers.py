"""Schedulers: which activated experts run on the accelerator and which on the CPU."""

from __future__ import annotations

from collections.abc import Sequence

from .base import LayerInfo, Placement
from .registry import Registry

SCHEDULERS: Registry = Registry("scheduler")


@SCHEDULERS.register("cached_on_accelerator")
class CachedOnAccelerator:
    """Experts already in a slot run on the accelerator, the rest on the CPU; nothing waits on a copy."""

    def __init__(self, info: LayerInfo) -> None:
        self.info = info

    def place(self, counts: Sequence[int], resident: Sequence[bool]) -> Placement:
        plan = Placement()
        for e, c in enumerate(counts):
            if c:
                (plan.accelerator if resident[e] else plan.cpu).append(e)
        return plan
