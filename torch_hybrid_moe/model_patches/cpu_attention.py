"""Attention of a CPU model's decode steps through `hybrid_moe::decode_attention` (ops/decode_attention.py).

torch's SDPA on the CPU runs its flash kernel also for one query, and transformers' eager attention runs two small
batched GEMMs through oneDNN with the softmax between them: 0.19 and 0.36 ms a layer at 160 cached positions
(`benchmarks/cpu_decode_costs.py`, AMX Xeon), for about 300 KB of cache read. The op reads each key / value head's
cache once for the query heads that share it (grouped-query attention) and skips the positions the mask hides.
Prompts (more than one query), and dtypes other than fp32 / bf16 / fp16, keep SDPA. Masks are SDPA's (boolean, or
additive), made by the same mask function as for SDPA.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from ..ops.decode_attention import DTYPES  # (and registers torch.ops.hybrid_moe.decode_attention)
from ..ops.kernel_build import extension

NAME = "hybrid_moe_cpu"


def cpu_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [B, Hq, Q, D], key [B, Hkv, S, D], value [B, Hkv, S, Dv] ->
    ([B, Q, Hq, Dv], None). One fp32 / bf16 / fp16 query on the CPU, without dropout or gradients: the decode
    attention op (which has no backward); otherwise SDPA."""
    grads = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    other = query.shape[2] != 1 or query.device.type != "cpu" or query.dtype not in DTYPES
    if other or (module.training and dropout) or grads:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return torch.ops.hybrid_moe.decode_attention(query, key, value, attention_mask, scale), None


def use_cpu_attention(model: torch.nn.Module) -> bool:
    """Switch a model whose attention is SDPA to `cpu_attention_forward`; False (unchanged) for any other
    implementation, which the user or the model chose."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    extension()  # loads the op's C++ kernel (without it the op runs its torch form)
    AttentionInterface.register(NAME, cpu_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    config._attn_implementation = NAME
    return True
