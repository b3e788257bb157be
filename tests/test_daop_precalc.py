"""DAOP's decode mode (opt-in, approximate) against a hand-written float64 reference of the same computation."""

import copy

import pytest
import torch

import torch_hybrid_moe as thm
from torch_hybrid_moe.compile_passes import insert_daop_precalc, insert_prefetch, rewrite_experts_regions
from torch_hybrid_moe.compile_passes.daop_precalc import (
    DaopPrecalcPatternError,
    degrade,
    precalc_stats,
)
from torch_hybrid_moe.compile_passes.graph_utils import DISPATCH, DISPATCH_BEGIN, DISPATCH_END, calls
from torch_hybrid_moe.config import HybridMoEConfig
from torch_hybrid_moe.embedded import load_model
from torch_hybrid_moe.model_patches.base import is_patched
from torch_hybrid_moe.runtime import model_layers
from torch_hybrid_moe.runtime.graph_path import Part

from .conftest import patched_copy
from .test_expert_deferral import hand_experts, inductor_op_order, inputs, rel_err
from .test_graph_path import needs_kernel


@pytest.fixture(scope="module")
def deepseek_tiny():
    """The embedded trained model: DeepSeek-V3 routing (sigmoid, bias, 4 groups keep 2, top-4, renormalised,
    x2 scaling), layer 0 dense, MoE layers 1-3."""
    return load_model("deepseek-tiny")[0]


def hand_route(cfg, gate, x):
    """Top-k ids [T, K] and all scores [T, E] of a router, in float64, from its config and weights alone."""
    logits = x.double() @ gate.weight.double().T
    if cfg.model_type == "mixtral":
        scores = logits.softmax(-1)
        return scores.topk(cfg.num_experts_per_tok, -1).indices, scores
    scores = logits.sigmoid()
    choice = scores + gate.e_score_correction_bias.double()
    groups = choice.view(len(x), cfg.n_group, -1)
    keep = groups.topk(2, -1).values.sum(-1).topk(cfg.topk_group, -1).indices
    mask = torch.zeros(len(x), cfg.n_group, dtype=torch.bool).scatter_(1, keep, True)
    choice = choice.masked_fill(~mask.repeat_interleave(groups.shape[2], 1), -torch.inf)
    return choice.topk(cfg.num_experts_per_tok, -1).indices, scores


def hand_weights(cfg, scores, ids):
    w = scores.gather(1, ids)
    if cfg.model_type == "mixtral" or cfg.norm_topk_prob:
        w = w / w.sum(1, keepdim=True)
    return w * getattr(cfg, "routed_scaling_factor", 1.0)


def hand_degrade(ids, scores, resident):
    """Per token: keep the best-scored CPU expert; swap each further one, lowest first, for the best-scored
    resident expert not selected, while any is left."""
    out = []
    for row, s in zip(ids.tolist(), scores):
        cpu = sorted((e for e in row if e not in resident), key=lambda e: s[e])  # lowest first
        alternatives = sorted((e for e in resident if e not in row), key=lambda e: -s[e])
        n = max(0, min(len(cpu) - 1, len(alternatives)))
        out.append([e for e in row if e not in cpu[:n]] + alternatives[:n])
    return torch.tensor(out)


def daop_reference(model, start, residency):
    """A float64 copy of the unpatched model computing DAOP by hand: from MoE layer `start` on (not the first MoE
    layer), the block routes the previous MoE block's input, degrades against `residency` (decoder index -> set
    of resident experts), runs CPU experts on that earlier input and resident ones on its own, plus its shared
    experts on its own input. Earlier MoE layers route as the model does; no transformers experts code runs."""
    ref = copy.deepcopy(model).double()
    cfg = ref.config
    layers = ref.model.layers
    moe = [i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts")]
    seen = {}

    def block_forward(idx, block, prev):
        def forward(x_j):
            x_i = seen[prev].reshape(-1, x_j.shape[-1])
            ids, scores = hand_route(cfg, block.gate, x_i)
            ids = hand_degrade(ids, scores, residency[idx])
            w = hand_weights(cfg, scores, ids)
            on_gpu = torch.tensor([[e in residency[idx] for e in row] for row in ids.tolist()])
            flat = x_j.reshape(-1, x_j.shape[-1])
            out = hand_experts(block.experts, x_i, ids, w * ~on_gpu) + hand_experts(
                block.experts, flat, ids, w * on_gpu
            )
            shared = block.shared_experts(x_j) if hasattr(block, "shared_experts") else 0
            return out.view_as(x_j) + shared

        return forward

    for idx in moe:
        block = layers[idx].mlp
        block.register_forward_pre_hook(lambda m, args, idx=idx: seen.__setitem__(idx, args[0]))
        block.experts.forward = lambda h, ids, w, e=block.experts: hand_experts(e, h, ids, w)  # exact layers
        if idx >= start and idx != moe[0]:
            block.forward = block_forward(idx, block, moe[moe.index(idx) - 1])
    return ref


def residency(model):
    return {
        idx: {e for e, slot in enumerate(layer.store.expert_slot) if slot >= 0}
        for idx, layer in model_layers(model).items()
    }


def capture(model, x, count=None):
    """Run `model(x)` compiled through the backend's passes without Inductor; returns (graph, logits)."""
    graphs = []

    def backend(gm, example_inputs):
        rewrite_experts_regions(gm, example_inputs, HybridMoEConfig())
        insert_prefetch(gm)
        rewritten = insert_daop_precalc(gm)
        if count is not None:
            assert rewritten == count
        gm.recompile()
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        out = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)(x)
    return graphs[0], out.logits


def precalc_ops(gm):
    return sum(n.target is torch.ops.hybrid_moe.precalc_routing.default for n in gm.graph.nodes)


@pytest.mark.slow
@pytest.mark.parametrize("start,count", [(1, 2), (3, 1)])
def test_decode_step_matches_hand_reference(deepseek_tiny, start, count):
    model = patched_copy(deepseek_tiny, expert_budget=0.25, mode="daop_precalc", precalc_from_layer=start)
    x = inputs(6, 1, seed=start)  # a decode step of 6 sequences: one token each
    resident = residency(model)  # nothing fetches before the step's routing is decided
    _, got = capture(model, x, count)
    with torch.no_grad():
        want = daop_reference(deepseek_tiny, start, resident)(x).logits
        exact = deepseek_tiny(x).logits
    assert rel_err(got, want) < 1e-5
    assert rel_err(exact, want) > 1e-3, "DAOP should change the logits"
    counts = precalc_stats(model_layers(model))
    assert [idx for idx, c in counts.items() if c.pairs] == [i for i in (1, 2, 3) if i >= max(start, 2)]
    assert all(c.degraded for c in counts.values() if c.pairs)  # 8 of 32 resident, top-4: swaps happen


@pytest.mark.slow
def test_inductor_keeps_the_early_pairs_around_the_previous_and_own_dispatch(deepseek_tiny):
    model = patched_copy(deepseek_tiny, mode="daop_precalc", precalc_from_layer=3)
    # layers 1, 2 exact; layer 3's early pairs begun right after layer 2's dispatch, ended after its own (where
    # Inductor puts the prediction and the counters, which only feed those, is its choice)
    order = inductor_op_order(model, inputs(2, 1))
    assert [n for n in order if "precalc" not in n] == [
        "prefetch",
        "dispatch",
        "prefetch",
        "dispatch",
        "dispatch_begin",
        "dispatch",
        "dispatch_end",
    ]
    assert order.index("precalc_routing") < order.index("dispatch_begin")


@pytest.mark.slow
@needs_kernel
def test_replay_safe_path_matches_hand_reference(deepseek_tiny):
    """The captured-step form (host functions called directly here): the slot map is read from the device tables
    and the pairs on x_i run on the CPU worker from layer i's dispatch to layer j's."""
    model = patched_copy(deepseek_tiny, expert_budget=0.25, mode="daop_precalc", precalc_from_layer=1)
    layers = list(model_layers(model).values())
    resident = {}
    for idx, layer in model_layers(model).items():
        layer.graph_mode = True
        path = layer.graph_path()
        # move the device tables away from the store's map: 8 other experts in the 8 slots
        newcomers = [e for e, s in enumerate(layer.store.expert_slot) if s < 0][: layer.store.num_slots]
        path._fill(torch.tensor(newcomers), torch.arange(len(newcomers)))
        resident[idx] = {e for e, s in enumerate(path.expert_slot.tolist()) if s >= 0}
        assert resident[idx] == set(newcomers) != {e for e, s in enumerate(layer.store.expert_slot) if s >= 0}
    x = inputs(4, 1, seed=5)
    with torch.no_grad():
        got = torch.compile(model, backend="hybrid_moe", fullgraph=True, dynamic=False)(x).logits
        want = daop_reference(deepseek_tiny, 1, resident)(x).logits
    assert rel_err(got, want) < 1e-5
    counts = precalc_stats(model_layers(model))
    assert [idx for idx, c in counts.items() if c.pairs] == [2, 3] and all(c.early for c in counts.values() if c.pairs)
    for layer in layers[1:]:  # the pairs on x_i ran on their own task buffers
        (task,) = [buf.task for key, buf in layer.graph_path()._buffers.items() if key[-1] == Part.AHEAD]
        assert task.submits == task.syncs == task.runs == 1


@pytest.mark.slow
def test_mixtral_through_backend_matches_hand_reference(reference_models):
    base = reference_models["mixtral"]  # softmax, top-2, renormalised: the paper's setting
    model = patched_copy(base, expert_budget=0.5, mode="daop_precalc", precalc_from_layer=1)
    resident = residency(model)
    x = inputs(5, 1)
    with torch.no_grad():
        got = torch.compile(model, backend="hybrid_moe", fullgraph=True, dynamic=False)(x).logits
        want = daop_reference(base, 1, resident)(x).logits
    assert rel_err(got, want) < 1e-5 and rel_err(base(x).logits, want) > 1e-3


@pytest.mark.slow
def test_prefill_and_early_layers_stay_exact(deepseek_tiny):
    model = patched_copy(deepseek_tiny, mode="daop_precalc", precalc_from_layer=1)
    x = inputs(2, 5)
    gm, got = capture(model, x, count=0)  # more than one token per sequence: prefill, left alone
    with torch.no_grad():
        assert rel_err(got, deepseek_tiny(x).logits) < 1e-6
    assert precalc_ops(gm) == 0
    # the paper's default (decoder block 5 on) would approximate nothing in this 4-block model: refused; from 3
    # only block 3 changes
    x = inputs(3, 1)
    with pytest.raises(ValueError, match="precalc_from_layer=5 approximates nothing"):
        patched_copy(deepseek_tiny, mode="daop_precalc")
    gm, _ = capture(patched_copy(deepseek_tiny, mode="daop_precalc", precalc_from_layer=3), x, count=1)
    order = list(gm.graph.nodes)
    first, second, third = [n for n in order if calls(n, DISPATCH)]
    (begin,) = [n for n in order if calls(n, DISPATCH_BEGIN)]
    (end,) = [n for n in order if calls(n, DISPATCH_END)]
    (routed,) = [n for n in order if n.target is torch.ops.hybrid_moe.precalc_routing.default]
    # layer 3's routing is predicted before layer 2's dispatch, its pairs on x_2 start right after it and end
    # after layer 3's own dispatch, pinned there by data: layer 2's output passes through the begin, and the
    # end reads layer 3's dispatch
    assert begin.args[3] == end.args[2] == third.args[3] != second.args[3] and end.args[0].args == (begin, 0)
    assert order.index(routed) < order.index(second) < order.index(begin) < order.index(third) < order.index(end)
    assert begin.args[0] is second.args[0] and begin.args[5] is second and end.args[4] is third
    assert set(second.users) == {begin}


@pytest.mark.slow
@pytest.mark.parametrize("budget", [1.0, 0.0])
def test_degradation_needs_both_cpu_and_resident_experts(deepseek_tiny, budget):
    model = patched_copy(deepseek_tiny, expert_budget=budget, mode="daop_precalc", precalc_from_layer=1)
    _, got = capture(model, inputs(8, 1), count=2)
    counts = [c for c in precalc_stats(model_layers(model)).values() if c.pairs]
    assert len(counts) == 2 and all(c.pairs == 8 * 4 and c.degraded == 0 for c in counts)
    assert all(c.predicted_changed > 0 for c in counts)
    # all resident: everything runs on x_j; nothing resident: everything on x_i
    assert all(c.early == (0 if budget == 1.0 else c.pairs) for c in counts)


def test_degrade_rule_top3():
    scores = torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.5, 0.1], [0.9, 0.8, 0.7, 0.6, 0.5, 0.1]])
    ids = torch.tensor([[0, 1, 2], [0, 3, 4]])
    weights = torch.tensor([[0.9, 0.8, 0.7], [0.9, 0.6, 0.5]]) * 2 / torch.tensor([[2.4], [2.0]])  # renorm, x 2
    resident = torch.tensor([False, False, False, False, True, False])
    new_ids, new_w, swap = degrade(ids, weights, scores, resident, renormalise=True)
    # token 0: three CPU experts, one free resident expert (4): the lowest (2) is swapped, 1 stays on the CPU;
    # token 1: CPU experts 0 and 3, but the only resident expert is already chosen: the choice stays
    assert new_ids.tolist() == [[0, 1, 4], [0, 3, 4]]
    assert swap.tolist() == [[False, False, True], [False, False, False]]
    assert torch.allclose(new_w[0], torch.tensor([0.9, 0.8, 0.5]) * 2 / 2.2) and torch.equal(new_w[1], weights[1])
    # without renormalisation a replacement keeps the token's factor (here the x2 scaling)
    new_ids, new_w, _ = degrade(ids, scores.gather(1, ids) * 2, scores, resident, renormalise=False)
    assert torch.allclose(new_w, scores.gather(1, new_ids) * 2)
    kept, kept_w, swap = degrade(ids, weights, scores, torch.ones(6, dtype=torch.bool), renormalise=True)
    assert torch.equal(kept, ids) and torch.equal(kept_w, weights) and not swap.any()


def test_precalc_ops_pass_opcheck(deepseek_tiny):
    model = patched_copy(deepseek_tiny, expert_budget=0.25, mode="daop_precalc", precalc_from_layer=1)
    handle = model_layers(model)[2].handle
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 32, generator=g)
    ids = logits.topk(4, -1).indices
    weights = logits.sigmoid().gather(1, ids)
    torch.library.opcheck(torch.ops.hybrid_moe.precalc_routing.default, (ids, weights, logits, handle))
    column_major = (t.t().contiguous().t() for t in (ids, weights, logits))  # outputs row-major, as the fake's
    torch.library.opcheck(torch.ops.hybrid_moe.precalc_routing.default, (*column_major, handle))
    early, late, _, swapped = torch.ops.hybrid_moe.precalc_routing(ids, weights, logits, handle)
    assert ((early >= 0) ^ (late >= 0)).all()  # each pair computed by exactly one of the two dispatches
    torch.library.opcheck(torch.ops.hybrid_moe.precalc_account.default, (ids, ids, swapped, early, handle))


def test_precalc_ops_on_the_replay_safe_path_run_no_op_that_waits_for_the_device(deepseek_tiny):
    """The prediction's degradation reads the device slot tables and its counters stay on the device (the ops'
    own bodies, under the same spy as the layer step's test)."""
    from torch_hybrid_moe.compile_passes import daop_precalc

    from .test_graph_path import SYNCING, _SyncSpy

    model = patched_copy(deepseek_tiny, expert_budget=0.25, mode="daop_precalc", precalc_from_layer=1)
    layer = model_layers(model)[2]
    layer.graph_mode = True
    logits = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    ids = logits.topk(4, -1).indices
    weights = logits.sigmoid().gather(1, ids)
    spy = _SyncSpy()
    with spy:
        early, _, _, swapped = daop_precalc.precalc_routing._init_fn(ids, weights, logits, layer.handle)
        daop_precalc.precalc_account._init_fn(ids, ids, swapped, early, layer.handle)
    assert {"topk", "gather"} & spy.ops and not spy.ops & (SYNCING | {"bool-mask indexing"})
    assert layer.mode_counters[0] == ids.numel()


def test_config_validation_refuses_before_any_change(capsys):
    for bad, error, match in [
        (dict(mode="daop_precalc", precalc_from_layer=-1), ValueError, "decoder-block index >= 0"),
        (dict(mode="daop_precalc", precalc_from_layer=1.5), TypeError, "precalc_from_layer must be an int"),
        (dict(mode="daop_precalc", precalc_from_layer=True), TypeError, "precalc_from_layer must be an int"),
        (dict(precalc_from_layer=2), ValueError, "needs mode='daop_precalc'"),
        (
            dict(mode="expert_deferral", deferred_experts=1, precalc_from_layer=2),
            ValueError,
            "needs mode='daop_precalc'",
        ),
        (dict(mode="daop_precalc", deferred_experts=1), ValueError, "needs mode='expert_deferral'"),
        (dict(mode="daop_precalc", prefetcher="gate"), ValueError, "use prefetcher='none'"),
    ]:
        with pytest.raises(error, match=match):
            HybridMoEConfig(**bad)
    model = load_model("mixtral-tiny")[0]
    with pytest.raises(ValueError, match="decoder-block index"):
        thm.patch_model(model, mode="daop_precalc", precalc_from_layer=-2)
    assert not is_patched(model) and all(hasattr(layer.mlp.experts, "gate_up_proj") for layer in model.model.layers)
    from torch_hybrid_moe.cli import main

    assert main(["eval-ppl", "--model", "mixtral-tiny", "--precalc-from-layer", "1"]) == 2
    assert "--precalc-from-layer needs --mode daop_precalc" in capsys.readouterr().err
    assert main(["eval-ppl", "--model", "mixtral-tiny", "--mode", "daop_precalc", "--precalc-from-layer", "-1"]) == 2
    assert "--precalc-from-layer: precalc_from_layer must be a decoder-block index" in capsys.readouterr().err


def test_unpatched_layers_are_refused_and_the_graph_left_alone(reference_models):
    stock = copy.deepcopy(reference_models["mixtral"])  # the backend would rewrite it without a routing rule
    graphs = []

    def backend(gm, example_inputs):
        rewrite_experts_regions(gm, example_inputs, HybridMoEConfig(mode="daop_precalc", precalc_from_layer=1))
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        torch.compile(stock, backend=backend, fullgraph=True, dynamic=False)(inputs(2, 1))
    gm = graphs[0]
    before = str(gm.graph)
    with pytest.raises(DaopPrecalcPatternError, match="no routing rule"):
        insert_daop_precalc(gm)
    assert str(gm.graph) == before
