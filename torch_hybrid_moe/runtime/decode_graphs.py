"""The whole decode step of `generate()` as one CUDA graph per input signature.

transformers calls `model.get_compiled_call(...)` for its decode steps (prefill stays uncaptured). For a
patched model on CUDA that call returns a `DecodeGraphs`: on the first decode step of a batch size it warms the
hybrid_moe-compiled forward up on a side stream and captures it, with every MoE layer on its replay-safe path
(`graph_path.py`), into one graph; each later step copies its inputs into the graph's static buffers and
replays it: one launch per token. The static KV cache (fixed addresses, a device-side length counter) makes
the step capturable; signatures it cannot capture run the compiled forward uncaptured. A graph reads the model's
parameters and buffers at the addresses it was captured with: each `generate()` call checks them first, and drops
its graphs where one was rebound or moved (`p.data = t`, `model.to(dtype)`); rebinding during a call is not seen
until the next one.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import chain
from typing import Any, cast

import torch
import torch.utils._pytree as pytree
from transformers.cache_utils import StaticCache, StaticLayer

from .graph_path import check_task_errors, fill_stream
from .layer import HybridMoELayer
from .stats import model_layers


def _detached(output: object) -> object:
    """A replay's output as generate() may keep it: every replay overwrites the graph's output tensors, and
    generate() stores a step's hidden states and attentions as they come (it copies only the logits), so those are
    cloned (a step asks for them only with output_hidden_states / output_attentions)."""
    fields = ("hidden_states", "attentions")
    if not isinstance(output, dict) or all(output.get(f) is None for f in fields):
        return output
    cloned = {f: pytree.tree_map(torch.clone, output[f]) for f in fields if output.get(f) is not None}
    return type(output)(**{**output, **cloned})


def _weights(model: torch.nn.Module) -> tuple:
    """Where each parameter and buffer lives: what a captured graph reads them from."""
    return tuple((t.data_ptr(), t.dtype, t.shape, t.device) for t in chain(model.parameters(), model.buffers()))


def _cache_argument(kwargs: dict[str, object]) -> str:
    """The name generate() passes the KV cache under: `cache` from transformers 5.24, `past_key_values` before."""
    return "cache" if "cache" in kwargs else "past_key_values"


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor | None]  # a static buffer per tensor leaf of the flattened arguments
    output: object


class DecodeGraphs:
    """Captures and replays `compiled(**kwargs)` of one model, keyed by shapes, dtypes, flags and cache buffers."""

    def __init__(self, model: torch.nn.Module, max_graphs: int = 8) -> None:
        self.model = model
        self.layers: list[HybridMoELayer] = list(model_layers(model).values())
        self.device = self.layers[0].store.device
        self.max_graphs = max_graphs
        self.compiled: Callable | None = None
        self.graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self.weights = _weights(model)  # where the parameters were when `graphs` were captured
        self.captures = 0
        self.replays = 0

    def get_compiled_call(self, compile_config: object) -> DecodeGraphs:
        """Stands in for the model's own method, which generate() calls once per call: compile as transformers
        would, then capture around it; graphs captured over parameters that have since moved are dropped."""
        self.compiled = type(self.model).get_compiled_call(self.model, compile_config)  # type: ignore[attr-defined]  # a transformers model's method
        weights = _weights(self.model)
        if weights != self.weights:
            self.graphs.clear()
            self.weights = weights
        return self

    def __call__(self, **kwargs: object) -> object:
        assert self.compiled is not None  # transformers calls get_compiled_call first, and calls what it returns
        signature = self._signature(kwargs)
        if signature is None:
            return self.compiled(**kwargs)
        key, leaves, _ = signature
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(key, kwargs)
        self.graphs.move_to_end(key)
        for buf, leaf in zip(entry.inputs, leaves):
            if buf is not None:
                buf.copy_(leaf, non_blocking=True)
        for layer in self.layers:
            layer.graph_path().prepare_replay()
        entry.graph.replay()
        self.replays += 1
        for layer in self.layers:
            layer.graph_path().replayed()
        check_task_errors()
        return _detached(entry.output)

    def _signature(self, kwargs: dict[str, object]) -> tuple[tuple, list, pytree.TreeSpec] | None:
        """(key, leaves, spec) of a call: what a captured graph is valid for; None when it cannot be captured.

        The arguments other than the cache are flattened as a tree (masks may come as a dict per layer type):
        tensor leaves become static input buffers, other leaves and the tree's shape are part of the key.
        """
        cache = kwargs.get(_cache_argument(kwargs))
        if type(cache) is not StaticCache or not all(
            type(layer) is StaticLayer and layer.is_initialized for layer in cache.layers
        ):
            return None
        leaves, spec = pytree.tree_flatten({k: v for k, v in kwargs.items() if k != _cache_argument(kwargs)})
        parts: list[object] = [str(spec)]
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if leaf.device != self.device:
                    return None
                parts.append((tuple(leaf.shape), leaf.dtype))
            else:
                try:
                    hash(leaf)
                except TypeError:
                    return None
                parts.append(leaf)
        # The graph reads and writes this cache's buffers and length counters: a new cache needs its own graph, even
        # where the allocator hands it the old one's addresses for some of them.
        layers: list[Any] = cache.layers  # StaticLayers, each checked above; initialised, so their tensors are set
        if not all(isinstance(layer.cumulative_length, torch.Tensor) for layer in layers):
            return None
        parts.append(
            tuple(t.data_ptr() for layer in layers for t in (layer.keys, layer.values, layer.cumulative_length))
        )
        return tuple(parts), leaves, spec

    def _capture(self, key: tuple, kwargs: dict[str, object]) -> _Captured:
        if len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)
        assert self.compiled is not None  # as in __call__, the only caller
        signature = self._signature(kwargs)
        assert signature is not None  # __call__ captures only a call `_signature` accepts
        _, leaves, spec = signature
        inputs = [leaf.clone() if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
        name = _cache_argument(kwargs)
        cache = cast(StaticCache, kwargs[name])  # as `_signature` checked
        static = {
            **pytree.tree_unflatten([b if b is not None else v for b, v in zip(inputs, leaves)], spec),
            name: cache,
        }
        # StaticLayers, as `_signature` checked: their cumulative_length is a device tensor (typed int upstream)
        cache_layers: list[Any] = cache.layers
        lengths = [layer.cumulative_length.clone() for layer in cache_layers]
        with self._graph_mode():
            # Warm up (compilation, Triton and allocator), then undo the cache length bump and the counters (the
            # KV row it wrote is rewritten by the real step; slots and cache rankings keep it, a valid state).
            counters = self._counters()
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._begin_step()
                self.compiled(**static)
                self._join_fills()
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
            check_task_errors()
            self._restore_counters(counters)
            for cache_layer, length in zip(cache_layers, lengths):
                cache_layer.cumulative_length.copy_(length)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._begin_step()
                output = self.compiled(**static)
                self._join_fills()
        self.captures += 1
        self.graphs[key] = entry = _Captured(graph, inputs, output)
        return entry

    def _counters(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """A copy of every layer's device counters (the graph path's, its mode's if any yet)."""
        return [
            (layer.graph_path().counters.clone(), None if layer.mode_counters is None else layer.mode_counters.clone())
            for layer in self.layers
        ]

    def _restore_counters(self, saved: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """Put back what `_counters` saved: the warm-up step is not a decode step."""
        for layer, (path, mode) in zip(self.layers, saved):
            layer.graph_path().counters.copy_(path)
            if mode is not None:
                assert layer.mode_counters is not None  # never reset to None once created
                layer.mode_counters.copy_(mode)
            elif layer.mode_counters is not None:  # created by the warm-up
                layer.mode_counters.zero_()

    def _begin_step(self) -> None:
        # The fill stream forks from the step's stream, so that inside a capture it is part of the graph even when
        # no layer queues work on it (a full budget): the join at the step's end then never waits on work outside.
        fill_stream(self.device).wait_stream(torch.cuda.current_stream(self.device))
        for layer in self.layers:
            layer.graph_path().begin_step()

    def _join_fills(self) -> None:
        """Slot fills overlap the following layers; the step (and its graph) ends when they are done."""
        torch.cuda.current_stream(self.device).wait_stream(fill_stream(self.device))

    @contextlib.contextmanager
    def _graph_mode(self) -> Iterator[None]:
        for layer in self.layers:
            layer.settle()
            layer.graph_path().prepare_replay()
            layer.graph_mode = True
        try:
            yield
        finally:
            for layer in self.layers:
                layer.graph_mode = False
