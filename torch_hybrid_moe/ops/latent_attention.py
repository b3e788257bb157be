"""`hybrid_moe::latent_attention`: DeepSeek's multi-head latent attention (MLA) in a decode step, its up-projection
absorbed (model_patches/latent_attention.py), as one CPU op.

Absorbed, a decode step multiplies each head's query by its key rows of kv_b_proj, attends over the cached latent,
and multiplies each head's output by its value rows. In torch that was two batched products over the up-projection
and three small ones over the cache, ~0.17 ms a layer of DeepSeek-V2-Lite's shape in a compiled int4 step (2 MB of
key rows and 2 MB of value rows read in bf16; benchmarks/RESULTS.md, 2026-12-01). The op's C++ kernel
(csrc/moe_cpu.cpp) runs the products on the dense layers' micro-kernels, so the up-projection is read in the
format the dense layers hold (int8 / int4 rows with the int8 / int4 dense modes), and the attention in one pass over
the cache per group of heads (csrc/attention_kernel.h). Where the kernel module cannot be built the same math runs
in torch (`latent_attention_math`).

Contract: query [B, H, 1, nope + rot], latent [B, 1, S, r], k_rot [B, 1, S, rot] in one dtype (fp32, bf16 or fp16);
up_k [H, r, nope] and up_v [H, v, r] (int4: the last dimension halved) in a float dtype, or int8 / packed int4 with
fp16 scales [H, N, K / group] (groups of a multiple of 32 columns); each head's rows contiguous, heads any stride
apart (views of kv_b_proj's rows). int8 key rows may also come laid out for the kernel's AVX-512 lanes
(`lay_out_key_rows`, their scales widened to fp32 there), which only its ISA level 2 and the torch form read. Mask
and scale as `hybrid_moe::decode_attention`'s. Out [B, 1, H, v] in the query's dtype. The head's latent query and
its latent output are rounded to the query's dtype, as the same products in torch round them; with quantised rows, the
activations are rounded as a quantised linear rounds them (`quantize.quantize_activations`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import cpu_kernel
from .decode_attention import DTYPES, decode_attention_math
from .library import require
from .quantize import SCALE_DTYPE, dequantize, quantize_activations

_LIB = torch.library.Library("hybrid_moe", "FRAGMENT")
_LIB.define(
    "latent_attention(Tensor query, Tensor latent, Tensor k_rot, Tensor up_k, Tensor? up_k_scale, Tensor up_v, "
    "Tensor? up_v_scale, Tensor? mask, float scale) -> Tensor"
)

QUANTISED = (torch.int8, torch.uint8)
LANES = 16  # rows a laid-out panel holds (lay_out_key_rows)


def _check(
    query: torch.Tensor,
    latent: torch.Tensor,
    k_rot: torch.Tensor,
    up_k: torch.Tensor,
    up_v: torch.Tensor,
    check: Callable[[bool, Callable[[], str]], None] = require,
) -> None:
    """The op's shape and dtype contract, as the C++ kernel checks it; the fake implementation passes torch._check."""
    check(
        query.dim() == 4 and query.shape[2] == 1 and latent.dim() == 4 and k_rot.dim() == 4,
        lambda: "latent_attention: expected query [B, H, 1, nope + rot], latent [B, 1, S, r], k_rot [B, 1, S, rot]",
    )
    b, h, _, width = query.shape
    s, r, rot = latent.shape[2], latent.shape[3], k_rot.shape[3]
    check(
        tuple(latent.shape[:2]) == (b, 1) and tuple(k_rot.shape[:3]) == (b, 1, s) and min(s, r, rot, width - rot) >= 1,
        lambda: "latent_attention: latent / k_rot must be [B, 1, S, r] / [B, 1, S, rot], S >= 1, rot below the query's",
    )
    laid_out = up_k.dim() == 4 and up_k.shape[0] == h and up_k.shape[1] * LANES == r  # lay_out_key_rows's form
    check(
        (laid_out or up_k.dim() == 3 and up_k.shape[:2] == (h, r)) and up_v.dim() == 3 and up_v.shape[0] == h,
        lambda: (
            "latent_attention: up_k must be [H, r, nope] (or laid out, [H, r / 16, nope / 4, 64]) and up_v [H, v, r]"
        ),
    )
    check(
        query.dtype in DTYPES and latent.dtype == query.dtype and k_rot.dtype == query.dtype,
        lambda: "latent_attention: query, latent and k_rot must share one dtype: fp32, bf16 or fp16",
    )


@torch.library.register_fake("hybrid_moe::latent_attention", lib=_LIB)
def _(
    query: torch.Tensor,
    latent: torch.Tensor,
    k_rot: torch.Tensor,
    up_k: torch.Tensor,
    up_k_scale: torch.Tensor | None,
    up_v: torch.Tensor,
    up_v_scale: torch.Tensor | None,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    _check(query, latent, k_rot, up_k, up_v, torch._check)
    return query.new_empty((query.shape[0], 1, query.shape[1], up_v.shape[1]))


def lay_out_key_rows(rows: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """int8 key rows [H, r, nope] (scales [H, r, nope / group]) laid out for the kernel's AVX-512 lanes, as the op
    takes them in place of the rows: (uint8 [H, r / 16, nope / 4, 64], fp32 [H, r / 16, nope / group, 16]), the same
    bytes. At one token, 16 rows a vector instruction instead of one row at a time, whose 128-column rows cost ~7 ns
    each besides their products (benchmarks/RESULTS.md, 2026-12-02). None where the lanes do not run (no AVX-512 with
    VNNI, no kernel module) or the shapes do not fit them."""
    ext = cpu_kernel.extension() if cpu_kernel.best_isa() == 2 else None
    if ext is None or rows.dtype != torch.int8 or rows.shape[1] % LANES or rows.shape[2] % 64:
        return None
    return ext.lay_out_lanes(rows, scale)


def laid_out_rows(panels: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`lay_out_key_rows`' inverse: the int8 rows [H, r, nope] and their scales [H, r, nope / group]. A panel holds
    4 bytes of each of its 16 rows a vector, each byte stored + 128."""
    h, p, quarter, _ = panels.shape
    rows = panels.view(h, p, quarter // 16, 16, LANES, 4).permute(0, 1, 4, 2, 3, 5).reshape(h, p * LANES, quarter * 4)
    return (rows.to(torch.int16) - 128).to(torch.int8), scale.transpose(2, 3).reshape(h, p * LANES, -1).to(SCALE_DTYPE)


def rows_float(weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Per-head rows [H, N, K] as fp32 (int8 / packed int4 dequantised with their scales; laid-out key rows too)."""
    if weight.dtype not in QUANTISED:
        return weight.float()
    if scale is None:
        raise ValueError("latent_attention: int8 / int4 rows need their scales")
    if weight.dim() == 4:
        weight, scale = laid_out_rows(weight, scale)
    bits = 8 if weight.dtype == torch.int8 else 4
    return dequantize(weight, scale, bits, weight.shape[-1] * (8 // bits) // scale.shape[-1])


def head_products(rows: torch.Tensor, scale: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """x [B, H, K] times each head's rows [H, N, K] -> [B, H, N] in x's dtype, summed in fp32; quantised rows take
    x rounded as a quantised linear's kernels round it."""
    xf = quantize_activations(x) if rows.dtype in QUANTISED else x.float()
    return torch.einsum("hnk,bhk->bhn", rows_float(rows, scale), xf).to(x.dtype)


@torch.library.impl(_LIB, "latent_attention", "CompositeExplicitAutograd")
def latent_attention_math(
    query: torch.Tensor,
    latent: torch.Tensor,
    k_rot: torch.Tensor,
    up_k: torch.Tensor,
    up_k_scale: torch.Tensor | None,
    up_v: torch.Tensor,
    up_v_scale: torch.Tensor | None,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """The op in torch, for machines without the kernel module (its CPU kernel, once loaded, takes precedence): the
    same products and roundings, the attention as `decode_attention_math` computes it."""
    _check(query, latent, k_rot, up_k, up_v)
    nope = query.shape[-1] - k_rot.shape[-1]
    q = query[:, :, 0]
    q_latent = head_products(up_k, up_k_scale, q[..., :nope])  # [B, H, r]
    q_cat = torch.cat([q_latent, q[..., nope:]], dim=-1).unsqueeze(2)
    out_latent = decode_attention_math(q_cat, torch.cat([latent, k_rot], dim=-1), latent, mask, scale)
    return head_products(up_v, up_v_scale, out_latent[:, 0]).unsqueeze(1)  # [B, 1, H, v]
