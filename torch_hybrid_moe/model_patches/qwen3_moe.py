"""Qwen3-MoE: softmax top-k, renormalised only with norm_topk_prob; no shared experts."""

from .base import ArchSpec, make_patch_function
from .qwen_sparsity import is_qwen_moe_layer

SPEC = ArchSpec(
    model_type="qwen3_moe",
    block_class="Qwen3MoeSparseMoeBlock",
    num_experts_attr="num_experts",
    intermediate_attr="moe_intermediate_size",
    is_moe_layer=is_qwen_moe_layer,
    score_fn="softmax",
    renormalises=lambda cfg: cfg.norm_topk_prob,
    routing="softmax (fp32) -> top-k -> renormalise if norm_topk_prob; mlp_only_layers / decoder_sparse_step dense",
)
patch_qwen3_moe = make_patch_function(SPEC)
