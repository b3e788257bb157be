"""Custom ops (`torch.ops.hybrid_moe.*`) and the expert kernels behind them."""

from . import decode_attention, dense_linear, greedy, latent_attention, library, prefill_attention
from .expert_math import accumulate_experts_

__all__ = [
    "accumulate_experts_",
    "decode_attention",
    "dense_linear",
    "greedy",
    "latent_attention",
    "library",
    "prefill_attention",
]
