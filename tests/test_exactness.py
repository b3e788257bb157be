"""Patched and compiled models against the unpatched eager transformers model, all five architectures."""

import copy

import pytest
import torch

import torch_hybrid_moe as thm
from torch_hybrid_moe.tiny_models import TINY_ARCHITECTURES, tiny_model

from .conftest import patched_copy

# (batch, prompt length). Eager dispatch sees every shape; the compiled model sees shapes that share one
# dynamic graph (sizes 1 would each specialise a new graph); compiled batch 1 and length 1 are the
# decode steps of test_generate.
SHAPES = [(1, 1), (1, 17), (4, 1), (3, 64)]
COMPILED_SHAPES = [(2, 17), (4, 64), (3, 5)]


def inputs(batch, length, seed=0):
    g = torch.Generator().manual_seed(seed + 100 * batch + length)
    return torch.randint(3, 96, (batch, length), generator=g)


def assert_logits_close(got, want, rel=1e-5):
    err = (got.double() - want.double()).abs().max() / want.double().abs().max()
    assert err <= rel, f"relative error {err:.3g} > {rel}"


@pytest.mark.parametrize("budget", [0.0, pytest.param(0.25, marks=pytest.mark.slow), 1.0])
@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_patched_matches_reference(reference_models, arch, budget):
    """Eager at every budget, and compiled at 0.25: the compiled graph calls the same dispatch op whatever the
    budget (only the op's run-time placement differs, which the eager runs cover), and each compile costs
    half a minute here."""
    ref = reference_models[arch]
    model = patched_copy(ref, expert_budget=budget)
    with torch.no_grad():
        for batch, length in SHAPES:
            x = inputs(batch, length)
            assert_logits_close(model(x).logits, ref(x).logits)
        if budget == 0.25:
            compiled = torch.compile(model, backend="hybrid_moe", fullgraph=True, dynamic=True)
            for batch, length in COMPILED_SHAPES:
                x = inputs(batch, length)
                assert_logits_close(compiled(x).logits, ref(x).logits)
    layer_stats = thm.stats(model)
    assert layer_stats, "no hybrid layers found"
    for s in layer_stats.values():
        if budget == 0.0:
            assert s.accelerator_experts == 0 and s.cpu_experts > 0
        elif budget == 1.0:
            assert s.cpu_experts == 0 and s.accelerator_experts > 0
        else:
            assert s.cpu_experts > 0 and s.accelerator_experts > 0


@pytest.mark.slow
@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_stock_model_compiled_with_backend_matches_reference(reference_models, arch):
    ref = reference_models[arch]
    stock = copy.deepcopy(ref)
    compiled = torch.compile(stock, backend="hybrid_moe", fullgraph=True, dynamic=True)
    with torch.no_grad():
        for batch, length in COMPILED_SHAPES:
            x = inputs(batch, length)
            assert_logits_close(compiled(x).logits, ref(x).logits)
    layer_stats = thm.stats(stock)
    moe_layers = sum(1 for m in ref.modules() if hasattr(m, "gate_up_proj"))
    assert len(layer_stats) == moe_layers, "backend did not rewrite every experts region"
    assert all(s.cpu_experts > 0 for s in layer_stats.values())  # default budget 0.25 splits the work


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_tiny_models_experts_decide_their_tokens(arch):
    """The tests' token comparisons can see a broken expert: with every routed expert zeroed, most of a tiny model's
    20 greedy tokens change (at transformers' default init 0-2 of them did)."""
    model = tiny_model(arch)
    x = inputs(2, 6)
    want = model.generate(x, max_new_tokens=10, do_sample=False)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                param.zero_()
    changed = int((model.generate(x, max_new_tokens=10, do_sample=False) != want).sum())
    assert changed >= 10, changed


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_bf16_within_bf16_rounding(arch):
    """Our bf16 error against the fp32 model is of the order of transformers' own bf16 error, position by position
    (a maximum over positions would be one routing flip's: both reach 30-45% somewhere on these models)."""
    fp32 = tiny_model(arch)
    ref16 = tiny_model(arch, dtype=torch.bfloat16)
    model = thm.patch_model(tiny_model(arch, dtype=torch.bfloat16), expert_budget=0.25)
    compiled = torch.compile(model, backend="hybrid_moe", fullgraph=True, dynamic=True)
    with torch.no_grad():
        for batch, length in [(2, 9), (3, 33)]:
            x = inputs(batch, length)
            exact = fp32(x).logits.double()
            ours = compiled(x).logits.double()
            theirs = ref16(x).logits.double()
            scale = exact.abs().max()
            ours_err, theirs_err = ((m - exact).abs().amax(-1) / scale for m in (ours, theirs))  # per position
            # bf16's rounding alike; where a router's scores nearly tie, bf16 may pick another expert there
            assert ours_err.median() <= 2 * theirs_err.median() + 2**-10
            assert (ours_err > 2**-4).float().mean() <= 0.1


@pytest.mark.parametrize("budget", [0.0, 0.5])
def test_experts_stored_non_contiguous_patch_and_match_reference(reference_models, budget):
    """Expert weights that are views (transposed storage, as some loaders leave them): the store keeps a contiguous
    copy where the kernels need one, and the patched model computes what the reference does."""
    ref = reference_models["mixtral"]
    model = copy.deepcopy(ref)
    for layer in model.model.layers:
        experts = layer.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(experts, name)
            strided = weight.detach().transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
            setattr(experts, name, torch.nn.Parameter(strided, requires_grad=False))
    assert not model.model.layers[0].mlp.experts.gate_up_proj.is_contiguous()
    thm.patch_model(model, expert_budget=budget, device="cpu")
    x = inputs(2, 9)
    with torch.no_grad():
        assert_logits_close(model(x).logits, ref(x).logits)
