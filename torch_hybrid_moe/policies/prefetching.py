"""Prefetchers: which next-layer experts to copy into slots before that layer's routing is known.

A layer's prefetcher is asked with the previous MoE layer's gate input (`hidden`) and routing, while that
layer computes. "gate" (DAOP, HybriMoE) applies this layer's router to that hidden state; "residual" (DALI)
first adds a calibrated mean inter-layer residual, so the input looks more like this layer's own gate input;
"impact" (HybriMoE) keeps only the gate's candidates whose copy the cost model says shortens the step.
They need the layer's router (`router=`): the simulator's calibration and the live patch (the model's own
gate) both pass it. "residual" also needs a calibrated residual, which only the simulator has so far.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..cost_model import CostModel
from .base import LayerInfo
from .registry import Registry
from .schedulers import DaliGreedy, makespan

PREFETCHERS: Registry = Registry("prefetcher")


def router_scores(logits: torch.Tensor, score_fn: str) -> torch.Tensor:
    """The scores a router picks its top-k from: softmax or sigmoid of its logits, in fp32."""
    logits = logits.float()
    return logits.softmax(-1) if score_fn == "softmax" else logits.sigmoid()


@dataclass(frozen=True)
class Router:
    """One MoE layer's gate, replayed off the model: `weight` [E, H]; scores softmax or sigmoid of the logits.

    Sigmoid routers are DeepSeek-V3's: the choice adds `bias` (e_score_correction_bias) and keeps only the
    `topk_group` of `n_group` expert groups with the highest sum of their two best scores (`group_score` "top2");
    without that group limit, a third of the embedded deepseek-tiny's choices differ from its real routing.
    DeepSeek-V2's group_limited_greedy ranks a group by its best score ("max"). `group_limit` reads these from a
    model's config.
    """

    weight: torch.Tensor
    top_k: int
    score_fn: str = "softmax"
    bias: torch.Tensor | None = None
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "top2"

    def __post_init__(self) -> None:
        if self.score_fn not in ("softmax", "sigmoid"):
            raise ValueError(f"router score_fn must be 'softmax' or 'sigmoid', not {self.score_fn!r}")
        if self.weight.dim() != 2 or not 0 < self.top_k <= self.weight.shape[0]:
            raise ValueError(
                f"router weight must be [experts, hidden] with top_k <= experts; got "
                f"{tuple(self.weight.shape)}, top_k {self.top_k}"
            )
        if self.weight.shape[0] % self.n_group:
            raise ValueError(
                f"{self.weight.shape[0]} experts do not split into the config's n_group = {self.n_group} groups: "
                "n_group must divide the number of routed experts"
            )
        if self.group_score not in ("top2", "max"):
            raise ValueError(f"router group_score must be 'top2' or 'max', not {self.group_score!r}")

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k expert ids [rows, k], their scores [rows, k]) as the model's gate chooses them."""
        if hidden.dim() != 2 or hidden.shape[1] != self.weight.shape[1]:
            raise ValueError(f"hidden must be [rows, {self.weight.shape[1]}], got {tuple(hidden.shape)}")
        logits = hidden.float() @ self.weight.to(hidden.device, torch.float32).T
        scores = router_scores(logits, self.score_fn)
        choice = scores if self.bias is None else scores + self.bias.to(scores.device, torch.float32)
        if self.n_group > 1:
            groups = choice.view(choice.shape[0], self.n_group, -1)
            rank = groups.topk(2, dim=-1).values.sum(-1) if self.group_score == "top2" else groups.amax(-1)
            best = rank.topk(self.topk_group, dim=-1).indices
            keep = torch.zeros(best.shape[0], self.n_group, dtype=torch.bool, device=best.device)
            keep.scatter_(1, best, True)
            choice = choice.masked_fill(~keep.repeat_interleave(groups.shape[2], dim=1), float("-inf"))
        ids = choice.topk(self.top_k, dim=-1).indices
        return ids, scores.gather(1, ids)


def group_limit(model_type: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """`Router`'s group arguments for a model's (text) config, as its gate applies them: DeepSeek-V2 limits groups
    only with topk_method "group_limited_greedy" (a group's best score), DeepSeek-V3 always (its two best)."""
    if model_type == "deepseek_v2" and config.get("topk_method") != "group_limited_greedy":
        return {}
    return {
        "n_group": config.get("n_group") or 1,
        "topk_group": config.get("topk_group") or 1,
        "group_score": "max" if model_type == "deepseek_v2" else "top2",
    }


class MissingRouter(ValueError):
    """A prefetcher that replays the model's router was offered none (e.g. a trace without gate inputs):
    callers running many stacks skip that one and say why, rather than fail."""


def _need_router(name: str, router: Router | None, info: LayerInfo) -> Router:
    if router is None:
        raise MissingRouter(
            f"prefetcher {name!r} applies this layer's router to the previous layer's hidden state: "
            "pass router=Router(...) (the simulator and the live patch do)"
        )
    if router.weight.shape[0] != info.num_experts:
        raise ValueError(f"prefetcher {name!r}: router has {router.weight.shape[0]} experts, layer {info.num_experts}")
    return router


@PREFETCHERS.register("none")
class NoPrefetch:
    """Prefetch nothing: slots change only through the cache policy."""

    def __init__(self, info: LayerInfo) -> None:
        self.info = info

    def select(self, hidden: torch.Tensor, prev_topk_ids: torch.Tensor, resident: Sequence[bool]) -> list[int]:
        return []


@PREFETCHERS.register("gate")
class GatePrefetch:
    """DAOP / HybriMoE: this layer's router on the previous layer's gate input; the `size` experts the most
    rows would be routed to (ties: higher summed score) are prefetched. `size` defaults to DALI's settings,
    4 of DeepSeek's top-6 and 1 of Mixtral's top-2: 2 * top_k // 3, at least 1."""

    name = "gate"

    def __init__(self, info: LayerInfo, router: Router | None = None, size: int | None = None) -> None:
        self.info = info
        self.router = _need_router(self.name, router, info)
        size = max(1, 2 * self.router.top_k // 3) if size is None else size
        if not 1 <= size <= info.num_experts:
            raise ValueError(f"prefetch size must be in [1, {info.num_experts}] (the layer's experts), got {size}")
        self.size = size

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.float()

    def routed(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per expert, on the hidden state's device and without host synchronisation: how many rows the router
        would send to it, and their summed score (float64 [E] each)."""
        ids, scores = self.router.route(self.features(hidden))
        flat = ids.flatten()
        counts = torch.zeros(self.info.num_experts, dtype=torch.float64, device=flat.device)
        counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.float64))
        sums = torch.zeros_like(counts).index_add_(0, flat, scores.flatten().double())
        return counts, sums

    def priority(self, hidden: torch.Tensor) -> torch.Tensor:
        """`predict`'s order as one float64 key per expert (0: unused), for the replay-safe path: a summed score
        is at most its count of rows (scores are <= 1), so count * (rows + 1) + sum orders by count, then sum."""
        counts, sums = self.routed(hidden)
        return counts * (hidden.shape[0] + 1) + sums

    def predict(self, hidden: torch.Tensor) -> list[tuple[int, float, int]]:
        """Predicted (token count, summed score, expert) of every expert some row would use, heaviest first."""
        counts, sums = (t.tolist() for t in self.routed(hidden))
        return sorted(
            ((int(c), s, e) for e, (c, s) in enumerate(zip(counts, sums)) if c), key=lambda x: (-x[0], -x[1], x[2])
        )

    def forecast(self, hidden: torch.Tensor) -> list[int]:
        """The `size` experts predicted heaviest, resident or not: what a prefetch accuracy scores."""
        return [e for _, _, e in self.predict(hidden)[: self.size]]

    def select(self, hidden: torch.Tensor, prev_topk_ids: torch.Tensor, resident: Sequence[bool]) -> list[int]:
        return self.forecast(hidden)


@PREFETCHERS.register("residual")
class ResidualPrefetch(GatePrefetch):
    """DALI: the gate prefetch on hidden + res_vec, the mean residual between the two layers' gate inputs
    (`simulator.calibration.residual_vectors`), which brings the input closer to this layer's own gate input."""

    name = "residual"

    def __init__(
        self,
        info: LayerInfo,
        router: Router | None = None,
        residual: torch.Tensor | None = None,
        size: int | None = None,
    ) -> None:
        super().__init__(info, router, size)
        if residual is None or residual.shape != (self.router.weight.shape[1],):
            raise ValueError(
                f"prefetcher 'residual' needs residual=[{self.router.weight.shape[1]}] "
                "(simulator.calibration.residual_vectors of a calibration trace)"
            )
        self.residual = residual.float()

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.float() + self.residual


@PREFETCHERS.register("impact")
class ImpactPrefetch(GatePrefetch):
    """HybriMoE's impact-driven choice: among the gate's candidates, greedily the one whose copy most shortens
    the predicted step (DALI's makespan under DALI's greedy placement, on the predicted token counts), while
    that gain is positive, up to `size`. The copy overlaps the previous layer, so its price is the resident
    expert it displaces once the slots are full, taken to be the one the predicted step needs least."""

    name = "impact"

    def __init__(
        self, info: LayerInfo, router: Router | None = None, costs: CostModel | None = None, size: int | None = None
    ) -> None:
        super().__init__(info, router, size)
        if costs is None:
            raise ValueError("prefetcher 'impact' weighs each copy by its simulated gain: pass costs=CostModel(...)")
        self.costs = costs
        self.scheduler = DaliGreedy(info, costs)

    def step_time(self, counts: Sequence[int], resident: Sequence[bool]) -> float:
        return makespan(counts, resident, self.scheduler.place(counts, resident).accelerator, self.costs)

    def with_copy(self, expert: int, counts: Sequence[int], resident: list[bool], keep: set[int]) -> list[bool]:
        """Slots after copying `expert` in, displacing the least-needed resident expert outside `keep` if full."""
        after = list(resident)
        if sum(after) >= self.info.num_slots:
            out = min(
                (e for e in range(self.info.num_experts) if after[e] and e not in keep), key=lambda e: (counts[e], e)
            )
            after[out] = False
        after[expert] = True
        return after

    def select(self, hidden: torch.Tensor, prev_topk_ids: torch.Tensor, resident: Sequence[bool]) -> list[int]:
        counts = [0] * self.info.num_experts
        for c, _, e in self.predict(hidden):
            counts[e] = c
        current = list(resident)
        picked: list[int] = []
        while len(picked) < min(self.size, self.info.num_slots):
            now = self.step_time(counts, current)
            gains = [
                (now - self.step_time(counts, self.with_copy(e, counts, current, set(picked))), e)
                for e in range(self.info.num_experts)
                if counts[e] and not current[e]
            ]
            gain, best = max(gains, key=lambda g: (g[0], -g[1]), default=(0.0, -1))
            if gain <= 0:
                break
            current = self.with_copy(best, counts, current, set(picked))
            picked.append(best)
        return picked


@PREFETCHERS.register("oracle")
class OraclePrefetch:
    """Perfect foresight: the `size` (default: all) heaviest experts this layer really routes to at the step
    being prefetched for (`future`, its per-expert token counts of every step; asked once per step, in order).
    The prefetch half of the oracle stack, simulator only."""

    def __init__(self, info: LayerInfo, future: Sequence[Sequence[int]] | None = None, size: int | None = None) -> None:
        if future is None:
            raise ValueError("prefetcher 'oracle' needs the future routing (future=...): simulator only")
        if size is not None and size < 1:
            raise ValueError(f"prefetch size must be at least 1, got {size}")
        self.info, self.future = info, future
        self.size = info.num_experts if size is None else size
        self.step = 0

    def select(self, hidden: torch.Tensor, prev_topk_ids: torch.Tensor, resident: Sequence[bool]) -> list[int]:
        counts = self.future[self.step]
        self.step += 1
        return sorted((e for e, c in enumerate(counts) if c), key=lambda e: (-counts[e], e))[: self.size]
