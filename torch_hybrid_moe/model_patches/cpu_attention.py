"""Attention of a CPU model through `hybrid_moe::decode_attention` (decode steps, ops/decode_attention.py; MLA's
through `hybrid_moe::latent_attention`, latent_attention.py) and `hybrid_moe::prefill_attention` (prompts in bf16 on
CPUs with AVX512-BF16, ops/prefill_attention.py).

torch's SDPA on the CPU runs its flash kernel also for one query, and transformers' eager attention runs two small
batched GEMMs through oneDNN with the softmax between them: 0.19 and 0.36 ms a layer at 160 cached positions
(`benchmarks/cpu_decode_costs.py`, AMX Xeon), for about 300 KB of cache read. The decode op reads each key / value
head's cache once for the query heads that share it (grouped-query attention) and skips the positions the mask hides.
For a prompt SDPA's flash kernel reached a fifth of the CPU's bf16 rate; the prefill op multiplies with the expert
kernel's bf16 lanes. Other prompts (fp32 / fp16, head sizes not multiples of 32, no AVX512-BF16), other dtypes,
position biases, soft-capping and attention sinks (decode steps too) keep SDPA. Masks are SDPA's (boolean, or
additive), made by the same mask function as for SDPA, and a prompt without one is causal where SDPA would take it
as causal.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from ..ops import prefill_attention
from ..ops.decode_attention import DTYPES  # (and registers torch.ops.hybrid_moe.decode_attention)
from ..ops.kernel_build import extension
from .latent_attention import UP_K, absorb, absorbed_attention, expanded, is_latent_attention

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
    ([B, Q, Hq, Dv], None). Without dropout or gradients (the ops have no backward): one fp32 / bf16 / fp16 query on
    the CPU, the decode attention op; a bf16 prompt the prefill op where it runs; otherwise SDPA."""
    if hasattr(module, UP_K):  # MLA (latent_attention.py): the cached latent, absorbed for one query, else expanded
        absorbed = (
            None
            if module.training and dropout
            else absorbed_attention(module, query, key, value, attention_mask, scaling)
        )
        if absorbed is not None:
            return absorbed
        key, value = expanded(module, key, value)
    grads = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    # the ops take a mask and a scale only: position biases, soft-capping and attention sinks keep SDPA's handling
    plain = all(kwargs.get(name) is None for name in ("position_bias", "softcap", "s_aux"))
    decode = query.shape[2] == 1 and query.device.type == "cpu" and query.dtype in DTYPES
    prompt = (
        query.shape[2] > 1
        and prefill_attention.fits(query, key, value, attention_mask)
        and prefill_attention.available()
    )
    if not (plain and (decode or prompt)) or (module.training and dropout) or grads:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    if decode:
        return torch.ops.hybrid_moe.decode_attention(query, key, value, attention_mask, scale), None
    # SDPA's reading: causal only without a mask, where the module (or the call) says so; top-left aligned
    causal = attention_mask is None and (getattr(module, "is_causal", True) if is_causal is None else is_causal)
    return torch.ops.hybrid_moe.prefill_attention(query, key, value, attention_mask, scale, causal), None


def use_cpu_attention(model: torch.nn.Module) -> bool:
    """Switch a model whose attention is SDPA to `cpu_attention_forward` (its MLA modules to hand over their cached
    latent: latent_attention.py); False (unchanged) for any other implementation, which the user or the model
    chose."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    extension()  # loads the op's C++ kernel (without it the op runs its torch form)
    AttentionInterface.register(NAME, cpu_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    config._attn_implementation = NAME
    for module in model.modules():
        if is_latent_attention(module):
            absorb(module, NAME)
    return True
