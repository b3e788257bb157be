"""The SiLU-gated expert FFN over routed (token, expert) pairs, in plain torch.

One function serves every place experts are computed (the CPU share, the accelerator slots), so
the CPU and the accelerator agree bit for bit on the same inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def accumulate_experts_(
    out: torch.Tensor,
    hidden: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """out[t] += sum_k weights[t, k] * FFN_{expert_ids[t, k]}(hidden[t]) over pairs with id >= 0.

    hidden [T, H]; expert_ids, weights [T, K]; gate_up [E, 2I, H] (gate rows first); down [E, H, I].
    An id of -1 marks a pair computed elsewhere. Each active expert's weights are read once.
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
        gate, up = F.linear(hidden[tokens], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e])
        out.index_add_(0, tokens, y.to(out.dtype) * flat_w[pairs].to(out.dtype).unsqueeze(-1))
    return out
