"""The SiLU-gated expert FFN over routed (token, expert) pairs in torch ops.

`accumulate_experts_` is a per-expert loop: it computes the accelerator slots' share on CUDA in eager steps
(one batched GEMM pair per expert suits a GPU), the CPU share where the C++ kernel cannot be built, and is
the baseline the kernel benchmark compares with. `slot_experts_` is its capturable form for CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .quantize import QuantizedWeight, quantize_activations


def accumulate_experts_(
    out: torch.Tensor,
    hidden: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor | QuantizedWeight,
    down: torch.Tensor | QuantizedWeight,
    rounded: bool = False,
) -> torch.Tensor:
    """out[t] += sum_k weights[t, k] * FFN_{expert_ids[t, k]}(hidden[t]) over pairs with id >= 0.

    hidden [T, H]; expert_ids, weights [T, K]; gate_up [E, 2I, H] (gate rows first); down [E, H, I].
    An id of -1 marks a pair computed elsewhere. Each active expert's weights are read once (a
    QuantizedWeight is dequantised one expert at a time, in fp32 as the C++ kernel computes). With a
    QuantizedWeight, or `rounded` (slots holding dequantised int8 / int4 experts), each projection's input is
    rounded as the kernel rounds it, so in an fp32 model an expert's output does not depend on where it runs (in a
    bf16 / fp16 one, slots hold and compute in the model's dtype, which the kernel's fp32 does not round to).
    """
    num_k = expert_ids.shape[1]
    flat_ids = expert_ids.reshape(-1)
    flat_w = weights.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids + 1, minlength=gate_up.shape[0] + 1).tolist()
    start = counts[0]  # pairs marked -1 sort first
    for e, n in enumerate(counts[1:]):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        rounds = rounded or isinstance(gate_up, QuantizedWeight)
        expert_into_(out, hidden, pairs // num_k, flat_w[pairs], gate_up[e], down[e], rounds)
    return out


def expert_into_(
    out: torch.Tensor,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    rounded: bool,
    ends: torch.Tensor | None = None,
) -> None:
    """out[tokens] += weights * FFN(hidden[tokens]) for one expert's weights (`rounded`: as in
    `accumulate_experts_`); the one expert step of the per-expert loop and of the prefill staging ring. With `ends`,
    G experts at once (w_gate_up [G, 2I, H], w_down [G, H, I]; the pairs sorted by expert, expert g's ending at
    ends[g], int32 on the weights' device): one grouped GEMM per projection, where `grouped_slots` holds, instead
    of a kernel sequence per expert; the same products, rounded alike."""

    def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w) if ends is None else torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)

    x = hidden[tokens]
    if w_gate_up.dtype != x.dtype:
        x = x.to(w_gate_up.dtype)
    gate, up = project(_rounded(x, rounded), w_gate_up).chunk(2, dim=-1)
    y = project(_rounded(F.silu(gate) * up, rounded), w_down)
    out.index_add_(0, tokens, y.to(out.dtype) * weights.to(out.dtype).unsqueeze(-1))


GROUPED_MM_MAX_GROUPS = 1023  # torch._grouped_mm's CUDA kernel takes fewer than 1024 groups (its check: count < 1024)


def grouped_slots(slot_gate_up: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes these slots [S, 2I, H] with no host synchronisation: on the CPU (fp32,
    bf16, fp16), and for bf16 on NVIDIA GPUs of compute capability 9.x and 10.x, the only ones with its device kernel.
    On other GPUs it loops over the groups from a host copy of their offsets, which a CUDA graph cannot capture.
    Its operands' rows must also start 16 bytes apart: H and I must be multiples of 16 bytes, and its CUDA kernel
    takes at most GROUPED_MM_MAX_GROUPS groups (slots)."""
    if not hasattr(torch, "_grouped_mm") or slot_gate_up.dim() != 3 or slot_gate_up.shape[0] > GROUPED_MM_MAX_GROUPS:
        return False
    _, two_inter, hidden = slot_gate_up.shape
    if any(d * slot_gate_up.element_size() % 16 for d in (hidden, two_inter // 2)):
        return False
    if slot_gate_up.device.type == "cpu":
        return slot_gate_up.dtype in (torch.float32, torch.bfloat16, torch.float16)
    return (
        slot_gate_up.device.type == "cuda"
        and torch.version.hip is None  # ROCm reports 9.x for MI200 / MI300, where the loop runs too
        and slot_gate_up.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(slot_gate_up.device)[0] in (9, 10)
    )


def _rounded(x: torch.Tensor, rounds: bool) -> torch.Tensor:
    """x as an int8 / int4 expert multiplies it (rounded per 32 columns), in x's dtype; else x."""
    return quantize_activations(x).to(x.dtype) if rounds else x


def slot_experts_(
    out: torch.Tensor,
    hidden: torch.Tensor,
    slot_ids: torch.Tensor,
    weights: torch.Tensor,
    slot_gate_up: torch.Tensor,
    slot_down: torch.Tensor,
    rounded: bool = False,
    on_slots: int | None = None,
) -> torch.Tensor:
    """out[t] += sum_k weights[t, k] * FFN_{slot_ids[t, k]}(hidden[t]) over pairs with slot id >= 0, with no host
    synchronisation and only static shapes, so a CUDA graph can replay it under any routing.

    Where torch has a grouped GEMM for these weights (`grouped_slots`), the pairs are sorted by slot and each
    projection is one grouped GEMM over all slots, reading each used slot's weights in place (a slot no pair
    uses costs nothing). Elsewhere it runs min(T * K, S) slots, the used ones first (padded with unused slots
    whose rows are left out), each on all T tokens, from a gathered copy of their weights: at decode that reads and
    writes the used experts' weights once more. `rounded`: as in `accumulate_experts_`. `on_slots`: how many pairs
    have a slot id >= 0, where the caller has read it (an uncaptured step, such as a prefill): the grouped form then
    computes those rows only, not every pair of the step.
    """
    num_tokens, num_k = slot_ids.shape
    num_slots = slot_gate_up.shape[0]
    if grouped_slots(slot_gate_up):
        # the (token, k) pairs sorted by slot; pairs off the slots last, past the last group, where the GEMMs
        # leave their rows unwritten and the sum leaves them out; then summed per token over k in a fixed order
        flat = slot_ids.reshape(-1)
        on_slot = flat >= 0
        key, perm = torch.sort(torch.where(on_slot, flat, num_slots), stable=True)
        if on_slots is not None:
            key, perm = key[:on_slots], perm[:on_slots]
        counts = torch.zeros(num_slots + 1, dtype=torch.int32, device=flat.device)
        counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
        offs = torch.cumsum(counts[:num_slots], 0, dtype=torch.int32)  # each slot's end among the sorted pairs
        x = _rounded(hidden, rounded)[perm // num_k].to(slot_gate_up.dtype)
        gate, up = torch._grouped_mm(x, slot_gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        h = _rounded(F.silu(gate) * up, rounded)
        y = torch._grouped_mm(h, slot_down.transpose(-2, -1), offs=offs).float()
        sorted_weights = weights.reshape(-1)[perm].float().unsqueeze(-1)
        contribution = torch.where(on_slot[perm].unsqueeze(-1), y * sorted_weights, 0.0)  # unwritten rows: unread
        pairs = contribution.new_zeros((flat.numel(), contribution.shape[1]))
        pairs.index_copy_(0, perm, contribution)  # back in (token, k) order
        out += pairs.view(num_tokens, num_k, -1).sum(dim=1)
        return out
    valid = slot_ids >= 0
    columns = torch.where(valid, slot_ids, num_slots).long()
    dense = torch.zeros(num_tokens, num_slots + 1, dtype=torch.float32, device=hidden.device)
    dense.scatter_add_(1, columns, weights.float() * valid)
    run = min(num_tokens * num_k, num_slots)
    w_gate_up, w_down, dense = slot_gate_up, slot_down, dense[:, :num_slots]
    if run < num_slots:
        used = torch.zeros(num_slots + 1, dtype=torch.int32, device=hidden.device)
        used.scatter_add_(0, columns.flatten(), torch.ones_like(columns.flatten(), dtype=torch.int32))
        order = torch.argsort(used[:num_slots], descending=True, stable=True)[:run]
        w_gate_up, w_down, dense = slot_gate_up[order], slot_down[order], dense[:, order]
    x = _rounded(hidden, rounded).to(w_gate_up.dtype).T  # [H, T]
    gate, up = torch.matmul(w_gate_up, x).chunk(2, dim=1)  # [run, I, T] each
    h = _rounded((F.silu(gate) * up).transpose(1, 2), rounded).transpose(1, 2)
    y = torch.matmul(w_down, h)  # [run, H, T]
    # rows of a slot a token does not use are left out, not multiplied by 0: a never-filled slot holds whatever its
    # memory held, and an fp16 expert may overflow on a token it was not routed; 0 x NaN would reach the output
    y = torch.where(dense.T.unsqueeze(1) != 0, y.float(), 0.0)
    out += torch.einsum("rht,tr->th", y, dense)
    return out
