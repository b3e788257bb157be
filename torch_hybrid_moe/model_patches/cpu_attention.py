"""Attention of a CPU model's decode steps as plain tensor ops, which Inductor fuses into the compiled step.

torch's SDPA on the CPU runs its flash kernel also for one query. Called alone it is quick (0.11 ms for a
Qwen3-30B-A3B layer at 160 cached positions, 2 threads of an AVX-512 EPYC, `benchmarks/cpu_decode_costs.py`), but
inside the compiled decode step, between the expert kernel's and the linears' thread pools, the step with it is
~0.65 ms a layer slower than with this function
(`benchmarks/end_to_end.py --rows ours,ours-sdpa`): ~30 ms a token over 48 layers. Prompts (more than one query)
keep SDPA, which never builds the [queries x keys] matrix. The math is transformers' eager attention (fp32
softmax), with the query heads of a key / value head multiplied together instead of copying the cache per head
(grouped-query attention); masks are SDPA's (boolean, or additive), made by the same mask function as for SDPA.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

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
    ([B, Q, Hq, Dv], None). One query on the CPU, outside training: eager math; otherwise SDPA."""
    if query.shape[2] != 1 or query.device.type != "cpu" or (module.training and dropout):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    b, hq, _, d = query.shape
    hkv = key.shape[1]
    scale = d**-0.5 if scaling is None else scaling
    q = query.reshape(b, hkv, hq // hkv, d)  # the one query of each head, grouped under its key / value head
    scores = torch.matmul(q, key.transpose(2, 3)) * scale  # [B, Hkv, groups, S]
    if attention_mask is not None:  # [B or 1, 1, 1, S]
        mask = attention_mask
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs, value)  # [B, Hkv, groups, Dv]
    return out.reshape(b, hq, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def use_cpu_attention(model: torch.nn.Module) -> bool:
    """Switch a model whose attention is SDPA to `cpu_attention_forward`; False (unchanged) for any other
    implementation, which the user or the model chose."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(NAME, cpu_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    config._attn_implementation = NAME
    return True
