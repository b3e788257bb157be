"""`hybrid_moe::prefill_attention`: a prompt's attention (many queries per head) in bf16 on CPUs with AVX512-BF16.

torch's SDPA runs its flash kernel for the CPU at ~0.1-0.2 TFLOP/s on a prompt's bf16 attention: 24 ms a layer of
Qwen3-30B-A3B's shape at 512 tokens on a 2-core Zen 5, a fifth of the whole prefill (benchmarks/RESULTS.md,
2026-11-28), where the CPU's bf16 dot products run at ~0.8 TFLOP/s. The op's kernel (csrc/attention_kernel.h) does both
products with the expert kernel's bf16 lanes (`vdpbf16ps`): per key / value head and block of 16 query rows of all
the query heads sharing it, the keys the block may see are laid out once and multiplied by every row, the softmax
runs in fp32, and its exponentials, rounded to bf16 as SDPA's flash kernel rounds them, multiply the values laid out
by pairs of positions. Positions past the last one a block may see (a causal prompt's future, a static cache's
unfilled tail) are not read.

Contract: query [B, Hq, L, D], key [B, Hkv, S, D], value [B, Hkv, S, Dv] in bf16 (Hkv dividing Hq, D and Dv multiples
of 32); mask None (every position, or with `causal` position s for query l when s <= l, SDPA's `is_causal`), boolean
(True: may see) or additive, broadcastable as [B, Hq, L, S]; the output [B, L, Hq, Dv] in bf16. A query that may see
no position gets 0, as SDPA gives. Other dtypes and head sizes, CPUs without AVX512-BF16, and a process without the
kernel module get SDPA's result (`prefill_attention_sdpa`); callers that want SDPA's own call check `available()` and
`fits` first. `available()` also asks whether the kernel beat SDPA on this machine (timed once, kept with the routes):
SDPA's bf16 products may run on AMX tiles where the CPU has them, and the lanes were measured on a CPU without.
"""

from __future__ import annotations

import functools

import torch

from .kernel_build import extension
from .measured import flag, measured

_LIB = torch.library.Library("hybrid_moe", "FRAGMENT")
_LIB.define(
    "prefill_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale, bool causal) -> Tensor"
)


@torch.compiler.assume_constant_result  # a compiled graph asks once, at trace time (the build is not traceable)
def available() -> bool:
    """Whether prompts (that `fit`) should take the op here: its kernel runs on this CPU and beat SDPA's there."""
    return runs_here() and _beats_sdpa(torch.get_num_threads())


@functools.cache
def runs_here() -> bool:
    """Whether the op's kernel runs on this CPU (AVX-512 with AVX512-BF16, the kernel module built)."""
    ext = extension()
    return ext is not None and bool(ext.prefill_attention_available())


TIMED_SHAPE = (1, 16, 4, 256, 128)  # batch, query heads, key / value heads, prompt tokens, head size: Qwen3-MoE-like


@measured(decode=flag)
def _beats_sdpa(threads: int, shape: tuple[int, ...] = TIMED_SHAPE, repeats: int = 5) -> bool:
    """Whether the kernel took less time than SDPA (the op's SDPA form) on a causal bf16 prompt of `shape`, medians of
    `repeats` turns each."""
    from .cpu_kernel import interleaved_medians  # the routes' timer

    b, hq, hkv, length, d = shape
    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(b, h, length, d, generator=g).bfloat16() for h in (hq, hkv, hkv))
    scale = d**-0.5
    ours, sdpa = interleaved_medians(
        [
            lambda: torch.ops.hybrid_moe.prefill_attention(query, key, value, None, scale, True),
            lambda: prefill_attention_sdpa(query, key, value, None, scale, True),
        ],
        repeats,
    )
    return ours < sdpa


def fits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether these operands are the kernel's: CPU bf16 of one batch size, head sizes multiples of 32, key / value
    heads dividing the query heads, a mask None or 4-D broadcastable as [B, Hq, L, S] (SDPA takes more)."""
    (b, hq, length, d), (hkv, positions) = query.shape, key.shape[1:3]
    return (
        query.device.type == "cpu"
        and query.dtype == key.dtype == value.dtype == torch.bfloat16
        and key.shape[0] == value.shape[0] == b
        and value.shape[1:3] == (hkv, positions)
        and hq % hkv == 0
        and d % 32 == 0
        and value.shape[-1] % 32 == 0
        and (mask is None or (mask.dim() == 4 and _broadcasts(mask.shape, (b, hq, length, positions))))
    )


def _broadcasts(shape: torch.Size, to: tuple[int, ...]) -> bool:
    return all(n in (1, m) for n, m in zip(shape, to, strict=True))


@torch.library.impl(_LIB, "prefill_attention", "CompositeExplicitAutograd")
def prefill_attention_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """The op as torch's SDPA computes it (its CPU kernel, once loaded, takes precedence)."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        scale=scale,
        is_causal=causal and mask is None,
        enable_gqa=bool(query.shape[1] != key.shape[1]),  # a SymBool under dynamic shapes, which SDPA refuses
    )
    return out.transpose(1, 2).contiguous()


# SDPA computes shapes on fake tensors too: the form above is also the op's fake kernel (its output [B, L, Hq, Dv])
torch.library.register_fake("hybrid_moe::prefill_attention", prefill_attention_sdpa, lib=_LIB)
