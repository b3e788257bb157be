"""torch-hybrid-moe: run Mixture-of-Experts LLMs with experts split between accelerator slots and the CPU.

    model = thm.patch_model(model, thm.HybridMoEConfig(expert_budget=0.25))
    model = torch.compile(model, backend="hybrid_moe")

or, streaming a checkpoint's experts into place without loading them twice:

    model = thm.from_pretrained("path/or/hub-id", thm.HybridMoEConfig(expert_budget=0.25))

then `model.generate(...)`, or `thm.greedy_generate(model, input_ids, max_new_tokens)` for greedy tokens without
generate()'s per-token Python.
"""

from . import compile_passes, ops  # registers torch.ops.hybrid_moe.* and the hybrid_moe backend
from .config import HybridMoEConfig
from .generation import greedy_generate
from .loading import from_pretrained, prepare
from .model_patches import patch_model
from .runtime import LayerStats, reset_stats, stats

__all__ = [
    "HybridMoEConfig",
    "LayerStats",
    "from_pretrained",
    "greedy_generate",
    "patch_model",
    "prepare",
    "reset_stats",
    "stats",
]
__version__ = "0.1.0"
