"""Cache policies: which experts the accelerator slots hold."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..cost_model import CostModel
from ..errors import is_count
from .base import LayerInfo
from .registry import Registry

CACHE_POLICIES: Registry = Registry("cache policy")


@CACHE_POLICIES.register("lru")
class LRU:
    """Every missed expert is admitted after its step; the least recently used resident one leaves."""

    def __init__(self, info: LayerInfo, costs: object = None) -> None:
        self.info = info
        self.clock = 0
        self.last_used = [-1] * info.num_experts

    def admit(self, counts: Sequence[int], resident: Sequence[bool], scores: Sequence[float]) -> list[int]:
        self.clock += 1
        missing = []
        for e, c in enumerate(counts):
            if c:
                self.last_used[e] = self.clock
                if not resident[e]:
                    missing.append(e)
        missing.sort(key=lambda e: -counts[e])
        return missing[: self.info.num_slots]

    def victim(self, slot_experts: Sequence[int], keep: set[int]) -> int:
        def age(slot: int) -> int:
            e = slot_experts[slot]
            return -2 if e < 0 else self.last_used[e]

        candidates = [s for s, e in enumerate(slot_experts) if e not in keep]
        return min(candidates, key=age) if candidates else -1


class RankedCache:
    """Keep the experts of highest `value`: a missed expert is admitted into a free slot, or when it
    outranks the least valuable resident expert, which then leaves. Subclasses say what value means."""

    def __init__(self, info: LayerInfo, costs: object = None) -> None:
        self.info = info

    def observe(self, counts: Sequence[int], scores: Sequence[float]) -> bool:
        """Record one step; False when this step may not change the slots."""
        raise NotImplementedError

    def value(self, expert: int) -> float:
        raise NotImplementedError

    def admit(self, counts: Sequence[int], resident: Sequence[bool], scores: Sequence[float]) -> list[int]:
        if not self.observe(counts, scores):
            return []
        return self.paired([e for e, c in enumerate(counts) if c], resident, self.info.num_slots)

    def victim(self, slot_experts: Sequence[int], keep: set[int]) -> int:
        candidates = [s for s, e in enumerate(slot_experts) if e not in keep]
        return min(
            candidates, key=lambda s: float("-inf") if slot_experts[s] < 0 else self.value(slot_experts[s]), default=-1
        )

    def paired(
        self, candidates: Sequence[int], resident: Sequence[bool], limit: int, threshold: float = 1.0, margin: float = 0
    ) -> list[int]:
        """Swaps pair by pair: the i-th most valuable missing candidate displaces the i-th least valuable resident
        expert (a free slot first) while it is worth more than `threshold` times as much plus `margin`; at most
        `limit`. Checking each against the coldest resident alone would let a second newcomer evict a hot expert
        (the replay-safe form, `device_caching.admissions`, pairs them so too). A candidate valued -inf (never
        needed) is not copied.
        """
        newcomers = sorted(
            (e for e in candidates if not resident[e] and self.value(e) > float("-inf")),
            key=lambda e: (-self.value(e), e),
        )
        held = sorted(self.value(e) for e in range(self.info.num_experts) if resident[e])
        # what each newcomer would displace, cheapest first: None for a free slot
        out: list[float | None] = [None] * (self.info.num_slots - len(held)) + held
        return [
            e
            for e, displaced in zip(newcomers[:limit], out)
            if displaced is None or self.value(e) > threshold * displaced + margin
        ]


@CACHE_POLICIES.register("lfu")
class LFU(RankedCache):
    """Popularity without recency: value = tokens routed to the expert so far."""

    def __init__(self, info: LayerInfo, costs: object = None) -> None:
        super().__init__(info)
        self.uses = [0] * info.num_experts

    def observe(self, counts: Sequence[int], scores: Sequence[float]) -> bool:
        for e, c in enumerate(counts):
            self.uses[e] += c
        return True

    def value(self, expert: int) -> float:
        return self.uses[expert]


@CACHE_POLICIES.register("mrs")
class MinusRecentScore(RankedCache):
    """HybriMoE's score-aware cache: S = alpha * TopP(s) + (1 - alpha) * S every step (router scores of the
    step's top-p experts, summed over its tokens); the lowest S leaves."""

    def __init__(self, info: LayerInfo, costs: object = None, alpha: float = 0.5) -> None:
        super().__init__(info)
        if not 0 < alpha <= 1:  # also refuses NaN
            raise ValueError(f"mrs needs 0 < alpha <= 1 (the newest step's weight), got {alpha!r}")
        self.alpha = alpha
        self.score = [0.0] * info.num_experts

    def observe(self, counts: Sequence[int], scores: Sequence[float]) -> bool:
        self.score = [self.alpha * s + (1 - self.alpha) * old for s, old in zip(scores, self.score)]
        return True

    def value(self, expert: int) -> float:
        return self.score[expert]


@CACHE_POLICIES.register("mrs_on_transfer")
class MRSOnTransfer(MinusRecentScore):
    """MRS as HybriMoE's paper uses it, a replacement policy: the scores advance every step and choose what a
    transfer (its scheduler's fetches, its prefetches) evicts, and nothing is copied in on the cache's own account.
    (`mrs`, in ours' tuning space, also admits a missed expert that outranks a resident one: on HybriMoE's stack those
    background copies filled the link and held up its own fetches, leaving it an all-CPU stack's speed.)"""

    def admit(self, counts: Sequence[int], resident: Sequence[bool], scores: Sequence[float]) -> list[int]:
        self.observe(counts, scores)
        return []


@CACHE_POLICIES.register("dali_window")
class WorkloadWindow(RankedCache):
    """DALI's workload-aware replacement (Algorithm 2): tokens per expert are summed over a tumbling window of
    `w_size` steps; when a window closes, the `u_size` highest-scoring experts on the CPU replace the `u_size`
    lowest-scoring ones on the GPU, pair by pair while the newcomer scores higher (a free slot takes any expert
    with a score), and the scores restart from zero. Copies come in bursts of at most `u_size`, which the
    scheduler can plan around. u_size defaults to the paper's settings, 8 of DeepSeek's 64 experts and 1 of
    Mixtral's 8: num_experts // 8. Ours adds `decay` (0 in DALI): a closing window's scores keep `decay` times
    the previous ones, so one quiet window does not erase an expert's history."""

    def __init__(self, info: LayerInfo, w_size: int = 4, u_size: int | None = None, decay: float = 0.0) -> None:
        super().__init__(info)
        u_size = max(1, info.num_experts // 8) if u_size is None else u_size
        if not (is_count(w_size, 1) and is_count(u_size, 1)) or not 0 <= decay < 1:  # also refuses NaN
            raise ValueError(
                f"dali_window needs whole w_size >= 1, u_size >= 1 and 0 <= decay < 1; got {w_size!r}, {u_size!r}, "
                f"{decay!r}"
            )
        self.w_size, self.u_size, self.decay = w_size, u_size, decay
        self.window = [0] * info.num_experts  # tokens so far in the open window
        self.scores: list[float] = [0] * info.num_experts  # the last closed window's: what replacement ranks by
        self.steps = 0

    def observe(self, counts: Sequence[int], scores: Sequence[float]) -> bool:
        self.window = [w + c for w, c in zip(self.window, counts)]
        self.steps += 1
        if self.steps % self.w_size:
            return False
        self.scores = [w + self.decay * s for w, s in zip(self.window, self.scores)]
        self.window = [0] * self.info.num_experts
        return True

    def value(self, expert: int) -> float:
        return self.scores[expert]

    def admit(self, counts: Sequence[int], resident: Sequence[bool], scores: Sequence[float]) -> list[int]:
        if not self.observe(counts, scores):
            return []
        return self.paired([e for e in range(self.info.num_experts) if self.scores[e] > 0], resident, self.u_size)


@CACHE_POLICIES.register("cost_aware")
class CostAware(RankedCache):
    """Ours: an expert's value is the time its slot saves a step, learnt as a moving average (`decay`, the weight of
    the past) of what each step would have saved running it from a slot instead of on the CPU (t_cpu - t_gpu at its
    token count; 0 when it was not routed to): frequency, recency and batch size weighed on one scale, the cost
    model's. A missed expert displaces the least valuable resident one when the gain, over `horizon` steps of
    residency, exceeds the copy's time on the link: with a fast link and experts that recur it admits eagerly, with
    a slow one it holds still. Needs the cost model (live: `HybridMoEConfig.hardware`)."""

    def __init__(
        self, info: LayerInfo, costs: CostModel | None = None, decay: float = 0.9, horizon: float = 32.0
    ) -> None:
        super().__init__(info)
        if costs is None:
            raise ValueError(
                "cache policy 'cost_aware' weighs copies by cost: pass costs=CostModel(...) (live: "
                "HybridMoEConfig(hardware=<a cost_model.HARDWARE preset or 'local'>))"
            )
        if not 0 <= decay < 1 or not (horizon > 0 and math.isfinite(horizon)):  # also refuses NaN
            raise ValueError(f"cost_aware needs 0 <= decay < 1 and a finite horizon > 0; got {decay!r}, {horizon!r}")
        self.costs, self.decay = costs, decay
        self.margin = costs.t_transfer() / horizon  # seconds a step the newcomer must save over the one it displaces
        self.saving = [0.0] * info.num_experts

    def observe(self, counts: Sequence[int], scores: Sequence[float]) -> bool:
        d, c = self.decay, self.costs
        self.saving = [d * v + (1 - d) * (c.t_cpu(n) - c.t_gpu(n) if n else 0.0) for v, n in zip(self.saving, counts)]
        return True

    def value(self, expert: int) -> float:
        return self.saving[expert]

    def admit(self, counts: Sequence[int], resident: Sequence[bool], scores: Sequence[float]) -> list[int]:
        self.observe(counts, scores)
        active = [e for e, c in enumerate(counts) if c]
        return self.paired(active, resident, self.info.num_slots, margin=self.margin)


@CACHE_POLICIES.register("belady")
class Belady(RankedCache):
    """The offline optimum (evict the expert used farthest in the future, admit only what is used sooner):
    the hit-rate ceiling. Needs `future`, this layer's per-expert token counts of every step in order. `u_size`
    caps the admissions a step may start (None: no cap; 0: only the scheduler's own fetches and prefetches fill
    slots): with slow links, fewer copies can beat more hits."""

    def __init__(
        self, info: LayerInfo, future: Sequence[Sequence[int]] | None = None, u_size: int | None = None
    ) -> None:
        super().__init__(info)
        if future is None:
            raise ValueError("cache policy 'belady' needs the future routing (future=...): simulator only")
        if u_size is not None and not is_count(u_size):
            raise ValueError(f"belady needs a whole u_size >= 0 (or None: no cap); got {u_size!r}")
        self.future, self.u_size = future, u_size
        self.step = 0

    def observe(self, counts: Sequence[int], scores: Sequence[float]) -> bool:
        self.step += 1
        return True

    def value(self, expert: int) -> float:
        for ahead, active in enumerate(self.future[self.step :]):
            if active[expert]:
                return -ahead
        return float("-inf")

    def admit(self, counts: Sequence[int], resident: Sequence[bool], scores: Sequence[float]) -> list[int]:
        # pair by pair, as RankedCache.admit: the i-th soonest-needed newcomer displaces the i-th latest-needed
        # resident only when it is needed sooner; `u_size` caps the copies
        self.observe(counts, scores)
        limit = self.info.num_slots if self.u_size is None else self.u_size
        return self.paired([e for e, c in enumerate(counts) if c], resident, limit)


@CACHE_POLICIES.register("oracle_window")
class FutureWindow(WorkloadWindow):
    """DALI's replacement ranked by the workload still to come: when a window closes, scores are the tokens of
    the next `w_size` steps (`future`, this layer's per-expert token counts of every step), so the same bursts
    of at most `u_size` copies bring in what will really be used. The cache half of the oracle stack."""

    def __init__(
        self, info: LayerInfo, future: Sequence[Sequence[int]] | None = None, w_size: int = 4, u_size: int | None = None
    ) -> None:
        super().__init__(info, w_size, u_size)
        if future is None:
            raise ValueError("cache policy 'oracle_window' needs the future routing (future=...): simulator only")
        self.future = future

    def observe(self, counts: Sequence[int], scores: Sequence[float]) -> bool:
        self.steps += 1
        if self.steps % self.w_size:
            return False
        ahead = self.future[self.steps : self.steps + self.w_size]
        self.scores = [sum(step[e] for step in ahead) for e in range(self.info.num_experts)]
        return True
