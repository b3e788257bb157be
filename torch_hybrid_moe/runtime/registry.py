"""Integer handles for MoE layers, the only way compiled graphs and custom ops name a layer.

Handles are assigned in creation order, so the same program patches to the same handles (the FX
graph cache can reuse compiled code). The registry holds layers weakly: a layer lives as long as
the model that owns it.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .layer import HybridMoELayer

_layers: weakref.WeakValueDictionary[int, HybridMoELayer] = weakref.WeakValueDictionary()
_counter = itertools.count()


def register_layer(layer: HybridMoELayer) -> int:
    """A new handle naming `layer`."""
    handle = next(_counter)
    _layers[handle] = layer
    return handle


def bind(handle: int, layer: HybridMoELayer) -> None:
    """Point an existing handle at another layer: a graph compiled from a stock model names sites, not a
    model's layers, and is bound to the calling model's own layers before each call (runtime/stock.py)."""
    _layers[handle] = layer


def get_layer(handle: int) -> HybridMoELayer:
    try:
        return _layers[handle]
    except KeyError:
        raise RuntimeError(
            f"hybrid_moe layer handle {handle} is not live: the patched model it belonged to was freed"
        ) from None
