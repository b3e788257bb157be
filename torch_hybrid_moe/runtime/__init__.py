"""Run-time state of patched models: expert stores, per-layer dispatch, handles and counters."""

from . import layer_ops  # registers torch.ops.hybrid_moe.dispatch / dispatch_begin / dispatch_end / prefetch
from .expert_store import ExpertStore
from .layer import HybridMoELayer
from .registry import get_layer, register_layer
from .slot_map import SlotMap
from .stats import LayerStats, model_layers, reset_stats, stats
from .stock import layer_for_parameters

__all__ = [
    "ExpertStore",
    "HybridMoELayer",
    "LayerStats",
    "get_layer",
    "layer_for_parameters",
    "model_layers",
    "SlotMap",
    "register_layer",
    "reset_stats",
    "stats",
]
