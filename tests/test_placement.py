"""Slot contents and counters follow the LRU policy exactly (checked against an independent simulation)."""

import copy

import torch

import torch_hybrid_moe as thm
from torch_hybrid_moe.runtime import model_layers

from .conftest import patched_copy


def simulate_lru(routings, num_experts, num_slots):
    """Brute-force LRU over whole steps: slots start with experts 0..S-1; misses enter, hottest first."""
    slots = list(range(num_slots))
    last = dict.fromkeys(range(num_experts), -1)
    hits = misses = loads = 0
    for clock, ids in enumerate(routings, start=1):
        counts = torch.bincount(ids.reshape(-1), minlength=num_experts).tolist()
        active = [e for e in range(num_experts) if counts[e]]
        hits += sum(e in slots for e in active)
        misses += sum(e not in slots for e in active)
        for e in active:
            last[e] = clock
        missing = sorted((e for e in active if e not in slots), key=lambda e: -counts[e])[:num_slots]
        admitted = set()
        for e in missing:
            admitted.add(e)
            candidates = [s for s in range(num_slots) if slots[s] not in admitted]
            victim = min(candidates, key=lambda s: last[slots[s]])
            slots[victim] = e
            loads += 1
    return hits, misses, loads, sorted(slots)


def test_lru_slots_and_counters_match_simulation(reference_models):
    model = patched_copy(reference_models["mixtral"], expert_budget=0.5)
    routings = {idx: [] for idx in model_layers(model)}

    def record(idx):
        def hook(module, args):
            routings[idx].append(args[1].clone())

        return hook

    for idx, layer in enumerate(model.model.layers):
        layer.mlp.experts.register_forward_pre_hook(record(idx))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for step in range(12):
            model(torch.randint(3, 96, (1, 1 + step % 3), generator=g))
    for idx, layer in model_layers(model).items():
        hits, misses, loads, slots = simulate_lru(routings[idx], 6, 3)
        s = layer.stats
        assert (s.hits, s.misses) == (hits, misses)
        assert s.bytes_transferred == loads * layer.store.expert_bytes
        assert sorted(layer.store.slot_experts) == slots
        # every slot really holds the master weights of the expert it claims
        for slot, expert in enumerate(layer.store.slot_experts):
            assert torch.equal(layer.store.slot_gate_up[slot], layer.store.host_gate_up[expert])
            assert torch.equal(layer.store.slot_down[slot], layer.store.host_down[expert])


def test_reset_stats(reference_models):
    model = patched_copy(reference_models["qwen3_moe"])
    with torch.no_grad():
        model(torch.randint(3, 96, (2, 5)))
    assert all(s.tokens == 10 for s in thm.stats(model).values())
    thm.reset_stats(model)
    assert all(s.tokens == 0 and s.hits == 0 and s.bytes_transferred == 0 for s in thm.stats(model).values())


def test_patching_on_cpu_keeps_one_copy_of_experts(reference_models):
    """The host master is the original storage: patching adds only the slots, never a second full copy."""
    ref = copy.deepcopy(reference_models["deepseek_v2"])
    original = {
        idx: blk.mlp.experts.gate_up_proj.data_ptr()
        for idx, blk in enumerate(ref.model.layers)
        if hasattr(blk.mlp, "experts")
    }
    thm.patch_model(ref, expert_budget=0.25)
    for idx, layer in model_layers(ref).items():
        assert layer.store.host_gate_up.data_ptr() == original[idx]
        assert layer.store.num_slots == 2  # floor(0.25 * 8)
    names = [name for name, _ in ref.named_parameters()]
    assert not any(n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")) for n in names)
    assert any(n.endswith("mlp.shared_experts.down_proj.weight") for n in names)  # shared experts stay
