"""The sequential CPU/GPU walks of DALI's greedy and HybriMoE's two-ended queue, as one device program.

A walk visits a layer step's experts in a fixed order and sends each to the GPU or the CPU by comparing the two
sides' running times, so every decision depends on the ones before: as tensor ops that is a dozen tiny
kernels per expert, hundreds per layer in a captured graph (benchmarks/device_scheduling.py). On CUDA one
Triton program walks the whole list in a single kernel; elsewhere a torch loop does. Both sum the same float64
times in the same order as the Python schedulers, so their choices agree exactly (tests/test_graph_path.py;
the kernels against the torch loops under Triton's interpreter in tests/test_triton_kernels.py).

Inputs, in walk order: token counts `n`, `resident` (bool), per-expert CPU and GPU seconds (float64; for DALI
the GPU time includes the copy of a missing expert), and `room`, the fetches allowed (0-d int64). Returns the
bool mask of experts sent to the GPU, in the same order.
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

    return dali_kernel, hybrimoe_kernel
