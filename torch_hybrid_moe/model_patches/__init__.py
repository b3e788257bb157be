"""Per-architecture patches for transformers MoE models, and `patch_model` which picks one by model_type."""

from __future__ import annotations

import torch

from ..config import HybridMoEConfig
from . import deepseek_v2, deepseek_v3, mixtral, qwen2_moe, qwen3_moe
from .base import ArchSpec, is_patched, patch_with_spec
from .deepseek_v2 import patch_deepseek_v2
from .deepseek_v3 import patch_deepseek_v3
from .mixtral import patch_mixtral
from .qwen2_moe import patch_qwen2_moe
from .qwen3_moe import patch_qwen3_moe

ARCHITECTURES: dict[str, ArchSpec] = {
    m.SPEC.model_type: m.SPEC for m in (mixtral, qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3)
}


def patch_model(model: torch.nn.Module, config: HybridMoEConfig | None = None, **overrides: object) -> torch.nn.Module:
    """Patch a transformers MoE model in place for hybrid expert placement, by its `config.model_type`."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ValueError(f"unsupported model type {model_type!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
    return patch_with_spec(model, ARCHITECTURES[model_type], config, **overrides)


__all__ = [
    "ARCHITECTURES",
    "is_patched",
    "patch_deepseek_v2",
    "patch_deepseek_v3",
    "patch_mixtral",
    "patch_model",
    "patch_qwen2_moe",
    "patch_qwen3_moe",
]
