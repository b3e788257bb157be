"""Mixtral: softmax over all experts in fp32, top-k, always renormalised; no shared experts."""

from .base import ArchSpec, make_patch_function

SPEC = ArchSpec(
    model_type="mixtral",
    block_class="MixtralSparseMoeBlock",
    num_experts_attr="num_local_experts",
    intermediate_attr="intermediate_size",
    is_moe_layer=lambda cfg, idx: True,
    score_fn="softmax",
    renormalises=lambda cfg: True,
    routing="softmax (fp32) -> top-k -> renormalise; every layer sparse",
)
patch_mixtral = make_patch_function(SPEC)
