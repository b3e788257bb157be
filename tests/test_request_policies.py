"""MoE-Infinity's EAM matching and policies, DAOP's per-sequence allocation and static placement, against
brute force and hand-worked sequences."""

import random

import numpy as np
import pytest
import torch

from torch_hybrid_moe.policies import CACHE_POLICIES, PREFETCHERS, LayerInfo
from torch_hybrid_moe.policies.activation_matrices import closest_request
from torch_hybrid_moe.policies.requests import RequestActivations


def brute_force_closest(current, collection, observed):
    """float64 numpy cosine over the first `observed` rows; ties go to the newest entry."""
    now = np.asarray(current[:observed], dtype=np.float64).ravel()
    best, where = -np.inf, None
    for i, m in enumerate(collection):
        past = np.asarray(m[:observed], dtype=np.float64).ravel()
        cos = past @ now / (np.linalg.norm(past) * np.linalg.norm(now))
        if cos >= best - 1e-15:
            best, where = max(best, cos), i
    return where


@pytest.mark.parametrize("seed", range(10))
def test_matching_equals_brute_force_cosine_on_the_observed_layers(seed):
    rng = np.random.default_rng(seed)
    collection = [torch.tensor(rng.poisson(1.0, (4, 8)) + 0.0) for _ in range(12)]
    current = torch.tensor(rng.poisson(1.0, (4, 8)) + 0.0)
    for observed in (1, 2, 4):
        assert closest_request(current, collection, observed) == brute_force_closest(current, collection, observed)


def test_matching_uses_the_observed_layers_not_the_others():
    """The released code's mask is inverted, so it always returns entry 0. Here entry 1 equals the current
    request on layer 0 (the only one observed) while entry 0 equals it on the layer not yet run."""
    current = torch.tensor([[3.0, 0, 1], [0, 0, 0]])
    collection = [torch.tensor([[0.0, 3, 0], [0, 0, 0]]), torch.tensor([[3.0, 0, 1], [5, 5, 5]])]
    assert closest_request(current, collection, observed=1) == 1
    assert closest_request(current, [], observed=1) is None and closest_request(current * 0, collection, 1) is None


def test_eam_cache_and_prefetch_follow_the_matched_request_by_hand():
    """Two past requests over layers 0 and 1 (3 experts each). R0 used e0 on layer 0 and then e2 on layer 1;
    R1 used e1 and then e0. The request in flight routes to e1 on layer 0, so it matches R1 (cosine 1 vs 0): the
    prefetcher for layer 1 names e0, R1's layer-1 expert. Layer 1 then routes to e1 and e2 (cosines over both
    layers: R0 0.29, R1 0.58, still R1), so its cache ranks e0 (likelihood 1) above e1 and e2, which only break
    ties by their own counts: e2 does not displace the resident e1."""
    past = [torch.tensor([[4.0, 0, 0], [0, 0, 4]]), torch.tensor([[0.0, 4, 0], [4, 0, 0]])]
    request = RequestActivations([0, 1], 3, history=past)
    info1 = LayerInfo(1, 3, 1, 1)
    prefetch = PREFETCHERS.create("eam", info=info1, request=request, size=1)
    cache = CACHE_POLICIES.create("eam", info=info1, request=request)
    request.begin()
    request.record(0, [0, 2, 0])
    assert prefetch.select(torch.zeros(0, 1), torch.zeros(0, 1), [False] * 3) == [0]
    request.record(1, [0, 1, 1])
    assert cache.admit([0, 1, 1], [False, True, False], [0.0] * 3) == []
    assert cache.value(0) == pytest.approx(1.0) and cache.value(1) == cache.value(2) < 1e-8
    with pytest.raises(ValueError, match="request"):
        CACHE_POLICIES.create("eam", info=info1)


def test_daop_allocates_from_prefill_and_swaps_only_past_the_threshold():
    """Two slots. The prefill routes e2 50 and e3 100 tokens: both come in. In decode e1 reaches 52 tokens,
    1.04x the coldest resident's 50: no swap; at 53 (1.06x) it swaps in for e2. A new request re-allocates."""
    request = RequestActivations([0], 4)
    daop = CACHE_POLICIES.create("daop", info=LayerInfo(0, 4, 2, 1), request=request)
    slots = [0, 1]

    def step(counts):
        request.record(0, counts)
        admitted = daop.admit(counts, [e in slots for e in range(4)], [0.0] * 4)
        for e in admitted:
            slots[daop.victim(slots, set(admitted))] = e
        return admitted

    request.begin()
    assert step([1, 0, 50, 100]) == [3, 2] and sorted(slots) == [2, 3]
    assert step([0, 52, 0, 0]) == []
    assert step([0, 1, 0, 0]) == [1] and sorted(slots) == [1, 3]
    request.begin()
    assert step([7, 0, 5, 0]) == [0, 2] and sorted(slots) == [0, 2]
    with pytest.raises(ValueError, match="swap_threshold"):
        CACHE_POLICIES.create("daop", info=LayerInfo(0, 4, 2, 1), request=request, swap_threshold=0.9)


def test_static_placement_pins_the_calibration_favourites():
    rng = random.Random(0)
    popularity = [5, 9, 1, 9, 0, 7]
    static = CACHE_POLICIES.create("static", info=LayerInfo(0, 6, 3, 1), popularity=popularity)
    slots = [0, 4, 5]
    admitted = static.admit([1] * 6, [e in slots for e in range(6)], [0.0] * 6)
    for e in admitted:
        slots[static.victim(slots, set(admitted))] = e
    assert sorted(slots) == [1, 3, 5]  # 9, 9, 7
    for _ in range(20):
        counts = [rng.choice([0, 3]) for _ in range(6)]
        assert static.admit(counts, [e in slots for e in range(6)], [0.0] * 6) == []
    with pytest.raises(ValueError, match="popularity"):
        CACHE_POLICIES.create("static", info=LayerInfo(0, 6, 3, 1))


@pytest.mark.parametrize("name", ["eam", "daop", "static"])
def test_simulator_only_policies_are_refused_live_before_any_change(reference_models, name):
    import copy

    from torch_hybrid_moe import patch_model
    from torch_hybrid_moe.model_patches.base import is_patched

    model = copy.deepcopy(reference_models["mixtral"])
    with pytest.raises(ValueError, match="simulator"):
        patch_model(model, cache_policy=name, expert_budget=0.5)
    assert not is_patched(model)
