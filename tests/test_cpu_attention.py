"""The CPU decode attention (its op, its kernel at each ISA level, its torch form) against torch's SDPA in float64,
and when patching switches a model to it."""

import pytest
import torch
import torch.nn.functional as F

import torch_hybrid_moe as thm
from torch_hybrid_moe.model_patches.cpu_attention import NAME, cpu_attention_forward
from torch_hybrid_moe.ops.decode_attention import decode_attention_math
from torch_hybrid_moe.ops.kernel_build import best_isa, extension
from torch_hybrid_moe.tiny_models import tiny_model


class _Module(torch.nn.Module):
    pass


def reference(query, key, value, mask, scaling):
    """SDPA in float64, the key / value heads repeated per query head; [B, Q, Hq, Dv]."""
    groups = query.shape[1] // key.shape[1]
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (key, value))
    out = F.scaled_dot_product_attention(query.double(), k, v, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2)


def _levels() -> list[int]:
    return list(range(best_isa() + 1))


def _implementations() -> list[str]:
    """The op as the attention function calls it, its kernel at each ISA level this CPU runs, and its torch form."""
    return ["op", *(f"level {level}" for level in _levels()), "torch form"]


def attend(impl: str, query, key, value, mask, scaling):
    """Decode attention through one implementation, [B, 1, Hq, Dv]."""
    if impl == "op":
        out, weights = cpu_attention_forward(_Module(), query, key, value, mask, scaling=scaling)
        assert weights is None
        return out
    if impl == "torch form":
        return decode_attention_math(query, key, value, mask, scaling)
    return extension().decode_attention_at(query, key, value, mask, scaling, int(impl.split()[1]))


@pytest.mark.parametrize("impl", _implementations())
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive", "per head"])
@pytest.mark.parametrize("heads, kv_heads, d, dv", [(8, 2, 16, 16), (4, 4, 40, 24), (12, 4, 128, 128)])
def test_one_query_matches_sdpa(impl, mask_kind, heads, kv_heads, d, dv):
    """Grouped-query and MLA-like value widths, head widths off the vector width, against float64 SDPA."""
    g = torch.Generator().manual_seed(0)
    b, s = 2, 37
    query = torch.randn(b, heads, 1, d, generator=g)
    key = torch.randn(b, kv_heads, s, d, generator=g)
    value = torch.randn(b, kv_heads, s, dv, generator=g)
    valid = torch.arange(s) < torch.tensor([[7], [37]])  # batch row 0: a static cache filled to 7 positions
    hidden_from_odd_heads = valid[:, None, :] & ((torch.arange(heads)[:, None] % 2 == 0) | (torch.arange(s) < 3))
    mask = {
        "none": None,
        "bool": valid[:, None, None, :],
        "additive": torch.where(valid, 0.0, float("-inf"))[:, None, None, :],
        "per head": hidden_from_odd_heads[:, :, None, :],
    }[mask_kind]
    out = attend(impl, query, key, value, mask, 0.3)
    assert out.shape == (b, 1, heads, dv) and out.dtype == query.dtype
    ref_mask = None if mask is None else (mask if mask.dtype == torch.bool else mask.double())
    torch.testing.assert_close(out.double(), reference(query, key, value, ref_mask, 0.3), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", _implementations())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, d", [(16, 2, 64), (6, 2, 40), (3, 1, 16), (16, 2, 512)])  # groups 8, 3, 3, 8
def test_half_precision_rounds_once(impl, dtype, heads, kv_heads, d):
    """bf16 / fp16 caches over many positions, a key view with strided positions, head widths shorter than or off
    the kernels' vector steps, or as wide as MLA's latent (bf16 scores on the bf16 lanes where the CPU has them): within
    one rounding of the output of float64 SDPA on the same values."""
    g = torch.Generator().manual_seed(1)
    query = torch.randn(1, heads, 1, d, generator=g).to(dtype)
    key = torch.randn(1, 300, kv_heads, d, generator=g).to(dtype).transpose(1, 2)  # [B, Hkv, S, D], not contiguous
    value = torch.randn(1, kv_heads, 300, 64, generator=g).to(dtype)
    mask = (torch.arange(300) < 290).view(1, 1, 1, 300)
    out = attend(impl, query, key, value, mask, 0.125)
    ref = reference(query, key, value, mask, 0.125)
    eps = torch.finfo(dtype).eps
    assert ((out.double() - ref).abs() <= eps * ref.abs() + 1e-3 * eps).all()


@pytest.mark.parametrize("impl", _implementations())
def test_a_query_that_sees_nothing_is_zero_as_sdpa_gives(impl):
    """SDPA, which the op stands in for, gives 0 there (softmax over nothing but -inf would give NaN); the other heads
    of its group are unaffected."""
    query, key, value = torch.randn(1, 2, 1, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
    mask = torch.tensor([True, False]).view(1, 2, 1, 1).expand(1, 2, 1, 5)
    out = attend(impl, query, key, value, mask, 1.0)
    assert torch.equal(out[0, 0, 1], torch.zeros(8))
    torch.testing.assert_close(out[0, 0, 1].double(), reference(query, key, value, mask, 1.0)[0, 0, 1])
    assert torch.equal(attend(impl, query, key, value, torch.zeros_like(mask), 1.0), torch.zeros(1, 1, 2, 8))
    hidden = torch.full(mask.shape, float("-inf"))  # additive, hiding every position
    assert torch.equal(attend(impl, query, key, value, hidden, 1.0), torch.zeros(1, 1, 2, 8))
    torch.testing.assert_close(
        out[0, 0, 0].double(), reference(query, key, value, None, 1.0)[0, 0, 0], rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("impl", _implementations())
def test_nan_in_a_visible_key_shows_and_a_hidden_one_does_not(impl):
    """A NaN score is not softened away (the vectorised exp passes NaN); a hidden position is -inf whatever its key
    holds, also for a head whose group-mate sees it."""
    query, key, value = torch.randn(1, 2, 1, 32), torch.randn(1, 1, 6, 32), torch.randn(1, 1, 6, 32)
    key[0, 0, 5] = float("nan")
    hidden = torch.ones(1, 2, 1, 6, dtype=torch.bool)
    hidden[0, 0, 0, 5] = False  # head 0 may not see the NaN key; head 1 may
    out = attend(impl, query, key, value, hidden, 0.5)
    assert out[0, 0, 1].isnan().all()
    ref = reference(query[:, :1], key[:, :, :5], value[:, :, :5], None, 0.5)
    torch.testing.assert_close(out[0, 0, 0].double(), ref[0, 0, 0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", _implementations())
def test_broadcast_masks(impl):
    """A mask of one position or one batch row broadcasts as SDPA's does."""
    query, key, value = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    for mask in (torch.ones(1, 1, 1, 1, dtype=torch.bool), torch.zeros(2, 1, 1, 1)):
        out = attend(impl, query, key, value, mask, 1.0)
        torch.testing.assert_close(out.double(), reference(query, key, value, None, 1.0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["level 0", "torch form"])
@pytest.mark.parametrize(
    "shapes, mask, message",
    [
        (((1, 3, 1, 8), (1, 2, 5, 8), (1, 2, 5, 8)), None, "do not divide|dividing"),
        (((1, 2, 2, 8), (1, 2, 5, 8), (1, 2, 5, 8)), None, "expected query"),
        (((1, 2, 1, 8), (1, 2, 5), (1, 2, 5, 8)), None, "expected query"),
        (((1, 2, 1, 8), (1, 2, 0, 8), (1, 2, 0, 8)), None, "S, D, Dv >= 1"),
        (((1, 2, 1, 8), (1, 2, 5, 8), (1, 2, 5, 0)), None, "S, D, Dv >= 1"),  # once a division by zero: SIGFPE
        (((1, 2, 1, 0), (1, 2, 5, 0), (1, 2, 5, 8)), None, "S, D, Dv >= 1"),
        (((1, 4, 1, 8), (1, 2, 5, 8), (1, 2, 5, 8)), (1, 2, 1, 5), "broadcastable"),  # per key / value head
        (((1, 2, 1, 8), (1, 2, 5, 8), (1, 2, 5, 8)), (1, 1, 1, 4), "broadcastable"),
    ],
)
def test_bad_shapes_are_refused(impl, shapes, mask, message):
    if impl == "level 0" and extension() is None:
        pytest.skip("the kernel module is not built here")
    tensors = [torch.randn(*shape) for shape in shapes]
    with pytest.raises(RuntimeError, match=message):
        attend(impl, *tensors, None if mask is None else torch.ones(*mask, dtype=torch.bool), 1.0)


def test_other_dtypes_keep_sdpa():
    """float64 (which the op does not take) goes to SDPA, with the same result."""
    query, key, value = torch.randn(1, 4, 1, 8).double(), torch.randn(1, 2, 5, 8).double(), torch.randn(1, 2, 5, 8)
    module = _Module()
    module.num_key_value_groups = 2
    out, _ = cpu_attention_forward(module, query, key, value.double(), None)
    torch.testing.assert_close(out, reference(query, key, value.double(), None, 8**-0.5))


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


def test_decode_steps_with_a_position_bias_keep_sdpa():
    """A decode step with a position bias (or soft-capping, or sinks, which the op does not take) gives SDPA's
    result, bias included, not the op's unbiased one."""
    query, key, value = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    module = _Module()
    module.num_key_value_groups = 2
    bias = torch.randn(1, 4, 1, 5)
    out, _ = cpu_attention_forward(module, query, key, value, None, position_bias=bias)
    torch.testing.assert_close(out.double(), reference(query, key, value, bias.double(), 8**-0.5), rtol=1e-5, atol=1e-5)
