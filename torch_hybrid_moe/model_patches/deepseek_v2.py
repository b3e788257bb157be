"""DeepSeek-V2: softmax, greedy or group-limited top-k, routed scaling, shared experts, leading dense layers."""

from .base import ArchSpec, make_patch_function

SPEC = ArchSpec(
    model_type="deepseek_v2",
    block_class="DeepseekV2Moe",
    num_experts_attr="n_routed_experts",
    intermediate_attr="moe_intermediate_size",
    is_moe_layer=lambda cfg, idx: idx >= cfg.first_k_dense_replace,
    score_fn="softmax",
    renormalises=lambda cfg: False,
    routing="softmax (fp32) -> greedy or group_limited_greedy top-k -> x routed_scaling_factor (no renorm); "
    "+ shared experts; first_k_dense_replace dense",
)
patch_deepseek_v2 = make_patch_function(SPEC)
