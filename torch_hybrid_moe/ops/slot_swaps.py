"""Which missing experts take which expert slots in a captured step, and the slot tables' update, as device
programs.

A scheduler's on-demand fetches and the gate prefetch both pair the best candidates with the slots the cache
gives up first (policies/device_caching.py, `_swap_in`). Composed of torch ops that is two sorts, gathers and
masks: some twenty kernel nodes a layer step. As one Triton program (`swap_in`) it is one node, and every tie
goes as the Python path's `choose_slot` breaks it: the lowest slot. Each admission then rewrites both slot tables
(`claim_slots`): three masked scatters with static shapes, another twenty nodes, or one program.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .placement_walks import lanes_for


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
    [k] (-1 where no copy happens) and slots [k], int64; k must not exceed the slots. `kernel`: an interpreted
    stand-in (tests)."""
    experts, slots = len(candidates), len(slot_expert)
    if k > slots:  # every pair names a real slot: the tables' update indexes by it
        raise ValueError(f"swap_in: {k} pairs asked of {slots} slots")
    expert = torch.empty(k, dtype=torch.int64, device=candidates.device)
    slot = torch.empty(k, dtype=torch.int64, device=candidates.device)
    (kernel or _kernels()[0])[(1,)](
        candidates,
        keep.view(torch.uint8),
        values,
        slot_expert,
        expert,
        slot,
        E=experts,
        S=slots,
        K=k,
        BLOCK_E=lanes_for(experts),
        BLOCK_S=lanes_for(slots),
        num_warps=1,
    )
    return expert, slot


def claim_slots(
    expert: torch.Tensor, slot: torch.Tensor, expert_slot: torch.Tensor, slot_expert: torch.Tensor, kernel: Any = None
) -> None:
    """Each admitted expert[i] (>= 0; -1: none) takes slot[i] in the tables `expert_slot` [E] (-1: not resident)
    and `slot_expert` [S] (-1: free), in place; the slot's holder leaves. The pairs must name distinct missing
    experts and distinct slots, as every admission, fetch and prefetch makes them (the program relies on it).
    One program on CUDA (`kernel`: an interpreted stand-in, tests); torch ops elsewhere."""
    if expert_slot.is_cuda or kernel is not None:
        (kernel or _kernels()[1])[(1,)](expert, slot, expert_slot, slot_expert, K=len(expert), num_warps=1)
        return
    admit = expert >= 0
    evicted = slot_expert[slot]
    _set_rows(expert_slot, torch.where(admit & (evicted >= 0), evicted, len(expert_slot)), -1)
    _set_rows(expert_slot, torch.where(admit, expert, len(expert_slot)), slot)
    _set_rows(slot_expert, torch.where(admit, slot, len(slot_expert)), expert)


def _set_rows(table: torch.Tensor, index: torch.Tensor, value: torch.Tensor | int) -> None:
    """table[index[i]] = value[i], where index == len(table) means "skip": a masked scatter with static shapes."""
    padded = torch.cat((table, table.new_full((1,), -1)))
    padded[index] = value if isinstance(value, torch.Tensor) else torch.full_like(index, value)
    table.copy_(padded[:-1])


@functools.cache
def _kernels():
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

    @triton.jit
    def claim_kernel(expert_ptr, slot_ptr, expert_slot_ptr, slot_expert_ptr, K: tl.constexpr):
        # pair by pair; no pair reads what another writes (distinct slots; the holders are resident, the newcomers
        # missing), so the order is free
        for i in range(K):
            e = tl.load(expert_ptr + i)
            s = tl.load(slot_ptr + i)
            admit = e >= 0
            holder = tl.load(slot_expert_ptr + s, mask=admit, other=-1)
            tl.store(expert_slot_ptr + holder, tl.full((), -1, tl.int64), mask=admit & (holder >= 0))
            tl.store(expert_slot_ptr + e, s.to(tl.int64), mask=admit)
            tl.store(slot_expert_ptr + s, e.to(tl.int64), mask=admit)

    return swap_kernel, claim_kernel
