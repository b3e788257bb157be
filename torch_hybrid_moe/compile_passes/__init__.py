"""FX passes that rewrite MoE blocks into hybrid_moe ops, and the `hybrid_moe` compile backend."""

from .backend import hybrid_moe_backend
from .daop_precalc import insert_daop_precalc
from .expert_deferral import insert_expert_deferral
from .moe_regions import find_experts_regions, rewrite_experts_regions
from .prefetch import insert_prefetch


def _register_backend() -> None:
    """The entry point registers `backend="hybrid_moe"` for installed copies; importing the package does it too
    (a source checkout on the path has no entry point)."""
    import torch._dynamo

    if "hybrid_moe" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(hybrid_moe_backend, name="hybrid_moe")


_register_backend()

__all__ = [
    "find_experts_regions",
    "hybrid_moe_backend",
    "insert_daop_precalc",
    "insert_expert_deferral",
    "insert_prefetch",
    "rewrite_experts_regions",
]
