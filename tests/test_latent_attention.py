"""DeepSeek's latent attention with the up-projection absorbed (model_patches/latent_attention.py) against the
expanded form in float64, and patched models' decode steps against the unpatched model."""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from torch_hybrid_moe.model_patches import cpu_attention
from torch_hybrid_moe.model_patches.cpu_attention import NAME
from torch_hybrid_moe.model_patches.latent_attention import (
    UP_K,
    UP_K_SCALE,
    UP_V,
    UP_V_SCALE,
    absorb,
    absorbed_attention,
    expanded,
)
from torch_hybrid_moe.ops.kernel_build import best_isa
from torch_hybrid_moe.ops.latent_attention import laid_out_rows
from torch_hybrid_moe.ops.quantize import QuantizedWeight, dequantize
from torch_hybrid_moe.tiny_models import random_model, tiny_config, tiny_model

from .conftest import patched_copy
from .test_exactness import assert_logits_close

MLA = ("deepseek_v2", "deepseek_v3")


def latent_modules(arch):
    """Layer 0's attention of an fp32 tiny model, made to absorb, and a float64 copy of it that expands."""
    module = tiny_model(arch, dtype=torch.float32).model.layers[0].self_attn
    reference = copy.deepcopy(module).double()
    absorb(module, NAME)
    return module, reference


def cached(module, batch, positions, seed=0):
    """A query [B, H, 1, nope + rot], a cached latent [B, 1, T, r] and rotary keys [B, 1, T, rot] in fp32."""
    g = torch.Generator().manual_seed(seed)
    heads = getattr(module, UP_V).shape[0]
    rot = module.qk_rope_head_dim
    query = torch.randn(batch, heads, 1, module.qk_nope_head_dim + rot, generator=g)
    latent = torch.randn(batch, 1, positions, module.kv_lora_rank, generator=g)
    return query, latent, torch.randn(batch, 1, positions, rot, generator=g)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("arch", MLA)
def test_one_query_matches_the_expanded_form_in_float64(arch, batch, mask_kind):
    module, reference = latent_modules(arch)
    query, latent, k_rot = cached(module, batch, positions=9)
    g = torch.Generator().manual_seed(1)
    mask = {
        "none": None,
        "bool": torch.rand(batch, 1, 1, 9, generator=g) > 0.3,
        "additive": torch.randn(batch, 1, 1, 9, generator=g),
    }[mask_kind]
    if mask is not None and mask.dtype == torch.bool:
        mask[..., -1] = True  # the step's own position
    key, value = expanded(reference, latent.double(), k_rot.double())
    ref_mask = mask if mask is None or mask.dtype == torch.bool else mask.double()
    scaling = module.scaling * 0.7  # the caller's, not the head width's
    want = F.scaled_dot_product_attention(query.double(), key, value, attn_mask=ref_mask, scale=scaling)
    got, weights = absorbed_attention(module, query, latent, k_rot, mask, scaling)
    assert weights is None and got.shape == want.transpose(1, 2).shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want.transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_a_query_that_sees_nothing_is_zero_and_prompts_are_left_to_the_caller():
    module, _ = latent_modules("deepseek_v2")
    query, latent, k_rot = cached(module, 2, positions=4)
    mask = torch.ones(2, 1, 1, 4, dtype=torch.bool)
    mask[1] = False
    out, _ = absorbed_attention(module, query, latent, k_rot, mask, None)
    assert bool((out[1] == 0).all()) and bool(out[0].isfinite().all()) and bool((out[0] != 0).any())
    prompt = torch.cat([query, query], dim=2)
    assert absorbed_attention(module, prompt, latent, k_rot, None, None) is None


def decode_logits(model, prompt, steps, fed=None):
    """Last logits of the prompt's forward and of `steps` greedy decode steps, each through a DynamicCache. `fed`: the
    logits whose argmax each step takes instead of its own (two models' near-tied logits would feed them different
    tokens)."""
    cache, out, x = DynamicCache(config=model.config), [], prompt
    with torch.no_grad():
        for i in range(steps + 1):
            logits = model(x, past_key_values=cache, use_cache=True).logits[:, -1]
            out.append(logits)
            x = (logits if fed is None else fed[i]).argmax(-1, keepdim=True)
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


@pytest.mark.parametrize("nope", [32, 64])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_quantised_up_projection_is_read_as_stored(fmt, nope):
    """Dense int8 / int4 mode: the absorbed value rows are kv_b_proj's own quantised rows (views, no copy), the key
    rows its dequantised key rows transposed and requantised to int8 (within one int8 step), laid out for the lanes
    where they run (AVX-512; key rows of a multiple of 64 columns); decode steps give the logits the same rows
    dequantised give (the activations' int8 rounding apart), and in int8 stay near the unpatched model (the mode's
    error, not a wrong weight)."""
    config = tiny_config("deepseek_v2")
    config.kv_lora_rank = config.moe_intermediate_size = 32  # every dense linear's columns in groups of 32
    config.qk_nope_head_dim = nope  # key rows the int8 kernels take (a multiple of 32)
    # Every expert active: no top-k near-tie can turn the activations' rounding into another expert's output.
    config.num_experts_per_tok = config.n_routed_experts
    ref = random_model(config)
    model = patched_copy(ref, expert_budget=0.0, dense_weight_dtype=fmt, dense_weight_group_size=32)
    module = model.model.layers[0].self_attn
    linear = module.kv_b_proj
    up_v, up_v_scale = getattr(module, UP_V), getattr(module, UP_V_SCALE)
    assert up_v.untyped_storage().data_ptr() == linear.qweight.untyped_storage().data_ptr()
    assert up_v_scale.untyped_storage().data_ptr() == linear.scale.untyped_storage().data_ptr()
    # moved with their views onto the small weights' slabs (host_memory.gather_on_huge_pages)
    assert linear.qweight.untyped_storage().nbytes() > linear.qweight.nbytes
    assert up_v.data_ptr() == linear.qweight.data_ptr() + nope * up_v.stride(1)
    q = QuantizedWeight.from_kernel_operands(linear.qweight, linear.scale)
    per_head = dequantize(q.data, q.scale, q.bits, q.group_size).unflatten(0, (up_v.shape[0], -1))
    assert torch.equal(dequantize(up_v, up_v_scale, q.bits, q.group_size), per_head[:, nope:])
    up_k, up_k_scale = getattr(module, UP_K), getattr(module, UP_K_SCALE)
    laid_out = best_isa() == 2 and nope % 64 == 0
    assert up_k.dim() == (4 if laid_out else 3)
    if laid_out:
        up_k, up_k_scale = laid_out_rows(up_k, up_k_scale)
    assert up_k.dtype == torch.int8 and up_k.shape == (up_v.shape[0], config.kv_lora_rank, nope)
    keys = per_head[:, :nope].transpose(1, 2)
    step = keys.abs().amax() / 127
    assert float((dequantize(up_k, up_k_scale, 8, nope // up_k_scale.shape[-1]) - keys).abs().max()) <= step
    prompt = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(1))
    got = decode_logits(model, prompt, steps=3)
    if fmt == "int8":
        for g, w in zip(got, decode_logits(ref, prompt, steps=3, fed=got)):
            assert_logits_close(g, w, rel=0.05)
    for layer in model.model.layers:  # the same rows dequantised, in fp32 (the op's float route)
        attention = layer.self_attn
        for rows, scales in ((UP_K, UP_K_SCALE), (UP_V, UP_V_SCALE)):
            w, s = getattr(attention, rows), getattr(attention, scales)
            w, s = laid_out_rows(w, s) if w.dim() == 4 else (w, s)
            bits = 8 if w.dtype == torch.int8 else 4
            setattr(attention, rows, dequantize(w, s, bits, w.shape[-1] * (8 // bits) // s.shape[-1]))
            setattr(attention, scales, None)
    for g, w in zip(got, decode_logits(model, prompt, steps=3, fed=got)):
        assert_logits_close(g, w, rel=0.05)


def test_key_rows_the_int8_kernels_cannot_take_are_absorbed_dequantised():
    """Dense int8 mode with key rows of 8 columns (not a multiple of 32): the up-projection is absorbed as kv_b_proj's
    weight dequantised to the model's dtype, and decode steps stay near the unpatched model."""
    config = tiny_config("deepseek_v2")
    config.kv_lora_rank = config.moe_intermediate_size = 32
    ref = random_model(config)
    model = patched_copy(ref, expert_budget=0.0, dense_weight_dtype="int8", dense_weight_group_size=32)
    module = model.model.layers[0].self_attn
    assert getattr(module, UP_K_SCALE) is None and getattr(module, UP_V_SCALE) is None
    want = ref.model.layers[0].self_attn.kv_b_proj.weight
    got = torch.cat([getattr(module, UP_K).transpose(1, 2), getattr(module, UP_V)], dim=1).flatten(0, 1)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert float((got - want).abs().max()) <= float(want.abs().max()) / 100
    prompt = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(1))
    for g, w in zip(decode_logits(model, prompt, steps=3), decode_logits(ref, prompt, steps=3)):
        assert_logits_close(g, w, rel=0.05)


def test_a_model_dtype_up_projection_copies_only_its_key_rows():
    """In model dtype the value rows stay a view of kv_b_proj's weight (no second copy of them) and the key rows are
    one contiguous copy, transposed per head; neither has scales."""
    module, _ = latent_modules("deepseek_v2")
    weight = module.kv_b_proj.weight
    up_k, up_v = getattr(module, UP_K), getattr(module, UP_V)
    assert getattr(module, UP_K_SCALE) is None and getattr(module, UP_V_SCALE) is None
    assert up_v.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    assert up_k.is_contiguous() and up_k.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
    per_head = weight.unflatten(0, (up_k.shape[0], -1))
    assert torch.equal(up_k, per_head[:, : module.qk_nope_head_dim].transpose(1, 2))
    assert torch.equal(up_v, per_head[:, module.qk_nope_head_dim :])
