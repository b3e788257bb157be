"""`hybrid_moe::greedy_tokens`: each row's argmax over logits [rows, vocabulary], greedy decoding's next tokens.

ATen's argmax is a scalar loop: over a 151,936-entry bf16 row on 2 cores of an AVX2 EPYC, 0.77 ms, and 0.50 ms with the
fp32 copy `generate()` takes first, against 0.04 ms for the op (benchmarks/cpu_decode_costs.py). The op's CPU kernel
(csrc/greedy.cpp, registered when the kernel module loads) finds the same index, torch.argmax's (the first of the
largest value, or the first NaN), in chunks per thread. Elsewhere, and in a process without the kernel module, it is
torch.argmax.
"""

from __future__ import annotations

import torch

_LIB = torch.library.Library("hybrid_moe", "FRAGMENT")
_LIB.define("greedy_tokens(Tensor logits) -> Tensor")


@torch.library.impl(_LIB, "greedy_tokens", "CompositeExplicitAutograd")
def greedy_tokens_torch(logits: torch.Tensor) -> torch.Tensor:
    """The op as torch.argmax computes it (its CPU kernel, once loaded, takes precedence)."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"greedy_tokens: logits must be [rows, vocabulary], got {tuple(logits.shape)}")
    return logits.argmax(-1)


@torch.library.register_fake("hybrid_moe::greedy_tokens", lib=_LIB)
def _(logits: torch.Tensor) -> torch.Tensor:
    torch._check(logits.dim() == 2, lambda: f"greedy_tokens: logits must be [rows, vocabulary], got {logits.shape}")
    return logits.new_empty(logits.shape[:1], dtype=torch.long)
