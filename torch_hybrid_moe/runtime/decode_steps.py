"""The decode steps of `generate()` on the CPU: Dynamo's guards checked once per signature, not once per token.

transformers calls `model.get_compiled_call(...)` once per `generate()`, then the compiled forward once per token.
Dynamo checks about a thousand guards on each call (every module, parameter, config value and cache field the
forward reads): about 0.5 ms a token on a 2-core CPU, 3% of an int4 Qwen3-MoE token. Within one `generate()`
nothing those guards watch changes between decode steps: the arguments are the same kinds of tensors at new
positions. So the first step of each signature (the arguments' tree, shapes, strides, dtypes, other values and
cache buffers; `step_signature`) runs with every guard, and the later steps of that signature in the same
`generate()` with Dynamo's differentiating guards only (`set_stance(skip_guard_eval_unsafe=True)`). The CUDA path
(decode_graphs.py) goes further on the same key: it replays a captured graph, with no guards at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.utils._pytree as pytree
from transformers.cache_utils import StaticCache, StaticLayer


def cache_argument(kwargs: dict[str, object]) -> str:
    """The name generate() passes the KV cache under: `cache` from transformers 5.24, `past_key_values` before."""
    return "cache" if "cache" in kwargs else "past_key_values"


def step_signature(kwargs: dict[str, object], device: torch.device) -> tuple[tuple, list[Any], pytree.TreeSpec] | None:
    """(key, leaves, spec) of a decode call: what a replayed step is valid for; None when it cannot be replayed
    (no initialised static cache, a tensor on another device, an unhashable argument).

    The arguments other than the cache are flattened as a tree (masks may come as a dict per layer type): tensor
    leaves key by shape, stride, dtype and grad flag, other leaves by value, and the tree's shape is part of the key.
    """
    name = cache_argument(kwargs)
    cache = kwargs.get(name)
    if type(cache) is not StaticCache or not all(
        type(layer) is StaticLayer and layer.is_initialized for layer in cache.layers
    ):
        return None
    leaves, spec = pytree.tree_flatten({k: v for k, v in kwargs.items() if k != name})
    parts: list[object] = [str(spec)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if leaf.device != device:
                return None
            parts.append((tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.requires_grad))
        else:
            try:
                hash(leaf)
            except TypeError:
                return None
            parts.append(leaf)
    # A step writes into this cache's buffers: another cache object is another signature.
    static_layers = cast(list[StaticLayer], cache.layers)  # each checked above
    parts.append(
        tuple(t.data_ptr() for layer in static_layers for t in (layer.keys, layer.values))  # type: ignore[union-attr]  # initialised: set
    )
    return tuple(parts), leaves, spec


def _stance_is_default() -> bool:
    """Whether Dynamo runs at its default stance (not forced eager, no guards skipped already): only then may a step
    change it for its own call. Where this torch does not say, the steps keep every guard."""
    stance = getattr(torch._dynamo.eval_frame, "_stance", None)
    if stance is None:
        return False
    return (stance.stance, stance.skip_guard_eval_unsafe, stance.backend) == ("default", False, None)


class DecodeSteps:
    """Stands in for a CPU model's `get_compiled_call`: the compiled forward, full guards on each signature's first
    step in a `generate()`, differentiating guards only on its later steps."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.compiled: Callable | None = None
        self.checked: set[tuple] = set()
        self.guarded = 0  # steps run with every guard
        self.skipped = 0  # steps run with the differentiating guards only

    def get_compiled_call(self, compile_config: object) -> DecodeSteps:
        """Compile as transformers would; a new `generate()` checks every guard again on its first steps."""
        self.compiled = type(self.model).get_compiled_call(self.model, compile_config)  # type: ignore[attr-defined]  # a transformers model's method
        self.checked = set()
        return self

    def __call__(self, **kwargs: object) -> object:
        assert self.compiled is not None  # transformers calls get_compiled_call first, and calls what it returns
        signature = step_signature(kwargs, self.device)
        if signature is None or signature[0] not in self.checked or not _stance_is_default():
            out = self.compiled(**kwargs)
            self.guarded += 1
            if signature is not None:
                self.checked.add(signature[0])
            return out
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            out = self.compiled(**kwargs)
        self.skipped += 1
        return out
