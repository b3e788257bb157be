"""Our stack, tuned per hardware profile by simulation, and the oracle that knows what ours must guess.

Ours is queue-aware placement over DALI's window cache (or MRS, LFU, LRU, DAOP's, ours' cost-aware one or pinned
experts), with or without residual-based prefetch; which cache, window (w_size, u_size) and whether to prefetch depends
on the hardware, the batch and the slot budget, so `tune` replays a calibration trace through every candidate.
Candidates often differ by less than a percent, and the fastest on one trace need not be on the next: each is replayed
on several folds of it (`folds`: halves of its decode steps and of its sequences), each with what the policies learn
(residuals, popularity, past requests) calibrated on the other half, so that no policy is judged on the data it
was fitted to; and it is ranked by its worst fold (maximin of its speed relative to the fastest candidate of that fold),
which prefers settings that win consistently over ones that won once (a rule preferring the most conservative of the
candidates within the folds' disagreement was measured and dropped: benchmarks/RESULTS.md, 2026-11-30 evening). The
oracle replaces ours' guesses by the truth (the window's past workload by the workload to come, the residual prediction
by the next layer's real routing, local search by the best placement found), and is the fastest of those variants and
Belady's slots.
"""

from __future__ import annotations

from dataclasses import replace

from tqdm.auto import tqdm

from ..cost_model import CostModel
from ..policies import CACHE_POLICIES
from ..traces import Trace
from .calibration import Calibration
from .replay import GraphStep, SimResult, simulate, simulate_runnable
from .stacks import STACKS, Stack

WINDOWS = tuple((w, u, d) for w in (2, 4, 8) for u in (1, 2) for d in (0.0, 0.5, 0.8))  # (w_size, u_size, decay)
# caches ours' placement also runs over: admitting every missed expert that outranks a resident one, which a
# window's bursts of u_size copies cannot express where the link is fast and reuse high; and DAOP's per-sequence
# allocation, which wins where a batch's sequences keep to their own experts; and the calibration's most used experts
# pinned, where copies cost more than reuse saves (a calibration of the same model makes Fiddler's pinning the paper
# stack to beat on realistic routing at 8 experts)
CACHES = ("static", "lfu", "mrs", "lru", "daop", "cost_aware")
SETTLED = ("static", "lfu")  # caches that stop copying once they hold the popular experts: the most conservative
# ours' cost-aware cache: (decay, horizon) from sparing (a short horizon: few copies pay) to eager
COST_AWARE = tuple((d, h) for d in (0.8, 0.95) for h in (8.0, 32.0, 128.0))
# what the live decode graph can run (tensor forms): a tuning whose pick is to run live (`--save-ours`) tries only these
# caches, and no prefetch (DALI's residual prefetch needs residual vectors the live runtime does not have)
LIVE_CACHES = tuple(c for c in CACHES if c in CACHE_POLICIES.graph_names())
PREFETCH_SIZES = (1, 2)
FINALISTS = 2  # candidates (windows or caches) that are tried again with each prefetch size


def ours(w_size: int, u_size: int, decay: float, prefetch: int = 0) -> Stack:
    """Our stack with these parameters (prefetch 0: none)."""
    stack = Stack(
        "ours",
        "queue_aware",
        "dali_window",
        True,
        f"queue-aware placement, window cache (w {w_size}, u {u_size}, decay {decay:g})",
        options=(("w_size", w_size), ("u_size", u_size), ("decay", decay)),
    )
    return with_prefetch(stack, prefetch) if prefetch else stack


def ours_over(cache: str, **options: object) -> Stack:
    """Our placement over another cache policy (`CACHES`) with these options, without prefetch."""
    settings = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in options.items())
    return Stack(
        "ours",
        "queue_aware",
        cache,
        True,
        f"queue-aware placement, {cache} cache" + (f" ({settings})" if settings else ""),
        options=tuple(options.items()),
    )


def cache_candidates(cache: str) -> list[Stack]:
    """Ours over `cache`: once with its defaults, or over the grid of settings where it has one."""
    if cache == "cost_aware":
        return [ours_over(cache, decay=d, horizon=h) for d, h in COST_AWARE]
    return [ours_over(cache)]


def with_prefetch(stack: Stack, size: int) -> Stack:
    """An `ours` stack with residual prefetch of `size` experts a layer."""
    return replace(
        stack,
        prefetcher="residual",
        options=stack.options + (("size", size),),
        description=f"{stack.description}, residual prefetch {size}",
    )


def decode_halves(trace: Trace) -> tuple[Trace, Trace]:
    """The trace with its first, then its second half of decode steps (each keeping the prefill); ValueError with
    fewer than two decode steps, which leave a half without any."""
    last = int(trace.step.max())
    if last < 2:
        raise ValueError(f"tuning needs a trace of at least two decode steps, this one has {last}")
    mid = 1 + last // 2
    prefill = trace.step == 0
    return trace.select(prefill | (trace.step < mid)), trace.select(prefill | (trace.step >= mid))


def sequence_halves(trace: Trace) -> tuple[Trace, Trace] | None:
    """The trace's first and second half of sequences (each with its own prefill), or None with fewer than two."""
    sequences = trace.sequence.unique()
    if len(sequences) < 2:
        return None
    first = trace.sequence < sequences[len(sequences) // 2]
    return trace.select(first), trace.select(~first)


def folds(trace: Trace, batch: int) -> list[tuple[Trace, Trace, int]]:
    """(part replayed, part its policies learn from, batch) for each of the tuner's folds: the first and second half
    of decode steps, each learning from the other, and where the trace holds two sequences or more, the first and
    second half of its sequences likewise, at a batch no larger than a half holds. Time halves alone let a policy
    learn what the very sequences it is judged on do (pinning their popular experts) while the trace it is then
    judged on has other prompts: on mixtral-tiny / dali / 0.5 at batch 16 they picked the static cache, 24th of 33
    there (benchmarks/RESULTS.md, 2026-12-01)."""
    first, second = decode_halves(trace)
    parts = [(first, second, batch), (second, first, batch)]
    by_sequence = sequence_halves(trace)
    if by_sequence is not None:
        a, b = by_sequence
        fold_batch = min(batch, len(a.sequence.unique()), len(b.sequence.unique()))
        parts += [(a, b, fold_batch), (b, a, fold_batch)]
    return parts


def tune(
    trace: Trace,
    costs: CostModel,
    batch: int,
    cache_ratio: float,
    calibration: Calibration,
    windows: tuple[tuple[int, int, float], ...] = WINDOWS,
    prefetch_sizes: tuple[int, ...] = PREFETCH_SIZES,
    caches: tuple[str, ...] = CACHES,
    graph: GraphStep | None = None,
) -> tuple[Stack, list[tuple[Stack, list[SimResult]]]]:
    """Our most consistently fast decode on `trace`, which should not be the trace the result is then judged
    on: every window and other cache without prefetch, then the best `FINALISTS` with each prefetch size (only
    where the trace kept gate inputs); decode steps replayed as `graph` runs them where given. Returns the winner
    and every (candidate, results on each fold of `folds`)."""
    gate_inputs = bool(calibration.routers) and trace.gate_inputs
    learnt = [(part, Calibration.learn(source, calibration.routers), b) for part, source, b in folds(trace, batch)]
    tried: list[tuple[Stack, list[SimResult]]] = []

    def run(stacks: list[Stack], stage: str) -> None:
        for s in tqdm(stacks, desc=f"tuning {stage} (batch {batch}, cache {cache_ratio:g})", unit="stack", leave=False):
            tried.append((s, [simulate(part, s, costs, b, cache_ratio, cal, graph=graph) for part, cal, b in learnt]))

    def ranked() -> list[tuple[Stack, list[SimResult]]]:  # stable: an exact tie goes to the candidate listed first
        return sorted(tried, key=lambda entry: consistency(entry[1], [r for _, r in tried]), reverse=True)

    # the settling caches first, then the windows, then the eager caches
    settled, eager = [c for c in caches if c in SETTLED], [c for c in caches if c not in SETTLED]
    candidates = [s for c in settled for s in cache_candidates(c)] + [ours(*w) for w in windows]
    run(candidates + [s for c in eager for s in cache_candidates(c)], "caches")
    if gate_inputs and prefetch_sizes:
        run([with_prefetch(s, p) for s, _ in ranked()[:FINALISTS] for p in prefetch_sizes], "prefetch")
    return ranked()[0][0], tried


def judged_rank(
    trace: Trace,
    picked: Stack,
    tried: list[tuple[Stack, list[SimResult]]],
    costs: CostModel,
    batch: int,
    cache_ratio: float,
    calibration: Calibration,
    graph: GraphStep | None = None,
) -> tuple[int, int, float, float]:
    """How the tuned pick does on the trace it is judged on, among every candidate `tune` tried: (its rank, 1 the
    fastest; the candidates; its decode tok/s; that over the fastest's), replayed as `tune` replayed them (`graph`).
    Candidates within a percent of each other on the calibration folds often swap places here: this says what that
    costs."""
    speeds = [simulate(trace, s, costs, batch, cache_ratio, calibration, graph=graph).decode_tok_s for s, _ in tried]
    mine = speeds[[s for s, _ in tried].index(picked)]
    return 1 + sum(v > mine for v in speeds), len(speeds), mine, mine / max(speeds) if max(speeds) else 1.0


def consistency(results: list[SimResult], everyone: list[list[SimResult]]) -> tuple[float, float]:
    """(worst, mean) over the folds of decode speed relative to the fastest of `everyone` on that fold."""
    ratios = [r.decode_tok_s / max(other[i].decode_tok_s for other in everyone) for i, r in enumerate(results)]
    return min(ratios), sum(ratios) / len(ratios)


def oracle_of(stack: Stack) -> Stack:
    """`stack` with perfect knowledge: future-window cache, foresight prefetch, best-found placement."""
    if stack.cache_policy != "dali_window":
        raise ValueError(f"oracle_of: the oracle mirrors a dali_window stack, not {stack.cache_policy!r}")
    return replace(
        stack,
        name="oracle",
        scheduler="oracle",
        cache_policy="oracle_window",
        prefetcher="oracle" if stack.prefetcher != "none" else "none",
        description="perfect knowledge: "
        + stack.description.replace("queue-aware", "best-found")
        .replace("window cache", "future-window cache")
        .replace("residual prefetch", "foresight prefetch"),
    )


def foresight(stack: Stack) -> list[Stack]:
    """The oracle's candidates for `stack`: its full mirror (`oracle_of`, for a window cache); the stack's own
    cache with the best placement found, with and without foresight prefetch of every expert the next layer
    will use (a cache filled from the future workload, or prefetches, can move more experts than they save
    when copies are slow); and Belady's slots with the exact per-step optimum."""
    placed = replace(
        stack,
        name="oracle",
        scheduler="oracle",
        description="best-found placement over the same cache and prefetch",
    )
    options = tuple((k, v) for k, v in stack.options if k != "size")
    prefetched = replace(
        placed,
        prefetcher="oracle",
        options=options,
        description="perfect knowledge: best-found placement and foresight prefetch of the next "
        "layer's experts, over the same cache",
    )
    mirror = [oracle_of(stack)] if stack.cache_policy == "dali_window" else []
    return [*mirror, placed, prefetched, replace(STACKS["oracle-cache"], name="oracle")]


def oracle(
    trace: Trace, stack: Stack, costs: CostModel, batch: int, cache_ratio: float, calibration: Calibration
) -> Stack:
    """The ceiling row for `stack`: the fastest decode among `foresight(stack)` on `trace` itself (an oracle
    may look at the routing it is judged on). No policy is proven optimal here, so this is the best foresight
    we can compute, not a bound."""
    return max(
        foresight(stack),
        key=lambda s: simulate_runnable(trace, s, costs, batch, cache_ratio, calibration)[1].decode_tok_s,
    )
