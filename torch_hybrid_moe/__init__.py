"""torch-hybrid-moe: run Mixture-of-Experts LLMs with experts split between accelerator slots and the CPU.

    model = thm.patch_model(model, thm.HybridMoEConfig(expert_budget=0.25))
    model = torch.compile(model, backend="hybrid_moe")
"""

from . import compile_passes, ops  # registers torch.ops.hybrid_moe.* and the hybrid_moe backend
from .config import HybridMoEConfig
from .model_patches import patch_model
from .runtime import LayerStats, reset_stats, stats

__all__ = ["HybridMoEConfig", "LayerStats", "patch_model", "reset_stats", "stats"]
__version__ = "0.1.0"
