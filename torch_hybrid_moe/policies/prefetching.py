"""Prefetchers: which next-layer experts to copy into slots before that layer's routing is known."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import LayerInfo
from .registry import Registry

PREFETCHERS: Registry = Registry("prefetcher")


@PREFETCHERS.register("none")
class NoPrefetch:
    """Prefetch nothing: slots change only through the cache policy."""

    def __init__(self, info: LayerInfo) -> None:
        self.info = info

    def select(self, hidden: torch.Tensor, prev_topk_ids: torch.Tensor, resident: Sequence[bool]) -> list[int]:
        return []
