"""Qwen2-MoE: softmax top-k (renormalised only with norm_topk_prob) plus a sigmoid-gated shared expert."""

from .base import ArchSpec, make_patch_function
from .qwen_sparsity import is_qwen_moe_layer

SPEC = ArchSpec(
    model_type="qwen2_moe",
    block_class="Qwen2MoeSparseMoeBlock",
    num_experts_attr="num_experts",
    intermediate_attr="moe_intermediate_size",
    is_moe_layer=is_qwen_moe_layer,
    score_fn="softmax",
    renormalises=lambda cfg: cfg.norm_topk_prob,
    routing="softmax (fp32) -> top-k -> renormalise if norm_topk_prob; + sigmoid(gate) * shared expert; "
    "mlp_only_layers / decoder_sparse_step dense",
)
patch_qwen2_moe = make_patch_function(SPEC)
