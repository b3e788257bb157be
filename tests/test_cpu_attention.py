"""The CPU decode attention against torch's SDPA in float64, and when patching switches a model to it."""

import pytest
import torch
import torch.nn.functional as F

import torch_hybrid_moe as thm
from torch_hybrid_moe.model_patches.cpu_attention import NAME, cpu_attention_forward
from torch_hybrid_moe.tiny_models import tiny_model


class _Module(torch.nn.Module):
    pass


def reference(query, key, value, mask, scaling):
    """SDPA in float64, the key / value heads repeated per query head; [B, Q, Hq, Dv]."""
    groups = query.shape[1] // key.shape[1]
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (key, value))
    out = F.scaled_dot_product_attention(query.double(), k, v, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
@pytest.mark.parametrize("heads, kv_heads, dv", [(8, 2, 16), (4, 4, 24)])  # grouped-query; MLA-like value width
def test_one_query_matches_sdpa(mask_kind, heads, kv_heads, dv):
    g = torch.Generator().manual_seed(0)
    b, s, d = 2, 11, 16
    query = torch.randn(b, heads, 1, d, generator=g)
    key = torch.randn(b, kv_heads, s, d, generator=g)
    value = torch.randn(b, kv_heads, s, dv, generator=g)
    valid = torch.arange(s) < torch.tensor([[7], [11]])  # batch row 0: a static cache filled to 7 positions
    mask = {
        "none": None,
        "bool": valid[:, None, None, :],
        "additive": torch.where(valid, 0.0, float("-inf"))[:, None, None, :],
    }[mask_kind]
    out, weights = cpu_attention_forward(_Module(), query, key, value, mask, scaling=0.3)
    assert weights is None and out.shape == (b, 1, heads, dv)
    ref_mask = None if mask is None else (mask if mask.dtype == torch.bool else mask.double())
    torch.testing.assert_close(out.double(), reference(query, key, value, ref_mask, 0.3), rtol=1e-5, atol=1e-6)


def test_prompts_keep_sdpa(monkeypatch):
    called = []
    monkeypatch.setattr(
        "torch_hybrid_moe.model_patches.cpu_attention.sdpa_attention_forward",
        lambda *a, **k: called.append(a[1].shape) or (None, None),
    )
    cpu_attention_forward(_Module(), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), None)
    assert called == [(1, 2, 5, 8)]


def test_patching_switches_sdpa_only():
    sdpa = tiny_model("qwen2_moe")
    assert sdpa.config._attn_implementation == "sdpa"
    assert thm.patch_model(sdpa, device="cpu").config._attn_implementation == NAME
    eager = tiny_model("qwen2_moe")
    eager.set_attn_implementation("eager")
    assert thm.patch_model(eager, device="cpu").config._attn_implementation == "eager"  # the user's choice stays
