"""The sequential CPU/GPU walks of DALI's greedy and HybriMoE's two-ended queue, as one device program.

A walk visits a layer step's experts in a fixed order and sends each to the GPU or the CPU by comparing the two
sides' running times, so every decision depends on the ones before: as tensor ops that is a dozen tiny
kernels per expert, hundreds per layer in a captured graph (benchmarks/device_scheduling.py). On CUDA one
Triton program walks the whole list in a single kernel; elsewhere a torch loop does. Both sum the same float64
times in the same order as the Python schedulers, so their choices agree exactly (tests/test_graph_path.py;
the kernels against the torch loops under Triton's interpreter in tests/test_triton_kernels.py).

The third is queue-aware placement whole (`queue_place`): its per-expert times, the three start placements (the
cached set, DALI's and HybriMoE's walks), then the local search, `queue_search`: from the fastest start, flip the
one expert that shortens the step most until none does, timing each trial as the Python `StepTimer` does with
the link idle (the CPU's experts back to back, the GPU's resident ones first, then each fetch after the copies
queued before it). Composed of torch ops it is a hundred kernel nodes a layer step; as one program, one.

Inputs of the walks, in walk order: token counts `n`, `resident` (bool), per-expert CPU and GPU seconds (float64;
for DALI the GPU time includes the copy of a missing expert), and `room`, the fetches allowed (0-d int64). Returns
the bool mask of experts sent to the GPU, in the same order.
"""

from __future__ import annotations

import functools
import struct
from typing import Any

import torch

from ..cost_model import Terms


def dali_walk(
    n: torch.Tensor, resident: torch.Tensor, cpu: torch.Tensor, gpu: torch.Tensor, room: torch.Tensor, steps: int
) -> torch.Tensor:
    """DALI's greedy: each of the first `steps` experts (an idle one, n == 0, is skipped) goes to the GPU when
    that side, with it, finishes no later than the CPU would with it, and a missing one only while room lasts."""
    if n.is_cuda:
        take = torch.zeros(n.shape, dtype=torch.int8, device=n.device)
        _kernels()[0][(1,)](n, resident.to(torch.int8), cpu, gpu, room, take, min(steps, len(n)), num_warps=1)
        return take.bool()
    cpu_t = gpu_t = torch.zeros((), dtype=torch.float64)
    take = torch.zeros_like(resident)
    for i in range(min(steps, len(n))):
        t = (n[i] > 0) & (resident[i] | (room > 0)) & (gpu_t + gpu[i] <= cpu_t + cpu[i])
        gpu_t = gpu_t + torch.where(t, gpu[i], 0.0)
        cpu_t = cpu_t + torch.where(t | (n[i] == 0), 0.0, cpu[i])
        room = room - (t & ~resident[i]).long()
        take[i] = t
    return take


def hybrimoe_walk(
    resident: torch.Tensor,
    cpu: torch.Tensor,
    gpu: torch.Tensor,
    room: torch.Tensor,
    active: torch.Tensor,
    transfer: float,
    steps: int,
) -> torch.Tensor:
    """HybriMoE's queue over its first `active` experts (0-d int64): the GPU takes from the head (a missing
    expert after its copy, `transfer` seconds, queued on an idle link; none without room), the CPU from the
    tail, whichever finishes its next expert earlier, for up to `steps` rounds (one expert each)."""
    if resident.is_cuda:
        take = torch.zeros(resident.shape, dtype=torch.int8, device=resident.device)
        transfer_t = torch.full((), transfer, dtype=torch.float64, device=resident.device)
        _kernels()[1][(1,)](
            resident.to(torch.int8),
            cpu,
            gpu,
            room,
            active,
            transfer_t,
            take,
            min(steps, len(resident)),
            len(resident),
            num_warps=1,
        )
        return take.bool()
    zero = torch.zeros(1, dtype=torch.float64)
    cpu_t, gpu_t, link = zero, zero, zero
    head, tail = torch.zeros(1, dtype=torch.int64), (active - 1).view(1)  # 1-element indices: no host read
    room = room.view(1)
    take = torch.zeros_like(resident)
    for _ in range(min(steps, len(resident))):
        live, t = head <= tail, tail.clamp(min=0)
        h = head.clamp(max=len(resident) - 1)
        missing = ~resident[h]
        ready = torch.where(missing, torch.where(room > 0, link + transfer, float("inf")), 0.0)
        gpu_end = torch.maximum(gpu_t, ready) + gpu[h]
        cpu_end = cpu_t + cpu[t]
        to_gpu = live & (gpu_end <= cpu_end)
        to_cpu = live & ~to_gpu
        take[h] = take[h] | to_gpu
        gpu_t = torch.where(to_gpu, gpu_end, gpu_t)
        cpu_t = torch.where(to_cpu, cpu_end, cpu_t)
        link = torch.where(to_gpu & missing, ready, link)
        room = room - (to_gpu & missing).long()
        head, tail = head + to_gpu.long(), tail - to_cpu.long()
    return take


def queue_search(
    active: torch.Tensor,
    resident: torch.Tensor,
    cpu: torch.Tensor,
    gpu: torch.Tensor,
    starts: torch.Tensor,
    room: torch.Tensor,
    transfer: float,
) -> torch.Tensor:
    """Queue-aware placement over the step's experts in id order (`active` marks them; the others are padding):
    the fastest of the `starts` GPU sets [3, n] (the first on a tie), then single flips, each time the one that
    shortens the step most (the lowest id on a tie), while it beats the best time by a relative 1e-9, never with
    more than `room` fetches, and at most as many flips as active experts (`schedulers.local_search`'s bound).
    Times as `_set_times`; returns the GPU set as a bool mask. The torch loop: on CUDA `queue_place` runs it inside
    its one program."""
    times = _set_times(starts, active, resident, cpu, gpu, transfer)
    first = torch.argmin(times)  # the first of equal times, as Python's min() over the starts
    take, best = starts[first], times[first]
    fetches = (take & ~resident).sum()
    flips = torch.eye(len(active), dtype=torch.bool, device=active.device)
    for flip in range(len(active)):
        trials = take[None, :] ^ flips
        change = torch.where(resident, 0, torch.where(take, -1, 1))
        allowed = active & (fetches + change <= room)
        times = torch.where(allowed, _set_times(trials, active, resident, cpu, gpu, transfer), float("inf"))
        i = torch.argmin(times)  # the lowest id among equal times
        better = (times[i] < best * (1 - 1e-9)) & (flip < active.sum())
        take = torch.where(better, trials[i], take)
        fetches = fetches + torch.where(better, change[i], 0)
        best = torch.where(better, times[i], best)
    return take


# place_kernel's float64 arguments, passed as their bits: not to be specialised on their values
_FLOAT_ARGS = [f"{side}_{term}" for side in ("cpu", "gpu") for term in Terms._fields] + ["transfer_bits"]


# one warp; no fused multiply-adds: every float64 product and sum rounds alone, as torch's ops round them
PLACE_OPTIONS = {"num_warps": 1, "enable_fp_fusion": False}


def lanes_for(n: int) -> int:
    """A Triton block covering n lanes: the next power of two, at least 4 (tl.arange's smallest useful size)."""
    return max(4, 1 << (n - 1).bit_length())


def _bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def queue_place(
    counts: torch.Tensor,
    resident: torch.Tensor,
    num_slots: int,
    max_active: int,
    cpu: Terms,
    gpu: Terms,
    transfer: float,
    kernel: Any = None,
) -> torch.Tensor:
    """Queue-aware placement of one layer step as one program: the experts' CPU and GPU times from `counts` [E]
    (float) by the `cpu` / `gpu` terms, the fetch room the `num_slots` slots leave, DALI's and HybriMoE's walks
    and the cached set as starts, then `queue_search` over the active experts (at most `max_active`, a static
    bound). Returns the bool GPU set [E]. `kernel` stands in for the compiled program (the tests pass an
    interpreted one); no op but the launch reaches the device, so a captured step holds one kernel node."""
    experts = len(counts)
    size = min(max_active, experts)
    block = lanes_for(size)
    take = torch.empty(experts, dtype=torch.int8, device=counts.device)
    scratch = torch.empty(7 * block, dtype=torch.float64, device=counts.device)
    floats = [_bits(v) for terms in (cpu, gpu) for v in terms] + [_bits(transfer)]
    (kernel or _kernels()[2])[(1,)](
        counts,
        resident.view(torch.uint8),
        take,
        scratch,
        num_slots,
        *floats,
        E=experts,
        BLOCK_E=lanes_for(experts),
        SIZE=size,
        BLOCK=block,
        **PLACE_OPTIONS,
    )
    return take.view(torch.bool)


def _set_times(
    sets: torch.Tensor,
    active: torch.Tensor,
    resident: torch.Tensor,
    cpu: torch.Tensor,
    gpu: torch.Tensor,
    transfer: float,
) -> torch.Tensor:
    """The step time of each GPU set (rows of `sets`), summed in the Python timer's order so ties break alike:
    the CPU's experts in id order; on the GPU the resident ones in id order, then the missing ones in id order,
    each after its copy, queued behind the copies before it on an idle link."""
    rows = sets.shape[0]
    cpu_t = torch.zeros(rows, dtype=torch.float64, device=sets.device)
    gpu_t, link = torch.zeros_like(cpu_t), torch.zeros_like(cpu_t)
    for j in range(sets.shape[1]):
        cpu_t = cpu_t + torch.where(active[j] & ~sets[:, j], cpu[j], 0.0)
        gpu_t = gpu_t + torch.where(sets[:, j] & resident[j], gpu[j], 0.0)
    for j in range(sets.shape[1]):
        fetch = sets[:, j] & ~resident[j]
        link = torch.where(fetch, link + transfer, link)
        gpu_t = torch.where(fetch, torch.maximum(gpu_t, link) + gpu[j], gpu_t)
    return torch.maximum(cpu_t, gpu_t)


@functools.cache
def _kernels():
    """Built on first CUDA use (Triton comes with CUDA builds of torch, not with the CPU wheel)."""
    import triton
    import triton.language as tl

    @triton.jit
    def dali_kernel(n_ptr, res_ptr, cpu_ptr, gpu_ptr, room_ptr, take_ptr, steps: tl.constexpr):
        room = tl.load(room_ptr)
        cpu_t = tl.full((), 0.0, tl.float64)
        gpu_t = tl.full((), 0.0, tl.float64)
        for i in range(steps):
            n = tl.load(n_ptr + i)
            res = tl.load(res_ptr + i) != 0
            c = tl.load(cpu_ptr + i)
            g = tl.load(gpu_ptr + i)
            t = (n > 0) & (res | (room > 0)) & (gpu_t + g <= cpu_t + c)
            gpu_t = tl.where(t, gpu_t + g, gpu_t)
            cpu_t = tl.where(t | (n == 0), cpu_t, cpu_t + c)
            room = room - (t & ~res).to(tl.int64)
            tl.store(take_ptr + i, t.to(tl.int8))

    @triton.jit
    def hybrimoe_kernel(
        res_ptr, cpu_ptr, gpu_ptr, room_ptr, active_ptr, transfer_ptr, take_ptr, steps: tl.constexpr, size
    ):
        room = tl.load(room_ptr)
        transfer = tl.load(transfer_ptr)
        tail = tl.load(active_ptr) - 1
        head = tail * 0
        cpu_t = tl.full((), 0.0, tl.float64)
        gpu_t = tl.full((), 0.0, tl.float64)
        link = tl.full((), 0.0, tl.float64)
        for _ in range(steps):
            live = head <= tail
            h = tl.minimum(head, size - 1)
            missing = tl.load(res_ptr + h) == 0
            ready = tl.where(missing, tl.where(room > 0, link + transfer, float("inf")), 0.0)
            gpu_end = tl.maximum(gpu_t, ready) + tl.load(gpu_ptr + h)
            cpu_end = cpu_t + tl.load(cpu_ptr + tl.maximum(tail, 0))
            to_gpu = live & (gpu_end <= cpu_end)
            to_cpu = live & ~to_gpu
            tl.store(take_ptr + h, tl.full((), 1, tl.int8), mask=to_gpu)
            gpu_t = tl.where(to_gpu, gpu_end, gpu_t)
            cpu_t = tl.where(to_cpu, cpu_end, cpu_t)
            link = tl.where(to_gpu & missing, ready, link)
            room = room - (to_gpu & missing).to(tl.int64)
            head = head + to_gpu.to(tl.int64)
            tail = tail - to_cpu.to(tl.int64)

    @triton.jit(do_not_specialize=_FLOAT_ARGS)
    def place_kernel(
        counts_ptr,
        res_ptr,
        take_ptr,
        scratch_ptr,
        slots,
        cpu_overhead,
        cpu_read,
        cpu_experts,
        cpu_flops,
        cpu_rate,
        gpu_overhead,
        gpu_read,
        gpu_experts,
        gpu_flops,
        gpu_rate,
        transfer_bits,
        E: tl.constexpr,
        BLOCK_E: tl.constexpr,
        SIZE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # the step over all E experts, one lane each: times, fetch room, and the three starts
        lanes = tl.arange(0, BLOCK_E)
        inside = lanes < E
        n = tl.load(counts_ptr + lanes, mask=inside, other=0).to(tl.float64)
        res = tl.load(res_ptr + lanes, mask=inside, other=0) != 0
        active = n > 0
        # float64 arguments arrive as their bits (a Python float would reach the kernel as fp32)
        c_overhead = cpu_overhead.to(tl.int64).to(tl.float64, bitcast=True)
        c_read = cpu_read.to(tl.int64).to(tl.float64, bitcast=True)
        c_experts = cpu_experts.to(tl.int64).to(tl.float64, bitcast=True)
        c_flops = cpu_flops.to(tl.int64).to(tl.float64, bitcast=True)
        c_rate = cpu_rate.to(tl.int64).to(tl.float64, bitcast=True)
        g_overhead = gpu_overhead.to(tl.int64).to(tl.float64, bitcast=True)
        g_read = gpu_read.to(tl.int64).to(tl.float64, bitcast=True)
        g_experts = gpu_experts.to(tl.int64).to(tl.float64, bitcast=True)
        g_flops = gpu_flops.to(tl.int64).to(tl.float64, bitcast=True)
        g_rate = gpu_rate.to(tl.int64).to(tl.float64, bitcast=True)
        transfer = transfer_bits.to(tl.int64).to(tl.float64, bitcast=True)
        # each side's time: `cost_model.Terms.time`, in its order of operations
        cpu = tl.where(active, c_overhead + tl.maximum(c_experts * n * c_flops / c_rate, c_read), 0.0)
        gpu = tl.where(active, g_overhead + tl.maximum(g_experts * n * g_flops / g_rate, g_read), 0.0)
        room = slots - tl.sum((active & res).to(tl.int32))
        # DALI's greedy: by (most tokens, resident first, lowest id), each to the side that ends no later with it
        key = tl.where(active, n * 2.0 + res.to(tl.float64), -1.0)
        left = active
        dali = tl.zeros((BLOCK_E,), tl.int32)
        cpu_t = tl.full((), 0.0, tl.float64)
        gpu_t = tl.full((), 0.0, tl.float64)
        r = room
        for _ in range(SIZE):
            top = tl.max(tl.where(left, key, -1.0))
            i = tl.min(tl.where(left & (key == top), lanes, BLOCK_E))
            at = lanes == i
            valid = i < BLOCK_E
            resident = tl.sum(tl.where(at & res, 1, 0)) != 0
            c = tl.sum(tl.where(at, cpu, 0.0))
            g = tl.sum(tl.where(at, gpu, 0.0))
            fetched = tl.where(resident, g, g + transfer)
            t = valid & (resident | (r > 0)) & (gpu_t + fetched <= cpu_t + c)
            gpu_t = tl.where(t, gpu_t + fetched, gpu_t)
            cpu_t = tl.where(t | ~valid, cpu_t, cpu_t + c)
            r = r - (t & ~resident).to(tl.int32)
            dali = tl.where(at & t, 1, dali)
            left = left & ~at
        # HybriMoE's queue (resident first, then most tokens, then lowest id): the GPU takes its head, the CPU
        # its tail, whichever ends its next expert earlier; a missing head after its copy on the idle link
        rank = tl.where(res, 2.0, 1.0) * 4294967296.0 + n
        left = active
        hyb = tl.zeros((BLOCK_E,), tl.int32)
        cpu_t = tl.full((), 0.0, tl.float64)
        gpu_t = tl.full((), 0.0, tl.float64)
        link = tl.full((), 0.0, tl.float64)
        r = room
        for _ in range(SIZE):
            live = tl.sum(left.to(tl.int32)) > 0
            top = tl.max(tl.where(left, rank, -1.0))
            at_h = lanes == tl.min(tl.where(left & (rank == top), lanes, BLOCK_E))
            bottom = tl.min(tl.where(left, rank, float("inf")))
            at_t = lanes == tl.max(tl.where(left & (rank == bottom), lanes, -1))
            missing = tl.sum(tl.where(at_h & res, 1, 0)) == 0
            ready = tl.where(missing, tl.where(r > 0, link + transfer, float("inf")), 0.0)
            gpu_end = tl.maximum(gpu_t, ready) + tl.sum(tl.where(at_h, gpu, 0.0))
            cpu_end = cpu_t + tl.sum(tl.where(at_t, cpu, 0.0))
            to_gpu = live & (gpu_end <= cpu_end)
            to_cpu = live & ~to_gpu
            hyb = tl.where(at_h & to_gpu, 1, hyb)
            left = left & ~((at_h & to_gpu) | (at_t & to_cpu))
            gpu_t = tl.where(to_gpu, gpu_end, gpu_t)
            cpu_t = tl.where(to_cpu, cpu_end, cpu_t)
            link = tl.where(to_gpu & missing, ready, link)
            r = r - (to_gpu & missing).to(tl.int32)
        # the active experts packed in id order into the scratch rows the search reads: cpu, gpu, resident, the
        # starts (cached, DALI, HybriMoE); zeros past them
        pos = tl.cumsum(active.to(tl.int32), 0) - 1
        active = active & (pos < SIZE)  # never more than the caller's bound: the scratch rows hold SIZE
        active_n = tl.sum(active.to(tl.int32))
        packed = tl.arange(0, BLOCK)
        zero = tl.zeros((BLOCK,), tl.float64)
        for row in range(6):
            tl.store(scratch_ptr + row * BLOCK + packed, zero, mask=packed >= active_n)
        at = scratch_ptr + pos
        tl.store(at, cpu, mask=active)
        tl.store(at + BLOCK, gpu, mask=active)
        tl.store(at + 2 * BLOCK, res.to(tl.float64), mask=active)
        tl.store(at + 3 * BLOCK, res.to(tl.float64), mask=active)
        tl.store(at + 4 * BLOCK, dali.to(tl.float64), mask=active)
        tl.store(at + 5 * BLOCK, hyb.to(tl.float64), mask=active)
        tl.debug_barrier()
        # the local search over packed lanes, one row of trials per lane, timed as `_set_times`: round 0 times the
        # three starts, every later round the current set with lane q's own expert flipped
        on = (packed < SIZE) & (packed < active_n)
        p_res = tl.load(scratch_ptr + 2 * BLOCK + packed, volatile=True) != 0
        take = tl.zeros((BLOCK,), tl.int32)
        best = tl.full((), float("inf"), tl.float64)
        fetches = tl.full((), 0, tl.int32)
        better = tl.full((), 1, tl.int1)
        q = tl.full((), 0, tl.int32)
        while better & (q <= active_n):
            cpu_rows = tl.zeros((BLOCK,), tl.float64)
            gpu_rows = tl.zeros((BLOCK,), tl.float64)
            link_rows = tl.zeros((BLOCK,), tl.float64)
            for j in range(SIZE):
                start = tl.load(
                    scratch_ptr + (3 + packed) * BLOCK + j, mask=packed < tl.where(q == 0, 3, 0), other=0, volatile=True
                )
                flipped = (tl.sum(tl.where(packed == j, take, 0)) != 0) ^ (packed == j)
                in_set = tl.where(q == 0, start, flipped.to(tl.float64)) != 0
                act = j < active_n
                resident = tl.load(scratch_ptr + 2 * BLOCK + j, volatile=True) != 0
                cpu_rows = cpu_rows + tl.where(act & ~in_set, tl.load(scratch_ptr + j, volatile=True), 0.0)
                gpu_rows = gpu_rows + tl.where(
                    tl.where(resident, in_set, False), tl.load(scratch_ptr + BLOCK + j, volatile=True), 0.0
                )
            for j in range(SIZE):
                start = tl.load(
                    scratch_ptr + (3 + packed) * BLOCK + j, mask=packed < tl.where(q == 0, 3, 0), other=0, volatile=True
                )
                flipped = (tl.sum(tl.where(packed == j, take, 0)) != 0) ^ (packed == j)
                resident = tl.load(scratch_ptr + 2 * BLOCK + j, volatile=True) != 0
                fetch = tl.where(resident, False, tl.where(q == 0, start, flipped.to(tl.float64)) != 0)
                link_rows = tl.where(fetch, link_rows + transfer, link_rows)
                gpu_rows = tl.where(
                    fetch, tl.maximum(gpu_rows, link_rows) + tl.load(scratch_ptr + BLOCK + j, volatile=True), gpu_rows
                )
            change = tl.where(p_res, 0, tl.where(take != 0, -1, 1))
            allowed = tl.where(q == 0, packed < 3, on & (fetches + change <= room))
            times = tl.where(allowed, tl.maximum(cpu_rows, gpu_rows), float("inf"))
            low = tl.min(times)
            i = tl.min(tl.where(times == low, packed, BLOCK))  # the first row of the least time
            if q == 0:
                take = tl.load(scratch_ptr + (3 + i) * BLOCK + packed, volatile=True).to(tl.int32)
                fetches = tl.sum(tl.where((take != 0) & ~p_res, 1, 0))
                best = low
            else:
                better = low < best * (1 - 1e-9)
                if better:
                    take = tl.where(packed == i, 1 - take, take)
                    fetches = fetches + tl.sum(tl.where(packed == i, change, 0))
                    best = low
            q += 1
        # back to expert ids, through a seventh row
        tl.store(scratch_ptr + 6 * BLOCK + packed, take.to(tl.float64))
        tl.debug_barrier()
        chosen = tl.load(scratch_ptr + 6 * BLOCK + pos, mask=active, other=0.0, volatile=True) != 0
        tl.store(take_ptr + lanes, (active & chosen).to(tl.int8), mask=inside)

    return dali_kernel, hybrimoe_kernel, place_kernel
