"""MoE-Infinity's expert activation matrices (EAMs): match the request in flight against past requests and
use the closest one's activations to rank this layer's experts for caching and prefetching.

An EAM is a request's (MoE layers x experts) token counts. Matching compares only the layers the request has
already run (its first rows) by cosine similarity of the flattened rows; MoE-Infinity's released code masks
the wrong rows (the observed ones) and so always matches its first entry. The matched EAM's rows, each
normalised to sum 1, are the predicted activation likelihoods; a per-layer slot pool ranks experts of one
layer only, so the paper's layer-proximity factor (1 - (i - l) / L) is a constant there and drops out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import is_count
from .base import LayerInfo
from .caching import CACHE_POLICIES, RankedCache
from .prefetching import PREFETCHERS
from .requests import RequestActivations


def closest_request(
    current: torch.Tensor, collection: torch.Tensor | Sequence[torch.Tensor], observed: int
) -> int | None:
    """Index of the past EAM most cosine-similar to `current` over its first `observed` rows (ties: the newest);
    None when nothing has been observed or the collection is empty. `collection`: the EAMs, or them stacked."""
    if len(collection) == 0 or observed < 1:
        return None
    now = current[:observed].flatten().double()
    if not now.any():
        return None
    stacked = collection if isinstance(collection, torch.Tensor) else torch.stack(list(collection))
    past = stacked[:, :observed].flatten(1).double()
    similarity = (past @ now) / (past.norm(dim=1) * now.norm()).clamp_min(1e-300)
    best = similarity.max()
    return int((similarity == best).nonzero().flatten()[-1])


class _Predictor:
    """This layer's predicted activation likelihoods from the closest past request (the request's own counts
    when no past request matches)."""

    def __init__(self, info: LayerInfo, request: RequestActivations | None, capacity: int, name: str) -> None:
        if request is None:
            raise ValueError(
                f"{name} matches the request in flight against past ones: pass "
                "request=RequestActivations(...) (the simulator does; the live runtime does not yet)"
            )
        if not is_count(capacity, 1):
            raise ValueError(f"{name} needs capacity >= 1 (past requests kept), got {capacity!r}")
        self.row = request.row[info.layer_idx]
        self.request, self.capacity = request, capacity

    def likelihood(self, observed: int) -> torch.Tensor:
        collection = self.request.past()[-self.capacity :]
        match = closest_request(self.request.matrix, collection, observed)
        source = self.request.matrix if match is None else collection[match]
        counts = source[self.row]
        return counts / counts.sum() if counts.any() else counts


@CACHE_POLICIES.register("eam")
class ActivationMatrixCache(RankedCache):
    """MoE-Infinity's EAM-guided replacement: value = the closest past request's likelihood for the expert (on
    the layers run so far, this one included), ties broken by the request's own counts; a missed expert is
    admitted when it outranks the least valuable resident one. `capacity`: past requests kept (the EAMC)."""

    def __init__(self, info: LayerInfo, request: RequestActivations | None = None, capacity: int = 1000) -> None:
        super().__init__(info)
        self.predictor = _Predictor(info, request, capacity, "cache policy 'eam'")
        self.values = [0.0] * info.num_experts

    def observe(self, counts: Sequence[int], scores: Sequence[float]) -> bool:
        own = self.predictor.request.matrix[self.predictor.row]
        self.values = (self.predictor.likelihood(self.predictor.row + 1) + 1e-9 * own).tolist()
        return True

    def value(self, expert: int) -> float:
        return self.values[expert]


@PREFETCHERS.register("eam")
class ActivationMatrixPrefetch:
    """MoE-Infinity's prefetch: this layer's `size` most likely experts under the closest past request, matched
    on the layers before this one (asked while the previous layer runs)."""

    def __init__(
        self, info: LayerInfo, request: RequestActivations | None = None, size: int = 2, capacity: int = 1000
    ) -> None:
        self.predictor = _Predictor(info, request, capacity, "prefetcher 'eam'")
        if size < 1:
            raise ValueError(f"prefetch size must be at least 1, got {size}")
        self.info, self.size = info, size

    def select(self, hidden: torch.Tensor, prev_topk_ids: torch.Tensor, resident: Sequence[bool]) -> list[int]:
        likely = self.predictor.likelihood(self.predictor.row).tolist()  # floats: the sort reads each many times
        ranked = sorted((e for e in range(self.info.num_experts) if likely[e] > 0), key=lambda e: (-likely[e], e))
        return ranked[: self.size]
