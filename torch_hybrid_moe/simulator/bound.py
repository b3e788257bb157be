"""The foresight bound: the fastest decode a stack that knows the routing to come reaches on a trace.

Ours is judged against it, so it is built without reference to ours: its candidates are future-aware caches
(Belady's, capped at 0, 1, 2, 4 or any number of copies a step; DALI's window ranked by the workload to come, for
windows of 1-16 steps and bursts of 1, 2, 4 or any number of copies) and two that settle where copies cost more than
reuse saves (the trace's most used experts pinned, its popularity known ahead; LFU's slots), each under the least
step time found (`oracle` placement: exhaustive over every assignment up to 10 active experts, local search from the
best of the cheap rules and the exact makespan optimum beyond; the link's backlog and in-flight copies included; and
Belady's uncapped slots under the exact optimum of DALI's makespan, the `oracle-cache` stack), with and without
foresight prefetch of the next layer's real experts (all of them, or the heaviest few) or the guessing prefetchers'
rules. Placement is chosen per step, so a later step's state is not optimised: no policy here is proven optimal, and
"bound" means the best of this family; `simulate` says so where a stack beats it. Every cache runs without prefetch
first; the `PREFETCH_FINALISTS` fastest, and Belady admitting nothing, run again with each prefetch. Where decode
steps are priced as the captured graph runs them (`graph`), each candidate also runs so (though none could live): the
bound is the better of the two, so that the graph's cheaper GPU share never puts a captured stack above it.
"""

from __future__ import annotations

from dataclasses import replace

from tqdm.auto import tqdm

from ..cost_model import CostModel
from ..policies.prefetching import MissingRouter
from ..traces import Trace
from .calibration import Calibration
from .replay import GraphStep, SimResult, simulate
from .stacks import STACKS, Stack

BELADY_FILLS = (0, 1, 2, 4, None)  # copies a step may start (None: any)
WINDOWS = (1, 2, 4, 8, 16)  # steps of future workload a window ranks by
WINDOW_FILLS = (1, 2, 4, None)  # copies a closing window may start (None: as many as there are slots)
PREFETCH_FINALISTS = 3
GUESSING_PREFETCHERS = ("eam", "gate", "residual", "impact")  # also tried over the finalists (see with_prefetcher)
PREFETCH_SIZES = (None, 1, 2, 4)  # foresight prefetch of the next layer's heaviest experts: all of them, or a few


def bound_caches(num_experts: int) -> list[Stack]:
    """The bound's candidates without prefetch."""
    belady = [
        Stack(
            "bound",
            "oracle",
            "belady",
            True,
            f"Belady's slots, {'any number of' if u is None else u} copies a step, least step time found",
            options=(("u_size", u),),
        )
        for u in BELADY_FILLS
    ]
    windows = [
        Stack(
            "bound",
            "oracle",
            "oracle_window",
            True,
            f"future-window cache (w {w}, {'any number of' if u is None else u} copies), least step time found",
            options=(("w_size", w), ("u_size", num_experts if u is None else u)),
        )
        for w in WINDOWS
        for u in WINDOW_FILLS
    ]
    exact = replace(STACKS["oracle-cache"], name="bound")  # Belady's slots under the exact makespan optimum
    settled = [  # few copies, then the slots stay: where copies cost more than any reuse saves
        Stack("bound", "oracle", "oracle_static", True, "the trace's most used experts pinned, least step time found"),
        Stack("bound", "oracle", "lfu", True, "LFU's slots, least step time found"),
    ]
    return [*belady, exact, *windows, *settled]


def with_foresight_prefetch(stack: Stack, size: int | None) -> Stack:
    """`stack` also copying in, during each layer, the `size` heaviest experts (None: every one) the next layer
    will really use."""
    which = "" if size is None else f" of {size}"
    return replace(
        stack,
        prefetcher="oracle",
        options=stack.options + ((("size", size),) if size else ()),
        description=f"{stack.description}, foresight prefetch{which}",
    )


def with_prefetcher(stack: Stack, prefetcher: str) -> Stack:
    """`stack` also prefetching by a guessing prefetcher's rule: copies chosen by other rules than "the heaviest"
    can beat foresight of the heaviest (realistic-8x2 at batch 4: EAM's over a future window, 1.008x the bound
    without it)."""
    return replace(stack, prefetcher=prefetcher, description=f"{stack.description}, {prefetcher} prefetch")


def bound(
    trace: Trace,
    costs: CostModel,
    batch: int,
    cache_ratio: float,
    calibration: Calibration | None = None,
    graph: GraphStep | None = None,
) -> tuple[Stack, SimResult]:
    """The fastest candidate on `trace` itself (foresight may look at the routing it is judged on) and its result;
    with `graph`, each candidate uncaptured and in the graph's step."""
    runs: list[tuple[Stack, Stack, SimResult]] = []  # (candidate, how it ran, result)

    def run(stacks: list[Stack], stage: str) -> None:
        ways = [(s, s) for s in stacks]
        if graph is not None:
            ways += [(s, replace(s, in_graph=True, description=f"{s.description}, in the graph")) for s in stacks]
        for s, way in tqdm(ways, desc=f"foresight bound, {stage}", unit="stack", leave=False):
            try:
                runs.append((s, way, simulate(trace, way, costs, batch, cache_ratio, calibration, graph=graph)))
            except MissingRouter:  # a router-replaying prefetcher on a trace without gate inputs: not a candidate
                continue

    caches = bound_caches(trace.meta["num_experts"])
    run(caches, "caches")
    finalists = list(dict.fromkeys(s for s, _, _ in sorted(runs, key=lambda r: -r[2].decode_tok_s)))
    finalists = finalists[:PREFETCH_FINALISTS]
    if caches[0] not in finalists:  # Belady admitting nothing: slots filled by prefetch alone
        finalists.append(caches[0])
    prefetched = [with_foresight_prefetch(s, size) for size in PREFETCH_SIZES for s in finalists]
    run(prefetched + [with_prefetcher(s, p) for p in GUESSING_PREFETCHERS for s in finalists], "prefetch")
    _, way, result = max(runs, key=lambda r: r[2].decode_tok_s)
    return way, result
