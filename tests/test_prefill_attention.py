"""The CPU prefill attention op (bf16 lanes) against SDPA in float64, and which prompts the attention function sends
to it."""

import pytest
import torch
import torch.nn.functional as F

from torch_hybrid_moe.model_patches.cpu_attention import cpu_attention_forward
from torch_hybrid_moe.ops import cpu_kernel, prefill_attention

needs_kernel = pytest.mark.skipif(not prefill_attention.runs_here(), reason="needs AVX512-BF16 and the kernel module")


class _Module(torch.nn.Module):
    pass


def reference(query, key, value, mask, scale, causal):
    """SDPA in float64 (top-left causal where asked), the key / value heads repeated per query head; [B, L, Hq, Dv]."""
    groups = query.shape[1] // key.shape[1]
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (key, value))
    if causal:
        mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool).tril()
    elif mask is not None and mask.is_floating_point():
        mask = mask.double()
    return F.scaled_dot_product_attention(query.double(), k, v, attn_mask=mask, scale=scale).transpose(1, 2)


def operands(b, hq, hkv, length, positions, d, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, hq, length, d, generator=g).bfloat16(),
        torch.randn(b, hkv, positions, d, generator=g).bfloat16(),
        torch.randn(b, hkv, positions, dv, generator=g).bfloat16(),
    )


def mask_of(kind, b, hq, length, positions, seed=1):
    """(mask, causal) of one kind: none, causal, a static cache's (positions past the prompt hidden), a padding one
    (the same positions hidden from every row), a random boolean one per batch row, an additive one per head (bf16,
    as transformers makes them)."""
    g = torch.Generator().manual_seed(seed)
    if kind in ("none", "causal"):
        return None, kind == "causal"
    if kind == "padding":
        mask = torch.ones(b, 1, 1, positions, dtype=torch.bool)
        mask[..., -3:] = False
        return mask, False
    if kind == "static":
        return (torch.arange(positions)[None, :] <= torch.arange(length)[:, None])[None, None], False
    if kind == "random":
        mask = torch.rand(b, 1, length, positions, generator=g) > 0.4
        mask[..., 0] = True
        return mask, False
    return torch.randn(1, hq, length, positions, generator=g).bfloat16(), False


SHAPES = [  # (B, Hq, Hkv, L, S, D, Dv): grouped and not, blocks of 16 rows and tails, odd position counts
    (1, 8, 2, 37, 37, 64, 64),
    (2, 4, 4, 20, 51, 32, 96),
    (1, 16, 4, 70, 96, 128, 128),
    (1, 6, 3, 17, 33, 64, 32),
    (1, 4, 2, 40, 300, 32, 32),  # a long hidden tail, searched 64 flags at a time
]


@pytest.mark.parametrize("impl", ["kernel", "sdpa form"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", ["none", "causal", "static", "padding", "random", "additive"])
def test_matches_float64_sdpa(impl, shape, kind):
    """The C++ kernel and the op's SDPA form (where the kernel module is not loaded), within the bf16 output's own
    rounding and the probabilities' (SDPA rounds both as well)."""
    if impl == "kernel" and not prefill_attention.runs_here():
        pytest.skip("needs AVX512-BF16 and the kernel module")
    b, hq, hkv, length, positions, d, dv = shape
    if kind == "static" and positions < length:
        pytest.skip("a static cache holds the prompt")
    query, key, value = operands(*shape)
    mask, causal = mask_of(kind, b, hq, length, positions)
    attend = torch.ops.hybrid_moe.prefill_attention if impl == "kernel" else prefill_attention.prefill_attention_sdpa
    out = attend(query, key, value, mask, d**-0.5, causal)
    want = reference(query, key, value, mask, d**-0.5, causal)
    assert out.dtype == torch.bfloat16 and out.shape == want.shape
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-2 * want.abs().max().item())


@needs_kernel
@pytest.mark.parametrize("hidden_rows", [1, 16], ids=["one row", "a whole block"])
def test_rows_that_see_nothing_are_zero_and_hidden_positions_are_not_read(hidden_rows):
    """As SDPA: a row whose mask hides every position gets 0 (also a whole block of 16 rows, which reads nothing); inf
    keys and NaN values at the positions past the last one a block sees (19, an odd count: its value pairs end on a
    single position) change nothing."""
    query, key, value = operands(1, 4, 2, 19, 40, 32, 32)
    mask = (torch.arange(40)[None, :] <= torch.arange(19)[:, None])[None, None].clone()
    mask[..., 3 : 3 + hidden_rows, :] = False
    key[..., 19:, :] = float("inf")
    value[..., 19:, :] = float("nan")
    out = torch.ops.hybrid_moe.prefill_attention(query, key, value, mask, 0.2, False)
    assert not out[:, 3 : 3 + hidden_rows].any()
    want = reference(query, key[..., :19, :], value[..., :19, :], mask[..., :19], 0.2, False)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-2 * want.abs().max().item())


@needs_kernel
def test_a_nan_score_stays_nan():
    """A NaN among the positions a row sees is not taken for a row that sees nothing."""
    query, key, value = operands(1, 2, 2, 5, 5, 32, 32)
    query[0, 0, 2, 0] = float("nan")
    out = torch.ops.hybrid_moe.prefill_attention(query, key, value, None, 0.2, True)
    assert out[0, 2, 0].isnan().all() and not out[0, 2, 1].isnan().any()


def test_other_operands_get_sdpa_results():
    """fp32, or head sizes the kernel does not take: the op gives SDPA's result (its CPU kernel hands them to SDPA)."""
    for dtype, d in ((torch.float32, 32), (torch.bfloat16, 16)):
        query, key, value = (t.to(dtype) for t in operands(1, 4, 2, 20, 24, d, d))
        out = torch.ops.hybrid_moe.prefill_attention(query, key, value, None, 0.3, True)
        want = reference(query, key, value, None, 0.3, True)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.double(), want, rtol=0, atol=tol * want.abs().max().item())


def test_bad_shapes_are_refused():
    query, key, value = operands(1, 4, 2, 20, 40, 32, 32)
    with pytest.raises(RuntimeError, match="dividing Hq"):
        torch.ops.hybrid_moe.prefill_attention(
            query, key[:, :1].expand(1, 3, 40, 32), value[:, :1].expand(1, 3, 40, 32), None, 0.2, True
        )


@needs_kernel
@pytest.mark.parametrize("is_causal", [None, False])
def test_the_attention_function_sends_bf16_prompts_to_the_op(monkeypatch, is_causal):
    """A bf16 prompt the kernel takes (a transposed query, as transformers passes it) goes to the op where it is
    chosen, causal without a mask where SDPA would be (as the module says), with SDPA's result."""
    monkeypatch.setattr(prefill_attention, "_beats_sdpa", lambda threads: True)
    query, key, value = operands(1, 8, 2, 24, 24, 64, 64)
    query = query.transpose(2, 3).contiguous().transpose(2, 3)
    module = _Module()
    module.num_key_value_groups = 4

    def refuse(*args, **kwargs):
        raise AssertionError("SDPA was called")

    monkeypatch.setattr("torch_hybrid_moe.model_patches.cpu_attention.sdpa_attention_forward", refuse)
    out, weights = cpu_attention_forward(module, query, key, value, None, scaling=0.125, is_causal=is_causal)
    assert weights is None
    want = reference(query, key, value, None, 0.125, is_causal is None)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-2 * want.abs().max().item())


def test_the_attention_function_keeps_sdpa_for_other_prompts(monkeypatch):
    """A position bias, a 2-D mask, query and keys of different batch sizes, or a kernel that lost this machine's
    timing against SDPA: SDPA."""
    query, key, value = operands(1, 8, 2, 24, 24, 64, 64)
    module = _Module()
    module.num_key_value_groups = 4
    called = []
    monkeypatch.setattr(
        "torch_hybrid_moe.model_patches.cpu_attention.sdpa_attention_forward",
        lambda *a, **k: called.append(a[1].shape) or (None, None),
    )
    cpu_attention_forward(module, query, key, value, None, position_bias=torch.zeros(1, 8, 24, 24))
    cpu_attention_forward(module, query, key, value, torch.ones(24, 24, dtype=torch.bool))
    cpu_attention_forward(module, query, key.expand(2, -1, -1, -1), value.expand(2, -1, -1, -1), None)
    monkeypatch.setattr(prefill_attention, "_beats_sdpa", lambda threads: False)
    assert not prefill_attention.available()
    cpu_attention_forward(module, query, key, value, None)
    assert called == [query.shape] * 4


@needs_kernel
@pytest.mark.parametrize("times, beats", [([1.0, 2.0], True), ([2.0, 1.0], False), ([1.0, 1.0], False)])
def test_the_op_is_chosen_where_it_beat_sdpa(times, beats, tmp_path, monkeypatch):
    """The warm-up times the kernel against SDPA on the same causal prompt (both timed calls give the same attention)
    and chooses the kernel only where it took less time (timings scripted; where it lost, prompts keep SDPA:
    test_the_attention_function_keeps_sdpa_for_other_prompts)."""
    outputs = []

    def timings(runs, repeats):
        outputs.extend(run() for run in runs)
        return times

    monkeypatch.setattr(cpu_kernel, "interleaved_medians", timings)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # a routes file of its own: nothing measured before is read
    assert prefill_attention._beats_sdpa.__wrapped__(1, (1, 4, 2, 64, 64), 1) is beats
    ours, sdpa = outputs
    assert ours.shape == (1, 64, 4, 64)  # [batch, tokens, heads, head size], as attention functions return it
    torch.testing.assert_close(ours.float(), sdpa.float(), rtol=2e-2, atol=2e-2)


def test_fake_kernel_gives_the_op_s_shape():
    """The op's fake kernel (its SDPA form on fake tensors) passes torch.library's checks: shapes and dtypes as the
    real kernel's, for GQA heads, an MLA-like value width and a mask."""
    query, key, value = operands(1, 8, 2, 24, 24, 64, 32)
    mask = torch.ones(1, 1, 24, 24, dtype=torch.bool).tril()
    for args in ((query, key, value, None, 0.125, True), (query, key, value, mask, 0.125, False)):
        torch.library.opcheck(torch.ops.hybrid_moe.prefill_attention.default, args, test_utils="test_faketensor")
    # every size symbolic: the fake's SDPA took the head counts' comparison as a SymBool, which it refuses
    attend = lambda q, k, v: torch.ops.hybrid_moe.prefill_attention(q, k, v, None, 0.125, True)  # noqa: E731
    torch.testing.assert_close(
        torch.compile(attend, fullgraph=True, dynamic=True)(query, key, value), attend(query, key, value)
    )
