"""Pluggable placement policies (scheduler, cache policy, prefetcher) and their registries."""

from . import activation_matrices, sequence_allocation, static_placement  # noqa: F401 - they register policies
from .base import CachePolicy, LayerInfo, Placement, Prefetcher, Scheduler, Timeline
from .caching import CACHE_POLICIES
from .prefetching import PREFETCHERS
from .registry import Registry
from .schedulers import SCHEDULERS

__all__ = [
    "CACHE_POLICIES",
    "PREFETCHERS",
    "SCHEDULERS",
    "CachePolicy",
    "LayerInfo",
    "Placement",
    "Prefetcher",
    "Registry",
    "Scheduler",
    "Timeline",
]
