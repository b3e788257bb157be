"""Runtime layers for stock (unpatched) models that the compile backend rewrites.

The backend sees the experts' real parameter tensors as graph inputs, and Dynamo reuses one compiled graph
for every model of the same architecture (nothing it guards on tells two instances apart). So a compiled
graph names *sites*, not layers: before each call, `StockSites` binds every site to the layer of the
parameters that call passes in. That layer is attached to the `gate_up_proj` parameter itself, so it lives
exactly as long as the model and is found again by `stats(model)`; it is rebuilt when the parameters
changed in place since it was made (`load_state_dict`, in-place edits), were given other memory (`p.data = t`,
`model.to(dtype)`), or when the compile asks for another configuration. A compiled graph therefore never computes
with another model's experts, stale weights, or an earlier compile's options. One write is not seen: an in-place
op on `p.data` (it bypasses the version counter, as it does autograd's checks); edit `p` itself under
`torch.no_grad()`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import HybridMoEConfig
from ..ops.quantize import to_cpu_format
from .expert_store import ExpertStore, laid_out_for_kernel
from .layer import HybridMoELayer
from .registry import bind, register_layer

LAYER_ATTR = "_hybrid_moe_layer"
_SOURCE_ATTR = "_hybrid_moe_source"  # what the attached layer was built from: versions and the down tensor


def _source(gate_up: torch.Tensor, down: torch.Tensor) -> tuple:
    """Changes whenever either tensor is written in place (version counters), is given other memory, dtype or
    device (`.data = t`, `module.to`), or `down` is another tensor."""
    return tuple((w._version, w.data_ptr(), w.dtype, w.device) for w in (gate_up, down)) + (id(down),)


def layer_for_parameters(
    gate_up: torch.Tensor, down: torch.Tensor, name: str, layer_idx: int, config: HybridMoEConfig, num_layers: int
) -> HybridMoELayer:
    """The layer computing these expert weights under `config`: the attached one while it still matches the
    tensors and the config, else a new one built from the tensors as they are now (replacing it).

    num_layers: how many MoE layers share a byte budget.
    """
    layer = getattr(gate_up, LAYER_ATTR, None)
    config = config.for_device()  # as the layer holds it: an "auto" stack made concrete (no device query once it is)
    source = _source(gate_up, down)
    if (
        layer is not None
        and (layer.config is config or layer.config == config)
        and (getattr(gate_up, _SOURCE_ATTR, None) == source)
    ):
        return layer
    num_slots = config.slots_per_layer(gate_up.shape[0], gate_up[0].nbytes + down[0].nbytes, num_layers)
    host_gate_up, host_down = (
        to_cpu_format(w, config.cpu_weight_dtype, config.cpu_weight_group_size) for w in (gate_up, down)
    )
    if num_slots == 0:  # every expert computed on the CPU, in the kernel's fastest layout
        host_gate_up, host_down = laid_out_for_kernel(host_gate_up, host_down)
    store = ExpertStore(host_gate_up, host_down, num_slots, config.resolve_device(), slot_dtype=gate_up.dtype)
    layer = HybridMoELayer(name, layer_idx, store, config)
    setattr(gate_up, LAYER_ATTR, layer)
    setattr(gate_up, _SOURCE_ATTR, source)
    return layer


@dataclass(frozen=True)
class Site:
    """One rewritten experts region of a compiled graph: the handle its ops name, and where the region's
    parameters sit among the graph's inputs."""

    handle: int
    gate_up_arg: int
    down_arg: int
    name: str
    layer_idx: int


class StockSites:
    """The sites of one compiled graph and the configuration its compile asked for."""

    def __init__(self, config: HybridMoEConfig, num_layers: int) -> None:
        self.config = config.for_device()  # once: the layers' configs are then this object
        self.num_layers = num_layers
        self.sites: list[Site] = []
        self._lock = threading.Lock()  # one binding at a time: two threads may call one graph with two models

    def add(
        self, gate_up: torch.Tensor, down: torch.Tensor, gate_up_arg: int, down_arg: int, name: str, layer_idx: int
    ) -> HybridMoELayer:
        """A new site for one region of the compiling model, bound to that region's layer (returned)."""
        layer = layer_for_parameters(gate_up, down, name, layer_idx, self.config, self.num_layers)
        self.sites.append(Site(register_layer(layer), gate_up_arg, down_arg, name, layer_idx))
        return layer

    def _bind(self, args: tuple) -> None:
        for site in self.sites:
            gate_up, down = args[site.gate_up_arg], args[site.down_arg]
            bind(
                site.handle,
                layer_for_parameters(gate_up, down, site.name, site.layer_idx, self.config, self.num_layers),
            )

    def wrap(self, compiled: Callable) -> Callable:
        """`compiled`, binding every site to the calling model's layers before it runs."""
        if not self.sites:
            return compiled

        def run(*args: object) -> object:  # Dynamo calls a backend's result with the graph inputs in order
            with self._lock:
                self._bind(args)
                return compiled(*args)

        return run
