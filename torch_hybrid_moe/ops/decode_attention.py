"""`hybrid_moe::decode_attention`: one query per head (a decode step) attending over a key / value cache on the CPU.

A decode step's attention reads a few hundred KB of cache per layer. Through torch it cost 0.19 ms a layer at 160
cached positions with SDPA's flash kernel and 0.36 ms with transformers' eager math compiled (two small batched GEMMs
through oneDNN, the softmax between them; `benchmarks/cpu_decode_costs.py`, AMX Xeon, before this op): at 48 layers,
10-17 ms of every token. The op's CPU kernel is C++ (csrc/attention_kernel.h, registered when the kernel module
loads): one pass over each key / value head's cached rows for all the query heads that share them, skipping the
positions the mask hides (a static cache's unfilled tail); with bf16 caches of 512 or more key columns (MLA's latent)
and 8 or more query heads a key / value head, on CPUs with AVX512-BF16, its scores on the bf16 lanes (`vdpbf16ps`,
the keys laid out 32 positions at a time), the softmax and the value product in fp32 as elsewhere. Where the kernel
module cannot be built the same math runs in torch (`decode_attention_math`).

Contract: query [B, Hq, 1, D], key [B, Hkv, S, D], value [B, Hkv, S, Dv] (S, D, Dv >= 1, Hkv dividing Hq) in one dtype,
fp32, bf16 or fp16; mask None, boolean (True: may see) or additive, broadcastable as [B, Hq, 1, S]; scores and softmax
in fp32, the output [B, 1, Hq, Dv] in the query's dtype. A query that may see no position gets 0, as SDPA gives (the
attention this op stands in for; softmax over nothing but -inf would give NaN).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .library import require

_LIB = torch.library.Library("hybrid_moe", "FRAGMENT")
_LIB.define("decode_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor")


DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    check: Callable[[bool, Callable[[], str]], None] = require,
) -> None:
    """The op's contract, as the C++ kernel checks it; the fake implementation passes torch._check."""
    check(
        query.dim() == 4 and key.dim() == 4 and value.dim() == 4 and query.shape[2] == 1,
        lambda: "decode_attention: expected query [B, Hq, 1, D], key [B, Hkv, S, D], value [B, Hkv, S, Dv]",
    )
    b, hq, _, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    check(
        key.shape[0] == b
        and tuple(value.shape[:3]) == (b, hkv, s)
        and key.shape[3] == d
        and min(s, d, value.shape[3]) >= 1,
        lambda: "decode_attention: key / value must be [B, Hkv, S, D] / [B, Hkv, S, Dv] with S, D, Dv >= 1",
    )
    check(hq % hkv == 0, lambda: f"decode_attention: {hkv} key / value heads do not divide {hq} query heads")
    check(
        query.dtype in DTYPES and key.dtype == query.dtype and value.dtype == query.dtype,
        lambda: "decode_attention: query, key and value must share one dtype: fp32, bf16 or fp16",
    )
    if mask is not None:
        check(
            mask.dim() == 4
            and mask.shape[0] in (1, b)
            and mask.shape[1] in (1, hq)
            and mask.shape[2] == 1
            and mask.shape[3] in (1, s)
            and (mask.dtype == torch.bool or mask.is_floating_point()),
            lambda: "decode_attention: the mask must be boolean or additive, broadcastable as [B, Hq, 1, S]",
        )


@torch.library.register_fake("hybrid_moe::decode_attention", lib=_LIB)
def _(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    _check(query, key, value, mask, torch._check)
    return query.new_empty((query.shape[0], 1, query.shape[1], value.shape[3]))


@torch.library.impl(_LIB, "decode_attention", "CompositeExplicitAutograd")
def decode_attention_math(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """The op in torch, for machines without the kernel module (its CPU kernel, once loaded, takes precedence): the
    query heads of a key / value head multiplied together, in fp32."""
    _check(query, key, value, mask)
    b, hq, _, d = query.shape
    hkv = key.shape[1]
    q = query.reshape(b, hkv, hq // hkv, d).float()
    scores = torch.matmul(q, key.float().transpose(2, 3)) * scale  # [B, Hkv, groups, S]
    sees = None  # per query: whether the mask lets it see any position (0 where not, as the kernel gives)
    if mask is not None:  # [B or 1, 1 or Hq, 1, S] -> [B, Hkv, groups, S]
        mask = mask.expand(b, hq, 1, key.shape[2]).reshape(b, hkv, hq // hkv, -1)
        sees = (mask if mask.dtype == torch.bool else mask != float("-inf")).any(dim=-1, keepdim=True)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    weights = torch.softmax(scores, dim=-1)  # NaN and inf scores of seen positions stay
    if sees is not None:
        weights = torch.where(sees, weights, 0.0)
    out = torch.matmul(weights, value.float())  # [B, Hkv, groups, Dv]
    return out.reshape(b, 1, hq, value.shape[-1]).to(query.dtype)
