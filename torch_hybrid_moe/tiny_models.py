"""Small random-weight models of every supported architecture, built with transformers' own classes.

For tests and the demo until trained models ship: each has several experts, top-k > 1, shared
experts where the architecture has them and a dense layer where it has them.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    MixtralConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

_COMMON: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_MLA: dict[str, Any] = dict(
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=None,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    head_dim=8,
)


def tiny_config(model_type: str) -> PretrainedConfig:
    """A 3-layer config; the layer types each architecture knows (dense, sparse) all appear."""
    if model_type == "mixtral":
        return MixtralConfig(
            **_COMMON, intermediate_size=48, num_hidden_layers=3, num_local_experts=6, num_experts_per_tok=2
        )
    if model_type in ("qwen2_moe", "qwen3_moe"):
        cls = Qwen2MoeConfig if model_type == "qwen2_moe" else Qwen3MoeConfig
        extra: dict[str, Any] = (
            {"shared_expert_intermediate_size": 40} if model_type == "qwen2_moe" else {"head_dim": 8}
        )
        return cls(
            **_COMMON,
            **extra,
            intermediate_size=64,
            moe_intermediate_size=24,
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=model_type == "qwen3_moe",
            mlp_only_layers=[1],
            decoder_sparse_step=1,
        )
    if model_type == "deepseek_v2":
        return DeepseekV2Config(
            **{**_COMMON, **_MLA},
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_shared_experts=1,
            first_k_dense_replace=1,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
        )
    if model_type == "deepseek_v3":
        return DeepseekV3Config(
            **{**_COMMON, **_MLA},
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        )
    raise ValueError(f"no tiny config for {model_type!r}")


def tiny_model(model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A randomly initialised causal LM of `tiny_config(model_type)` (see `random_model`)."""
    return random_model(tiny_config(model_type), seed, dtype)


def random_model(config: PretrainedConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A randomly initialised causal LM whose experts decide its tokens: the experts, shared experts and routers are
    drawn at fan-in scale (std 1 / sqrt(fan-in)). At transformers' std of 0.02 the routed experts added under 1% to the
    residual stream, and zeroing them all left most greedy tokens unchanged: a test comparing tokens could not see a
    broken expert. DeepSeek-V3's score-correction bias is randomised too. Drawn in fp32 and rounded to `dtype`, so
    that every dtype holds the same model: drawn in bf16, torch 2.11 with transformers 5.17 gave other weights
    altogether (the GPU box's bf16 tests then compared two unrelated models)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name or ".shared_expert" in name or name.endswith("mlp.gate.weight"):
                param.normal_(0, param.shape[-1] ** -0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.1, 0.1)
    if dtype == torch.float32:
        return model
    rounded = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    rounded.load_state_dict(model.state_dict())  # copied into its own tensors: the dtypes transformers gives them
    return rounded


TINY_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")
