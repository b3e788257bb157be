"""Pluggable placement policies (scheduler, cache policy, prefetcher) and their registries."""

# they register policies, and the tensor forms of those that run inside CUDA graphs
from . import activation_matrices, device_caching, device_scheduling, sequence_allocation, static_placement
from .base import CachePolicy, IdleLink, LayerInfo, Placement, Prefetcher, Scheduler, Timeline
from .caching import CACHE_POLICIES
from .prefetching import PREFETCHERS
from .registry import Registry
from .schedulers import SCHEDULERS

__all__ = [
    "CACHE_POLICIES",
    "PREFETCHERS",
    "SCHEDULERS",
    "CachePolicy",
    "IdleLink",
    "LayerInfo",
    "Placement",
    "Prefetcher",
    "Registry",
    "Scheduler",
    "Timeline",
]
