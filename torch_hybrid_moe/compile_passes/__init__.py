"""FX passes that rewrite MoE blocks into hybrid_moe ops, and the `hybrid_moe` compile backend."""

from .backend import hybrid_moe_backend
from .moe_regions import find_experts_regions, rewrite_experts_regions
from .prefetch import insert_prefetch

__all__ = ["find_experts_regions", "hybrid_moe_backend", "insert_prefetch", "rewrite_experts_regions"]
