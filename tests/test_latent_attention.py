"""DeepSeek's latent attention with the up-projection absorbed (model_patches/latent_attention.py) against the
expanded form in float64, and patched models' decode steps against the unpatched model."""

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from torch_hybrid_moe.model_patches import cpu_attention
from torch_hybrid_moe.model_patches.cpu_attention import NAME
from torch_hybrid_moe.model_patches.latent_attention import UP_K, UP_V, absorb, absorbed_attention, expanded
from torch_hybrid_moe.tiny_models import random_model, tiny_config, tiny_model

from .conftest import patched_copy
from .test_exactness import assert_logits_close

MLA = ("deepseek_v2", "deepseek_v3")


def latent_module(arch):
    """Layer 0's attention of a float64 tiny model, made to absorb."""
    module = tiny_model(arch, dtype=torch.float64).model.layers[0].self_attn
    absorb(module, NAME)
    return module


def cached(module, batch, positions, seed=0):
    """A query [B, H, 1, nope + rot], a cached latent [B, 1, T, r] and rotary keys [B, 1, T, rot] in float64."""
    g = torch.Generator().manual_seed(seed)
    heads = getattr(module, UP_V).shape[0]
    rot = module.qk_rope_head_dim
    query = torch.randn(batch, heads, 1, module.qk_nope_head_dim + rot, generator=g, dtype=torch.float64)
    latent = torch.randn(batch, 1, positions, module.kv_lora_rank, generator=g, dtype=torch.float64)
    return query, latent, torch.randn(batch, 1, positions, rot, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("arch", MLA)
def test_one_query_matches_the_expanded_form_in_float64(arch, batch, mask_kind):
    module = latent_module(arch)
    query, latent, k_rot = cached(module, batch, positions=9)
    g = torch.Generator().manual_seed(1)
    mask = {
        "none": None,
        "bool": torch.rand(batch, 1, 1, 9, generator=g) > 0.3,
        "additive": torch.randn(batch, 1, 1, 9, generator=g, dtype=torch.float64),
    }[mask_kind]
    if mask is not None and mask.dtype == torch.bool:
        mask[..., -1] = True  # the step's own position
    key, value = expanded(module, latent, k_rot)
    want = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=module.scaling).transpose(1, 2)
    got, weights = absorbed_attention(module, query, latent, k_rot, mask, module.scaling)
    assert weights is None and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_query_that_sees_nothing_is_zero_and_prompts_are_left_to_the_caller():
    module = latent_module("deepseek_v2")
    query, latent, k_rot = cached(module, 2, positions=4)
    mask = torch.ones(2, 1, 1, 4, dtype=torch.bool)
    mask[1] = False
    out, _ = absorbed_attention(module, query, latent, k_rot, mask, None)
    assert bool((out[1] == 0).all()) and bool(out[0].isfinite().all()) and bool((out[0] != 0).any())
    prompt = torch.cat([query, query], dim=2)
    assert absorbed_attention(module, prompt, latent, k_rot, None, None) is None


def decode_logits(model, prompt, steps):
    """Last logits of the prompt's forward and of `steps` greedy decode steps, each through a DynamicCache."""
    cache, out, x = DynamicCache(config=model.config), [], prompt
    with torch.no_grad():
        for _ in range(steps + 1):
            logits = model(x, past_key_values=cache, use_cache=True).logits[:, -1]
            out.append(logits)
            x = logits.argmax(-1, keepdim=True)
    return out


@pytest.mark.parametrize("arch", MLA)
def test_patched_decode_steps_absorb_and_match_the_model(arch, monkeypatch):
    """Every decode step of a patched MLA model takes the absorbed form (a prompt the expanded one) and gives the
    unpatched model's logits; switched to SDPA afterwards, it expands again and still does."""
    taken = []

    def spy(*args):
        out = absorbed_attention(*args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(cpu_attention, "absorbed_attention", spy)
    ref = tiny_model(arch)
    model = patched_copy(ref, expert_budget=0.0)
    prompt = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    want = decode_logits(ref, prompt, steps=4)
    got = decode_logits(model, prompt, steps=4)
    layers = ref.config.num_hidden_layers
    assert taken == [False] * layers + [True] * 4 * layers
    for g, w in zip(got, want):
        assert_logits_close(g, w)
    taken.clear()
    model.config._attn_implementation = "sdpa"
    for g, w in zip(decode_logits(model, prompt, steps=2), want):
        assert_logits_close(g, w)
    assert taken == []


def test_a_quantised_up_projection_is_absorbed_dequantised():
    """Dense int8 mode: the absorbed up-projection is kv_b_proj's int8 weight dequantised, and decode steps stay
    near the unpatched model (int8's error, not a wrong weight)."""
    config = tiny_config("deepseek_v2")
    config.kv_lora_rank = config.moe_intermediate_size = 32  # every dense linear's columns in groups of 32
    ref = random_model(config)
    model = patched_copy(ref, expert_budget=0.0, dense_weight_dtype="int8", dense_weight_group_size=32)
    module = model.model.layers[0].self_attn
    want = ref.model.layers[0].self_attn.kv_b_proj.weight
    got = torch.cat([getattr(module, UP_K).transpose(1, 2), getattr(module, UP_V)], dim=1).flatten(0, 1)
    assert got.shape == want.shape and float((got - want).abs().max()) <= float(want.abs().max()) / 100
    prompt = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(1))
    for g, w in zip(decode_logits(model, prompt, steps=3), decode_logits(ref, prompt, steps=3)):
        assert_logits_close(g, w, rel=0.05)


def test_a_model_dtype_up_projection_copies_only_its_key_rows():
    """In model dtype the value rows stay a view of kv_b_proj's weight (no second copy of them) and the key rows are
    one contiguous copy, transposed per head."""
    module = latent_module("deepseek_v2")
    weight = module.kv_b_proj.weight
    up_k, up_v = getattr(module, UP_K), getattr(module, UP_V)
    assert up_v.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    assert up_k.is_contiguous() and up_k.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
    per_head = weight.unflatten(0, (up_k.shape[0], -1))
    assert torch.equal(up_k, per_head[:, : module.qk_nope_head_dim].transpose(1, 2))
    assert torch.equal(up_v, per_head[:, module.qk_nope_head_dim :])
