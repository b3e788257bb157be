"""The `hybrid_moe::latent_attention` op (MLA's absorbed decode attention; its kernel at each ISA level, its torch
form) against a float64 computation, with the up-projection in float, int8 and int4 rows, and its doors."""

import pytest
import torch

from torch_hybrid_moe.ops.kernel_build import best_isa, extension
from torch_hybrid_moe.ops.latent_attention import laid_out_rows, latent_attention_math, lay_out_key_rows
from torch_hybrid_moe.ops.quantize import dequantize, quantize, quantize_activations

HEADS, NOPE, ROT, RANK, V = 4, 64, 32, 96, 32


def _implementations() -> list[str]:
    return ["op", *(f"level {level}" for level in range(best_isa() + 1)), "torch form"]


def run(impl, *args):
    if impl == "op":
        return torch.ops.hybrid_moe.latent_attention(*args)
    if impl == "torch form":
        return latent_attention_math(*args)
    return extension().latent_attention_at(*args, int(impl.split()[1]))


def head_rows(weights, fmt, group=32):
    """[H, N, K] fp32 rows in `fmt` ("float": as given; "int8" / "int4": quantised, with scales)."""
    if fmt == "float":
        return weights, None
    q = quantize(weights.flatten(0, 1).unsqueeze(0), 8 if fmt == "int8" else 4, group)
    return q.data[0].unflatten(0, weights.shape[:2]), q.scale[0].unflatten(0, weights.shape[:2])


def reference(query, latent, k_rot, up_k, up_k_scale, up_v, up_v_scale, mask, scale):
    """The absorbed attention in float64: each head's latent query and latent output rounded to the query's dtype,
    and (quantised rows) the activations rounded per 32 columns to int8 first, where the op rounds them."""

    def rows(w, s):
        if s is None:
            return w.double()
        bits = 8 if w.dtype == torch.int8 else 4
        return dequantize(w, s, bits, w.shape[-1] * (8 // bits) // s.shape[-1]).double()

    def times(w, s, x):  # x [B, H, K] -> [B, H, N], rounded to the query's dtype
        x = (quantize_activations(x) if s is not None else x).double()
        return torch.einsum("hnk,bhk->bhn", rows(w, s), x).to(query.dtype)

    nope = query.shape[-1] - k_rot.shape[-1]
    q = query[:, :, 0]
    q_latent = times(up_k, up_k_scale, q[..., :nope]).double()
    scores = q_latent @ latent[:, 0].double().transpose(1, 2) + q[..., nope:].double() @ k_rot[:, 0].double().mT
    scores = scores * scale
    if mask is not None:
        m = mask[:, :, 0]
        scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m.double()
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a head that sees nothing: 0
    out_latent = (probs @ latent[:, 0].double()).to(query.dtype)
    return times(up_v, up_v_scale, out_latent).unsqueeze(1)


def inputs(batch, positions, dtype, fmt, heads=HEADS, seed=0, rank=RANK):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, 1, NOPE + ROT, generator=g).to(dtype)
    latent = torch.randn(batch, 1, positions, rank, generator=g).to(dtype)
    k_rot = torch.randn(batch, 1, positions, ROT, generator=g).to(dtype)
    up_k = torch.randn(heads, rank, NOPE, generator=g) * 0.2
    # value rows a view out of the whole up-projection, as absorb leaves kv_b_proj's: heads (NOPE + V) rows apart
    whole = torch.randn(heads, NOPE + V, rank, generator=g) * 0.2
    keys, key_scales = head_rows(up_k.to(dtype) if fmt == "float" else up_k, fmt)
    values, value_scales = head_rows(whole.to(dtype) if fmt == "float" else whole, fmt)
    values, value_scales = values[:, NOPE:], None if value_scales is None else value_scales[:, NOPE:]
    return query, latent, k_rot, keys, key_scales, values, value_scales


def masks(batch, heads, positions, kind):
    """None, a boolean or additive mask per batch row, or a boolean one per head (batch row 0's head 1 sees nothing)."""
    g = torch.Generator().manual_seed(2)
    if kind == "per head":
        seen = torch.rand(batch, heads, 1, positions, generator=g) > 0.4
        seen[..., -1] = True
        seen[0, 1] = False
        return seen
    seen = torch.rand(batch, 1, 1, positions, generator=g) > 0.4
    seen[..., -1] = True
    return {"none": None, "bool": seen, "additive": torch.randn(batch, 1, 1, positions, generator=g)}[kind]


@pytest.mark.parametrize("impl", _implementations())
@pytest.mark.parametrize("fmt", ["float", "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive", "per head"])
@pytest.mark.parametrize("batch, heads, rank", [(2, 4, RANK), (1, 5, RANK), (1, 16, 512)])
def test_matches_float64(impl, fmt, dtype, mask_kind, batch, heads, rank):
    """37 positions, value rows strided per head; two batch rows of 4 heads, or one of 5 (on 2 threads: groups of 3
    and 2 heads, the second starting past head 0 and shorter than the kernel's 4-head step), or of 16 over a latent
    as wide as DeepSeek's (on 2 threads: groups of 8, which score bf16 keys on the bf16 lanes where the CPU has them):
    within the float rounding of the float64 computation at the same rounding points (bf16: a unit in the last place of
    its output).
    With quantised rows an activation a rounding apart may round to the next int8 step: within 2% of the output's
    largest value."""
    args = inputs(batch, 37, dtype, fmt, heads, rank=rank)
    mask = masks(batch, heads, 37, mask_kind)
    got = run(impl, *args, mask, 0.2)
    want = reference(*args, mask, 0.2)
    assert got.shape == (batch, 1, heads, V) and got.dtype == dtype
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    if fmt != "float":
        tol = dict(rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    torch.testing.assert_close(got.double(), want.double(), **tol)
    if mask_kind == "per head":
        assert bool((got[0, 0, 1] == 0).all())


@pytest.mark.parametrize("impl", _implementations())
def test_a_head_that_sees_nothing_is_zero(impl):
    args = inputs(2, 5, torch.float32, "int8")
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    mask[1] = False
    out = run(impl, *args, mask, 0.2)
    assert bool((out[1] == 0).all()) and bool(out[0].isfinite().all()) and bool((out[0] != 0).any())


@pytest.mark.parametrize("impl", _implementations())
@pytest.mark.parametrize("batch, heads", [(0, 4), (2, 0)])
def test_an_empty_batch_or_no_heads_gives_an_empty_output(impl, batch, heads):
    out = run(impl, *inputs(batch, 5, torch.float32, "int8", heads), None, 0.2)
    assert out.shape == (batch, 1, heads, V)


@pytest.mark.skipif(best_isa() < 2, reason="the lanes run at ISA level 2 (AVX-512 with VNNI)")
@pytest.mark.parametrize("impl", ["op", "level 2", "torch form"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch, heads", [(2, 4), (1, 5)])
def test_key_rows_laid_out_for_the_lanes_give_the_rows_products(impl, dtype, batch, heads):
    """int8 key rows laid out 16 to a panel (what absorb stores on AVX-512 machines): the same bytes, given back
    exactly by the inverse; the op on them against float64, and against the same rows unlaid within fp32's rounding
    (the lanes sum each 32-column block exactly in int32, the rows 4 columns at a time: bf16 outputs a unit apart)."""
    query, latent, k_rot, keys, key_scales, values, value_scales = inputs(batch, 37, dtype, "int8", heads)
    panels, panel_scales = lay_out_key_rows(keys, key_scales)
    assert panels.shape == (heads, RANK // 16, NOPE // 4, 64) and panels.nbytes == keys.nbytes
    assert panel_scales.shape == (heads, RANK // 16, NOPE // 32, 16)
    back = laid_out_rows(panels, panel_scales)
    assert torch.equal(back[0], keys) and torch.equal(back[1], key_scales)
    mask = masks(batch, heads, 37, "per head")
    got = run(impl, query, latent, k_rot, panels, panel_scales, values, value_scales, mask, 0.2)
    want = reference(query, latent, k_rot, keys, key_scales, values, value_scales, mask, 0.2)
    torch.testing.assert_close(got.double(), want.double(), rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    rows = run(impl, query, latent, k_rot, keys, key_scales, values, value_scales, mask, 0.2)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(got, rows, **tol)


@pytest.mark.skipif(best_isa() < 2, reason="the lanes run at ISA level 2 (AVX-512 with VNNI)")
def test_laid_out_key_rows_doors():
    query, latent, k_rot, keys, key_scales, values, value_scales = inputs(1, 7, torch.bfloat16, "int8")
    panels, panel_scales = lay_out_key_rows(keys, key_scales)
    for level in range(2):  # the lanes' layout is AVX-512's
        with pytest.raises(RuntimeError, match="ISA level 2 only"):
            extension().latent_attention_at(
                query, latent, k_rot, panels, panel_scales, values, value_scales, None, 0.2, level
            )
    with pytest.raises(RuntimeError, match="laid-out key rows must be"):
        run("op", query, latent, k_rot, panels, panel_scales[:, :, :1], values, value_scales, None, 0.2)
    with pytest.raises(RuntimeError, match="N a multiple of 16"):
        extension().lay_out_lanes(keys[:, :8], key_scales[:, :8])
    assert lay_out_key_rows(keys[:, :8], key_scales[:, :8]) is None  # the shapes the lanes cannot take: rows kept
    args = (query, latent, k_rot, panels, panel_scales, values.contiguous(), value_scales.contiguous(), None, 0.2)
    torch.library.opcheck(torch.ops.hybrid_moe.latent_attention.default, args)


def test_passes_opcheck():
    query, latent, k_rot, keys, key_scales, values, value_scales = inputs(1, 7, torch.bfloat16, "int4")
    values, value_scales = values.contiguous(), value_scales.contiguous()  # opcheck's copies drop the heads' stride
    args = (query, latent, k_rot, keys, key_scales, values, value_scales, None, 0.2)
    torch.library.opcheck(torch.ops.hybrid_moe.latent_attention.default, args)


@pytest.mark.parametrize("impl", ["op", "torch form"])
@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "query": a["query"][..., :ROT]}, "must be"),  # no nope part left
        (lambda a: {**a, "latent": a["latent"].float()}, "one dtype"),
        (lambda a: {**a, "up_k": a["up_k"][:2]}, "up_k"),
        (lambda a: {**a, "up_k_scale": None}, "scales"),
        (lambda a: {**a, "mask": torch.ones(1, 1, 1, 3, dtype=torch.bool)}, "mask"),
    ],
)
def test_bad_input_is_refused(impl, change, message):
    names = ("query", "latent", "k_rot", "up_k", "up_k_scale", "up_v", "up_v_scale")
    args = dict(zip(names, inputs(1, 7, torch.bfloat16, "int8")), mask=None, scale=0.2)
    with pytest.raises((RuntimeError, ValueError), match=message):
        run(impl, *change(args).values())
