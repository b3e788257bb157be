"""Runtime layers for stock (unpatched) models that the compile backend rewrites.

The backend sees the experts' real parameter tensors as graph inputs; the layer is attached to the
`gate_up_proj` parameter itself, so it lives exactly as long as the model and is found again on
recompiles and by `stats(model)`.
"""

from __future__ import annotations

import torch

from ..config import HybridMoEConfig
from ..ops.quantize import to_cpu_format
from .expert_store import ExpertStore
from .layer import HybridMoELayer

LAYER_ATTR = "_hybrid_moe_layer"


def layer_for_parameters(
    gate_up: torch.Tensor, down: torch.Tensor, name: str, layer_idx: int, config: HybridMoEConfig, num_layers: int
) -> HybridMoELayer:
    """The layer owning these expert weights, created with `config` on first sight.

    num_layers: how many MoE layers share a byte budget.
    """
    layer = getattr(gate_up, LAYER_ATTR, None)
    if layer is None:
        num_slots = config.slots_per_layer(gate_up.shape[0], gate_up[0].nbytes + down[0].nbytes, num_layers)
        host = (to_cpu_format(w, config.cpu_weight_dtype, config.cpu_weight_group_size) for w in (gate_up, down))
        store = ExpertStore(*host, num_slots, config.resolve_device(), slot_dtype=gate_up.dtype)
        layer = HybridMoELayer(name, layer_idx, store, config)
        setattr(gate_up, LAYER_ATTR, layer)
    return layer
