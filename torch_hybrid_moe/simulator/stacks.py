"""Named policy stacks: each paper's own combination as registry names (ours and the oracle are tuned per
hardware profile: `simulator/tuning.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..policies import CACHE_POLICIES, PREFETCHERS, SCHEDULERS


@dataclass(frozen=True)
class Stack:
    name: str
    scheduler: str
    cache_policy: str
    uses_slots: bool
    description: str
    prefetcher: str = "none"  # a PREFETCHERS name; asked for each layer during the previous one
    options: tuple[tuple[str, object], ...] = ()  # policy parameters (w_size, u_size, alpha, size...) by name
    # KTransformers' Expert Deferral (approximate): in decode, each token's `deferred` lowest-weight experts
    # finish on the CPU while the next block runs, and only that block's output waits for them
    deferred: int = 0
    # the bound's hypothetical (simulator/bound.py): replayed as the captured step although it has no tensor form
    in_graph: bool = False

    @property
    def capturable(self) -> bool:
        """Whether the live decode step can run this stack inside its CUDA graph: its scheduler, cache policy and
        prefetcher all have tensor forms (or it is the bound's, replayed there as a hypothetical)."""
        return self.in_graph or (
            self.scheduler in SCHEDULERS.graph_names()
            and self.cache_policy in CACHE_POLICIES.graph_names()
            and self.prefetcher in PREFETCHERS.graph_names()
        )


STACKS: dict[str, Stack] = {
    s.name: s
    for s in (
        Stack("ktransformers", "all_cpu", "lru", False, "all routed experts on the CPU, GPU for the rest of the model"),
        Stack(
            "fiddler",
            "fiddler",
            "static",
            True,
            "Fiddler: the calibration's most popular experts fixed on the GPU, CPU-or-transfer rule for the rest",
        ),
        Stack(
            "hybrimoe",
            "hybrimoe",
            "mrs_on_transfer",
            True,
            "HybriMoE: simulation scheduler, MRS cache, impact-driven prefetch",
            "impact",
        ),
        Stack(
            "dali",
            "dali_greedy",
            "dali_window",
            True,
            "DALI: greedy 0-1 assignment, workload-window cache, residual-based prefetch",
            "residual",
        ),
        Stack(
            "moe-infinity",
            "on_demand",
            "eam",
            True,
            "MoE-Infinity: every expert on the GPU, fetched on demand; EAM-guided cache and prefetch",
            "eam",
        ),
        Stack(
            "daop",
            "cached_on_accelerator",
            "daop",
            True,
            "DAOP: per-sequence allocation from prefill (swap at 1.05x), CPU for the rest (exact mode)",
        ),
        Stack(
            "lru-cache",
            "cached_on_accelerator",
            "lru",
            True,
            "cached experts on the GPU, LRU slots (the live default without a captured GPU graph)",
        ),
        Stack(
            "oracle-cache",
            "optimal",
            "belady",
            True,
            "Belady's offline-optimal slots (the hit-rate ceiling) with the exact per-step 0-1 optimum",
        ),
    )
}
PAPERS = ("ktransformers", "fiddler", "hybrimoe", "dali", "moe-infinity", "daop")  # the stacks ours must beat
