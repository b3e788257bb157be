"""DeepSeek-V3: sigmoid scores, bias-corrected group-limited selection, routed scaling, shared experts."""

from .base import ArchSpec, make_patch_function

SPEC = ArchSpec(
    model_type="deepseek_v3",
    block_class="DeepseekV3MoE",
    num_experts_attr="n_routed_experts",
    intermediate_attr="moe_intermediate_size",
    is_moe_layer=lambda cfg, idx: idx >= cfg.first_k_dense_replace,
    score_fn="sigmoid",
    renormalises=lambda cfg: cfg.norm_topk_prob,
    routing="sigmoid -> + e_score_correction_bias for selection -> top-2-sum groups -> top-k of kept groups; "
    "unbiased weights, renormalise if norm_topk_prob, x routed_scaling_factor; + shared experts; "
    "first_k_dense_replace dense",
)
patch_deepseek_v3 = make_patch_function(SPEC)
