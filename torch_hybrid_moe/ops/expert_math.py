"""The SiLU-gated expert FFN over routed (token, expert) pairs, as a per-expert torch loop.

It computes the accelerator slots' share on CUDA (one batched GEMM pair per expert suits a GPU), the
CPU share where the C++ kernel cannot be built, and is the baseline the kernel benchmark compares with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .quantize import QuantizedWeight


def accumulate_experts_(
    out: torch.Tensor,
    hidden: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor | QuantizedWeight,
    down: torch.Tensor | QuantizedWeight,
) -> torch.Tensor:
    """out[t] += sum_k weights[t, k] * FFN_{expert_ids[t, k]}(hidden[t]) over pairs with id >= 0.

    hidden [T, H]; expert_ids, weights [T, K]; gate_up [E, 2I, H] (gate rows first); down [E, H, I].
    An id of -1 marks a pair computed elsewhere. Each active expert's weights are read once (a
    QuantizedWeight is dequantised one expert at a time, in fp32 as the C++ kernel computes).
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
        tokens = pairs // num_k
        x = hidden[tokens]
        w_gate_up, w_down = gate_up[e], down[e]
        if w_gate_up.dtype != x.dtype:
            x = x.to(w_gate_up.dtype)
        gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down)
        out.index_add_(0, tokens, y.to(out.dtype) * flat_w[pairs].to(out.dtype).unsqueeze(-1))
    return out
