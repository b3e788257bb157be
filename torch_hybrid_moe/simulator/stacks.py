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


STACKS: dict[str, Stack] = {
    s.name: s
    for s in (
        Stack("ktransformers", "all_cpu", "lru", False, "all routed experts on the CPU, GPU for the rest of the model"),
        Stack("fiddler", "fiddler", "lfu", True, "Fiddler's CPU-or-transfer rule over popularity-cached slots"),
        Stack("cached", "cached_on_accelerator", "lru", True, "cached experts on the GPU, the rest on the CPU (our default)"),
        Stack("dali", "dali_greedy", "lfu", True, "DALI's greedy 0-1 assignment (cache policy: LFU until the window policy lands)"),
        Stack("optimal-sched", "optimal", "lru", True, "exact 0-1 optimum per layer step over LRU slots"),
    )
}
