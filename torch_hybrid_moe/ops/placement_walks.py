"""The sequential CPU/GPU walks of DALI's greedy and HybriMoE's two-ended queue, as one device program.

A walk visits a layer step's experts in a fixed order and sends each to the GPU or the CPU by comparing the two
sides' running times, so every decision depends on the ones before: as tensor ops that is a dozen tiny
kernels per expert, hundreds per layer in a captured graph (benchmarks/device_scheduling.py). On CUDA one
Triton program walks the whole list in a single kernel; elsewhere a torch loop does. Both sum the same float64
times in the same order as the Python schedulers, so their choices agree exactly (tests/test_graph_path.py;
the kernels against the torch loops under Triton's interpreter in tests/test_triton_kernels.py).

The third program is queue-aware placement's local search (`queue_search`): from the best of three start
placements, flip the one expert that shortens the step most until none does, timing each trial as the Python
`StepTimer` does with the link idle: the CPU's experts back to back, the GPU's resident ones first, then each
fetch after the copies queued before it.

Inputs of the walks, in walk order: token counts `n`, `resident` (bool), per-expert CPU and GPU seconds (float64;
for DALI the GPU time includes the copy of a missing expert), and `room`, the fetches allowed (0-d int64). Returns
the bool mask of experts sent to the GPU, in the same order.
"""

from __future__ import annotations

import functools

import torch


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
    Times as `_set_times`; returns the GPU set as a bool mask."""
    if active.is_cuda:
        size = len(active)
        take = torch.zeros(size, dtype=torch.int8, device=active.device)
        transfer_t = torch.full((), transfer, dtype=torch.float64, device=active.device)
        block = max(4, 1 << (size - 1).bit_length())
        _kernels()[2][(1,)](
            active.to(torch.int8),
            resident.to(torch.int8),
            cpu,
            gpu,
            starts.to(torch.int8).contiguous(),
            room,
            transfer_t,
            take,
            size,
            block,
            num_warps=1,
        )
        return take.bool()
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

    @triton.jit
    def queue_kernel(
        active_ptr,
        res_ptr,
        cpu_ptr,
        gpu_ptr,
        starts_ptr,
        room_ptr,
        transfer_ptr,
        take_ptr,
        size: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # one row of trials per lane, timed as `_set_times`: round 0 times the three start sets, every later round
        # the current set with lane r's own expert flipped. `size` (the step's most active experts, a few) is a
        # compile-time constant: Triton 3.6's interpreter cannot loop over a range of a runtime value.
        lanes = tl.arange(0, BLOCK)
        inside = lanes < size
        transfer = tl.load(transfer_ptr)
        room = tl.load(room_ptr)
        active = tl.load(active_ptr + lanes, mask=inside, other=0) != 0
        res = tl.load(res_ptr + lanes, mask=inside, other=0) != 0
        rounds = tl.sum(active.to(tl.int32))
        take = tl.zeros((BLOCK,), tl.int32)
        best = tl.full((), float("inf"), tl.float64)
        fetches = tl.full((), 0, tl.int32)
        better = tl.full((), 1, tl.int1)
        r = tl.full((), 0, tl.int32)
        while better & (r <= rounds):
            cpu_t = tl.zeros((BLOCK,), tl.float64)
            gpu_t = tl.zeros((BLOCK,), tl.float64)
            link = tl.zeros((BLOCK,), tl.float64)
            for j in range(size):
                start = tl.load(starts_ptr + lanes * size + j, mask=lanes < tl.where(r == 0, 3, 0), other=0) != 0
                flipped = (tl.sum(tl.where(lanes == j, take, 0)) != 0) ^ (lanes == j)
                in_set = tl.where(r == 0, start, flipped)
                act = tl.load(active_ptr + j) != 0
                cpu_t = cpu_t + tl.where(act & ~in_set, tl.load(cpu_ptr + j), 0.0)
                gpu_t = gpu_t + tl.where(in_set & (tl.load(res_ptr + j) != 0), tl.load(gpu_ptr + j), 0.0)
            for j in range(size):
                start = tl.load(starts_ptr + lanes * size + j, mask=lanes < tl.where(r == 0, 3, 0), other=0) != 0
                flipped = (tl.sum(tl.where(lanes == j, take, 0)) != 0) ^ (lanes == j)
                fetch = tl.where(r == 0, start, flipped) & (tl.load(res_ptr + j) == 0)
                link = tl.where(fetch, link + transfer, link)
                gpu_t = tl.where(fetch, tl.maximum(gpu_t, link) + tl.load(gpu_ptr + j), gpu_t)
            change = tl.where(res, 0, tl.where(take != 0, -1, 1))
            allowed = tl.where(r == 0, lanes < 3, inside & active & (fetches + change <= room))
            times = tl.where(allowed, tl.maximum(cpu_t, gpu_t), float("inf"))
            low = tl.min(times)
            i = tl.min(tl.where(times == low, lanes, BLOCK))  # the first row of the least time
            if r == 0:
                take = tl.load(starts_ptr + i * size + lanes, mask=inside, other=0).to(tl.int32)
                fetches = tl.sum(tl.where((take != 0) & ~res, 1, 0))
                best = low
            else:
                better = low < best * (1 - 1e-9)
                if better:
                    take = tl.where(lanes == i, 1 - take, take)
                    fetches = fetches + tl.sum(tl.where(lanes == i, change, 0))
                    best = low
            r += 1
        tl.store(take_ptr + lanes, take.to(tl.int8), mask=inside)

    return dali_kernel, hybrimoe_kernel, queue_kernel
