"""Expert Deferral (opt-in, approximate) against a hand-written float64 reference of the same computation."""

import copy
import math
import operator
import re

import pytest
import torch
import torch.nn.functional as F

import torch_hybrid_moe as thm
from torch_hybrid_moe.compile_passes import insert_expert_deferral, insert_prefetch, rewrite_experts_regions
from torch_hybrid_moe.compile_passes.expert_deferral import ExpertDeferralPatternError, find_residual_add
from torch_hybrid_moe.compile_passes.graph_utils import DISPATCH, DISPATCH_BEGIN, DISPATCH_END, calls
from torch_hybrid_moe.config import HybridMoEConfig
from torch_hybrid_moe.model_patches.base import is_patched
from torch_hybrid_moe.runtime import model_layers
from torch_hybrid_moe.runtime.graph_path import Part
from torch_hybrid_moe.tiny_models import tiny_model

from .conftest import patched_copy
from .test_graph_path import needs_kernel


def inputs(batch, length, seed=0):
    return torch.randint(3, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


def hand_experts(experts, hidden, ids, weights):
    """sum_j w_j * down_e (silu(gate_e x) * up_e x) over the given pairs, in float64, from the module's weights."""
    gate_up = experts.gate_up_proj.double()[ids]  # [T, K, 2I, H]
    down = experts.down_proj.double()[ids]  # [T, K, H, I]
    gate, up = (gate_up @ hidden.double()[:, None, :, None]).squeeze(-1).chunk(2, dim=-1)
    out = (down @ (F.silu(gate) * up)[..., None]).squeeze(-1)  # [T, K, H]
    return (weights.double()[..., None] * out).sum(1)


def deferral_reference(model, deferred):
    """A float64 copy of the unpatched model doing Expert Deferral by hand: each MoE layer's experts forward is
    replaced by `hand_experts` over its immediate pairs (all pairs at the last MoE layer); the deferred pairs'
    output is added by a hook to the output of the next MoE layer's decoder layer (i.e. after that layer's
    `residual + mlp` add, its last operation)."""
    ref = copy.deepcopy(model).double()
    layers = ref.model.layers
    moe = [i for i, layer in enumerate(layers) if hasattr(getattr(layer.mlp, "experts", None), "gate_up_proj")]
    pending = {}

    def experts_forward(idx, module):
        def forward(hidden, ids, weights):
            nxt = moe[moe.index(idx) + 1] if idx != moe[-1] else None
            n = deferred if nxt is not None else 0  # the last MoE layer never defers
            order = weights.argsort(dim=-1, descending=True, stable=True)
            ids, weights = ids.gather(-1, order), weights.gather(-1, order)
            keep = ids.shape[-1] - n
            if n:
                pending[nxt] = hand_experts(module, hidden, ids[:, keep:], weights[:, keep:])
            return hand_experts(module, hidden, ids[:, :keep], weights[:, :keep]).to(hidden.dtype)

        return forward

    def layer_hook(idx):
        def hook(module, args, output):
            if idx in pending:
                return output + pending.pop(idx).view_as(output)

        return hook

    for idx in moe:
        experts = layers[idx].mlp.experts
        experts.forward = experts_forward(idx, experts)  # none of transformers' experts code runs
        layers[idx].register_forward_hook(layer_hook(idx))
    return ref, moe


def rel_err(got, want):
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


# mixtral: top-2, every layer MoE; deepseek_v3: top-3, shared experts, layer 0 dense; qwen2_moe: top-3, shared
# expert, layer 1 dense *between* MoE layers 0 and 2 (so the deferral crosses a dense layer).
@pytest.mark.slow
@pytest.mark.parametrize("arch,deferred", [("mixtral", 1), ("deepseek_v3", 2), ("qwen2_moe", 1)])
def test_compiled_deferral_matches_hand_reference(reference_models, arch, deferred):
    base = reference_models[arch]
    ref, moe = deferral_reference(base, deferred)
    model = patched_copy(base, mode="expert_deferral", deferred_experts=deferred)
    compiled = torch.compile(model, backend="hybrid_moe", fullgraph=True)
    x = inputs(2, 9)
    with torch.no_grad():
        got = compiled(x).logits
        want = ref(x).logits
        exact = base(x).logits
    assert rel_err(got, want) < 1e-5
    assert rel_err(exact, want) > 1e-3, "deferral should change the logits"
    # each MoE layer but the last dispatches twice per forward (immediate, deferred), but counts one step
    steps = [layer.stats.steps for layer in model_layers(model).values()]
    assert steps == [1] * len(moe)


@pytest.mark.slow
@needs_kernel
def test_replay_safe_path_defers_on_its_own_task_buffers(reference_models):
    """The captured-step form (host functions called directly here): the deferred half is submitted to the CPU
    worker and finished after the next block, on task buffers of its own, with the same result."""
    base = reference_models["deepseek_v3"]
    ref, _ = deferral_reference(base, 1)
    model = patched_copy(base, expert_budget=0.25, device="cpu", mode="expert_deferral", deferred_experts=1)
    layers = list(model_layers(model).values())
    for layer in layers:
        layer.graph_mode = True
    compiled = torch.compile(model, backend="hybrid_moe", fullgraph=True)
    with torch.no_grad():
        for seed in range(3):
            x = inputs(2, 5, seed)
            assert rel_err(compiled(x).logits, ref(x).logits) < 1e-5
    tasks = {key[-1]: buf.task for key, buf in layers[0].graph_path()._buffers.items()}
    assert set(tasks) == {Part.LEADING, Part.BEHIND} and all(
        t.submits == t.syncs == t.runs == 3 for t in tasks.values()
    )
    assert {key[-1] for key in layers[1].graph_path()._buffers} == {Part.PLAIN}  # the last layer defers nothing
    assert [s.steps for s in thm.stats(model).values()] == [3, 3]  # the deferred half counts no step


def inductor_op_order(model, x):
    """The names of the hybrid_moe MoE ops in the order Inductor's generated code calls them (not the attention's)."""
    from torch._inductor.utils import run_and_get_code

    compiled = torch.compile(model, backend="hybrid_moe", fullgraph=True, dynamic=False)
    with torch.no_grad():
        _, codes = run_and_get_code(compiled, x)
    ops = re.findall(r"torch\.ops\.hybrid_moe\.(\w+)\.default\(", codes[0])
    return [op for op in ops if op not in ("decode_attention", "latent_attention")]


@pytest.mark.slow
def test_inductor_keeps_the_deferred_half_around_the_next_layer(reference_models):
    """Inductor schedules ops by data dependencies only; the begin's carried output and the end's `after` input
    keep the deferred CPU experts overlapping the next block in the generated code (without them Inductor
    moved the end up to the begin), and the prefetch for layer 2 comes before layer 1's dispatch."""
    model = patched_copy(reference_models["deepseek_v3"], mode="expert_deferral", deferred_experts=1)
    order = inductor_op_order(model, inputs(2, 1))
    assert order == ["prefetch", "dispatch_begin", "dispatch_end", "dispatch_begin", "dispatch", "dispatch_end"]


@pytest.mark.slow
def test_stock_model_defers_through_backend_options(reference_models):
    base = reference_models["deepseek_v3"]
    ref, _ = deferral_reference(base, 1)
    stock = copy.deepcopy(base)  # unpatched: pass 1 rewrites its grouped_mm regions, then the deferral pass runs
    compiled = torch.compile(
        stock, backend="hybrid_moe", fullgraph=True, options={"mode": "expert_deferral", "deferred_experts": 1}
    )
    x = inputs(2, 7)
    with torch.no_grad():
        assert rel_err(compiled(x).logits, ref(x).logits) < 1e-5
    assert [s.steps for s in thm.stats(stock).values()] == [1, 1]


def capture(model, x, passes):
    graphs = []

    def backend(gm, example_inputs):
        rewrite_experts_regions(gm, example_inputs, HybridMoEConfig())
        insert_prefetch(gm)
        passes(gm)
        gm.recompile()
        graphs.append(gm)
        return gm.forward

    out = torch.compile(model, backend=backend, fullgraph=True)(x)
    return graphs[0], out


@pytest.mark.slow
def test_zero_deferred_and_exact_mode_equal_unpatched(reference_models):
    base = reference_models["mixtral"]
    x = inputs(2, 5)
    with torch.no_grad():
        want = base(x).logits
        gm, got = capture(patched_copy(base), x, lambda gm: insert_expert_deferral(gm, deferred_experts=0))
        assert rel_err(got.logits, want) < 1e-5
        assert sum(calls(n, DISPATCH) for n in gm.graph.nodes) == 3  # no split
        gm, got = capture(patched_copy(base), x, lambda gm: insert_expert_deferral(gm))  # config: mode exact
        assert rel_err(got.logits, want) < 1e-5
        assert sum(calls(n, DISPATCH) for n in gm.graph.nodes) == 3


@pytest.mark.slow
def test_last_layer_never_defers_and_deferred_output_lands_after_next_residual_add(reference_models):
    model = patched_copy(reference_models["deepseek_v3"], mode="expert_deferral", deferred_experts=2)
    with torch.no_grad():
        gm, _ = capture(model, inputs(1, 4), lambda gm: None)
    first, last = [n for n in gm.graph.nodes if calls(n, DISPATCH)]
    handle, users = first.args[3], set(first.users)
    residual = find_residual_add(last)  # layer 2's residual + (routed + shared) add
    assert insert_expert_deferral(gm) == 1
    assert insert_expert_deferral(gm) == 0  # a split layer is not split again
    (final,) = [n for n in gm.graph.nodes if calls(n, DISPATCH)]
    lead, begin = [n for n in gm.graph.nodes if calls(n, DISPATCH_BEGIN)]
    immediate, end = [n for n in gm.graph.nodes if calls(n, DISPATCH_END)]
    # the immediate half: a whole step begun and ended at once, which leaves its slot fills to the deferred half
    assert immediate.args[0].args == (lead, 0) and lead.args[4] == immediate.args[3] == Part.LEADING
    assert lead.args[3] == begin.args[3] == end.args[2] == handle and final is last
    assert end.args[0].args == (begin, 0) and begin.args[4] == end.args[3] == Part.BEHIND  # its own task buffers
    # pinned by data: the immediate output passes through the begin, and the end reads the next residual add
    assert set(immediate.users) == {begin} and begin.args[5] is immediate and end.args[4] is residual
    (carried,) = [u for u in begin.users if u.args == (begin, 1)]
    assert users == set(carried.users)  # what read the whole dispatch now reads the immediate output passed through
    shape = lambda n: n.meta["example_value"].shape[-1] if "example_value" in n.meta else None  # noqa: E731
    assert final.args[2] is last.args[2] and shape(last.args[2]) == 3  # the last layer keeps all 3 experts
    # begun right after the immediate half, finished once the next block is done: the deferred experts overlap it
    order = list(gm.graph.nodes)
    assert order.index(immediate) < order.index(begin) < order.index(final) < order.index(residual) < order.index(end)
    # the deferred output is added to layer 2's residual add, and every former user of that add sees the sum
    (view,) = end.users
    (total,) = view.users
    assert total.target is operator.add and total.args == (residual, view)
    assert set(residual.users) == {end, view, total}


@pytest.mark.slow
def test_pattern_not_found_fails_loudly_and_leaves_the_graph_alone(reference_models):
    model = patched_copy(reference_models["mixtral"], mode="expert_deferral", deferred_experts=1)
    with torch.no_grad():
        gm, _ = capture(model, inputs(1, 4), lambda gm: None)
    residual = find_residual_add([n for n in gm.graph.nodes if calls(n, DISPATCH)][1])
    residual.target = operator.sub  # layer 1's block output no longer leaves through an add
    before = str(gm.graph)
    with pytest.raises(ExpertDeferralPatternError, match="exactly one add in decoder layer"):
        insert_expert_deferral(gm)
    assert str(gm.graph) == before


def test_config_validation():
    for bad, match in [
        (dict(mode="skip"), "mode must be one of"),
        (dict(mode="expert_deferral"), "needs deferred_experts >= 1"),
        (dict(mode="expert_deferral", deferred_experts=-1), "needs deferred_experts >= 1"),
        (dict(deferred_experts=2), "needs mode='expert_deferral'"),
    ]:
        with pytest.raises(ValueError, match=match):
            HybridMoEConfig(**bad)
    with pytest.raises(TypeError, match="deferred_experts must be an int"):
        HybridMoEConfig(mode="expert_deferral", deferred_experts=1.0)
    # at patch time against the model's top-k (mixtral tiny: top-2, so only 1 can be deferred); model untouched
    model = tiny_model("mixtral")
    with pytest.raises(ValueError, match=r"\[1, top_k - 1\] = \[1, 1\] .* top_k = 2 experts, got 2"):
        thm.patch_model(model, mode="expert_deferral", deferred_experts=2)
    assert not is_patched(model) and all(hasattr(layer.mlp.experts, "gate_up_proj") for layer in model.model.layers)


@pytest.mark.slow
def test_perplexity_cost_on_embedded_model(capsys):
    """`hybrid-moe eval-ppl --mode expert_deferral` on deepseek-tiny (top-4; default 2 immediate + 2 deferred)."""
    from torch_hybrid_moe.cli import main

    assert main(["eval-ppl", "--model", "deepseek-tiny", "--max-tokens", "2048", "--mode", "expert_deferral"]) == 0
    out = capsys.readouterr().out
    assert "2 immediate + 2 deferred" in out
    line = [line for line in out.splitlines() if line.startswith("perplexity:")][0]
    exact, deferred = float(line.split()[2]), float(line.split()[4])
    with capsys.disabled():
        print(
            f"\ndeepseek-tiny, 2048 held-out tokens: exact {exact:.4f}, deferral 2+2 {deferred:.4f} "
            f"({deferred / exact - 1:+.2%})"
        )
    assert math.isfinite(deferred) and exact < deferred < 1.1 * exact
    assert main(["eval-ppl", "--model", "deepseek-tiny", "--mode", "expert_deferral", "--deferred-experts", "4"]) == 2
    assert re.search(r"\[1, 3\] .* top_k = 4 experts, got 4", capsys.readouterr().err)
