"""Integer handles for MoE layers, the only way compiled graphs and custom ops name a layer.

Handles are assigned in creation order, so the same program patches to the same handles (the FX
graph cache can reuse compiled code). The registry holds layers weakly: a layer lives as long as
the model that owns it.

A compiled graph bakes handles in as constants and Dynamo guards on them, so a new handle for every
layer would recompile the model for every patched copy (and hit Dynamo's recompile limit after 8). A
layer registered with a `key` (everything of it that compile passes read) therefore takes the lowest
handle a freed layer with the same key gave back: a graph compiled for the freed layer is exactly right
for the new one, and sweeping configurations in one process reuses compiled code instead of piling it up.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Hashable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .layer import HybridMoELayer

_layers: weakref.WeakValueDictionary[int, HybridMoELayer] = weakref.WeakValueDictionary()
_counter = itertools.count()
_free: dict[Hashable, set[int]] = {}  # key -> handles of freed layers registered with that key
# Models patched (or stock graphs building layers) in two threads must not take one freed handle twice, nor a freed
# layer's finalizer change a set another thread is reading: every change to the tables holds this lock. Reentrant:
# a finalizer may run, by garbage collection, inside a locked section of the same thread.
_lock = threading.RLock()


def _give_back(key: Hashable, handle: int) -> None:
    with _lock:
        _free.setdefault(key, set()).add(handle)


def register_layer(layer: HybridMoELayer, key: Hashable | None = None) -> int:
    """A handle naming `layer`: a freed one registered with the same `key` if there is one, else a new one."""
    with _lock:
        free = _free.get(key) if key is not None else None
        handle = min(free) if free else next(_counter)
        if free:
            free.discard(handle)
        _layers[handle] = layer
        if key is not None:
            weakref.finalize(layer, _give_back, key, handle)
    layer.publish(handle)
    return handle


def bind(handle: int, layer: HybridMoELayer) -> None:
    """Point an existing handle at another layer: a graph compiled from a stock model names sites, not a
    model's layers, and is bound to the calling model's own layers before each call (runtime/stock.py)."""
    with _lock:
        if _layers.get(handle) is layer:
            return
        _layers[handle] = layer
    layer.publish(handle)


def get_layer(handle: int) -> HybridMoELayer:
    try:
        return _layers[handle]
    except KeyError:
        raise RuntimeError(
            f"hybrid_moe layer handle {handle} is not live: the patched model it belonged to was freed"
        ) from None
