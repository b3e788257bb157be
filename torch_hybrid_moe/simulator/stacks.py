"""Named policy stacks: each paper's own combination, and ours, as registry names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stack:
    name: str
    scheduler: str
    cache_policy: str
    uses_slots: bool
    description: str
    prefetcher: str = "none"  # a PREFETCHERS name; asked for each layer during the previous one


STACKS: dict[str, Stack] = {
    s.name: s
    for s in (
        Stack("ktransformers", "all_cpu", "lru", False, "all routed experts on the CPU, GPU for the rest of the model"),
        Stack("fiddler", "fiddler", "lfu", True, "Fiddler's CPU-or-transfer rule over popularity-cached slots"),
        Stack("dali", "dali_greedy", "dali_window", True,
              "DALI's greedy 0-1 assignment, workload-window cache and residual-based prefetch", "residual"),
        Stack("mrs-cache", "cached_on_accelerator", "mrs", True,
              "HybriMoE's MRS cache with cached-on-GPU placement (its simulation scheduler: not yet)"),
        Stack("lru-cache", "cached_on_accelerator", "lru", True, "cached experts on the GPU, LRU slots (our default)"),
        Stack("ours", "queue_aware", "dali_window", True,
              "queue-aware placement (sees copies in flight) over DALI's window cache"),
        Stack("oracle-cache", "optimal", "belady", True,
              "Belady's offline-optimal slots (the hit-rate ceiling) with the exact per-step 0-1 optimum"),
    )
}
