"""Per-layer counters, cheap enough to update on every step."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .layer import HybridMoELayer


@dataclass
class LayerStats:
    """Counters of one MoE layer since the last reset.

    tokens: token rows routed through the layer; accelerator_experts / cpu_experts: activated
    experts computed in slots / on the CPU (summed over steps); hits / misses: activated experts
    found / not found in a slot when routing arrived; bytes_transferred: host-to-slot copies,
    cache fills, prefetches and the prefill staging ring's copies; prefetched_experts: experts copied early by the
    prefetcher; streamed_experts: experts a prefill step streamed through the staging ring (neither CPU nor slot).
    """

    tokens: int = 0
    steps: int = 0
    accelerator_experts: int = 0
    cpu_experts: int = 0
    hits: int = 0
    misses: int = 0
    bytes_transferred: int = 0
    prefetch_calls: int = 0
    prefetched_experts: int = 0
    streamed_experts: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def add_cpu_steps(self, steps: int, tokens: int, experts: int) -> None:
        """Steps of a layer with every expert on the CPU (Python's or C++'s): each active expert is a miss."""
        self.steps, self.tokens = self.steps + steps, self.tokens + tokens
        self.cpu_experts, self.misses = self.cpu_experts + experts, self.misses + experts

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, f.default)

    def as_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "hit_rate": self.hit_rate}


def model_layers(model: torch.nn.Module) -> dict[int, HybridMoELayer]:
    """The hybrid layers of a model, patched or rewritten by the backend, by decoder layer index."""
    found = {}
    for module in model.modules():
        layer = getattr(module, "_hybrid_moe_layer", None)
        if layer is None:
            layer = getattr(getattr(module, "gate_up_proj", None), "_hybrid_moe_layer", None)
        if layer is not None:
            found[layer.info.layer_idx] = layer
    return dict(sorted(found.items()))


def stats(model: torch.nn.Module) -> dict[int, LayerStats]:
    """Per-layer counters of a patched (or hybrid_moe-compiled) model, by decoder layer index."""
    return {idx: layer.stats for idx, layer in model_layers(model).items()}


def reset_stats(model: torch.nn.Module) -> None:
    for layer in model_layers(model).values():
        layer.stats.reset()
