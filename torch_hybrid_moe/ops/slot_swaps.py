"""Which missing experts take which expert slots in a captured step, as one device program.

A scheduler's on-demand fetches and the gate prefetch both pair the best candidates with the slots the cache
gives up first (policies/device_caching.py, `_swap_in`). Composed of torch ops that is two top-k's, gathers and
masks: some twenty kernel nodes a layer step, and the order top-k gives equal values is unspecified, on CUDA
not the lowest index first. As one Triton program it is one node, and every tie goes as the Python path's
`choose_slot` breaks it: the lowest slot.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


def swap_in(
    candidates: torch.Tensor,
    keep: torch.Tensor,
    values: torch.Tensor,
    slot_expert: torch.Tensor,
    k: int,
    kernel: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `k` (expert, slot) pairs: the i-th best candidate (highest `candidates` value [E], -inf: none; the
    lowest id on a tie) takes the i-th slot the ranking `values` [E] gives up first (a free slot first, then the
    least valuable holder, the lowest slot on a tie), never a slot holding a `keep` [E] expert. Returns expert ids
    [k] (-1 where no copy happens) and slots [k], int64. `kernel`: an interpreted stand-in (tests)."""
    experts, slots = len(candidates), len(slot_expert)
    expert = torch.empty(k, dtype=torch.int64, device=candidates.device)
    slot = torch.empty(k, dtype=torch.int64, device=candidates.device)
    (kernel or _kernel())[(1,)](
        candidates,
        keep.view(torch.uint8),
        values,
        slot_expert,
        expert,
        slot,
        E=experts,
        S=slots,
        K=k,
        BLOCK_E=max(4, 1 << (experts - 1).bit_length()),
        BLOCK_S=max(4, 1 << (slots - 1).bit_length()),
        num_warps=1,
    )
    return expert, slot


@functools.cache
def _kernel():
    """Built on first CUDA use (Triton comes with CUDA builds of torch, not with the CPU wheel)."""
    import triton
    import triton.language as tl

    @triton.jit
    def swap_kernel(
        cand_ptr,
        keep_ptr,
        values_ptr,
        slot_expert_ptr,
        expert_ptr,
        slot_ptr,
        E: tl.constexpr,
        S: tl.constexpr,
        K: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        e = tl.arange(0, BLOCK_E)
        cand = tl.load(cand_ptr + e, mask=e < E, other=float("-inf")).to(tl.float64)
        s = tl.arange(0, BLOCK_S)
        real = s < S
        holder = tl.load(slot_expert_ptr + s, mask=real, other=-1)
        kept = tl.load(keep_ptr + tl.maximum(holder, 0), mask=real & (holder >= 0), other=0) != 0
        value = tl.load(values_ptr + tl.maximum(holder, 0), mask=real & (holder >= 0), other=0).to(tl.float64)
        # what giving a slot up costs: nothing when free, never when its holder is kept
        held = tl.where(holder >= 0, tl.where(kept, float("inf"), value), float("-inf"))
        cand_left = e < E
        slot_left = real
        for i in range(K):
            best = tl.max(tl.where(cand_left, cand, float("-inf")))
            c = tl.min(tl.where(cand_left & (cand == best), e, BLOCK_E))
            cheapest = tl.min(tl.where(slot_left, held, float("inf")))
            v = tl.min(tl.where(slot_left & (held == cheapest), s, BLOCK_S))
            admit = (best > float("-inf")) & (cheapest < float("inf"))
            tl.store(expert_ptr + i, tl.where(admit, c, -1).to(tl.int64))
            tl.store(slot_ptr + i, v.to(tl.int64))
            cand_left = cand_left & (e != c)
            slot_left = slot_left & (s != v)

    return swap_kernel
