"""Uncaptured steps of `generate()` called past Dynamo once two steps have agreed.

Without a CUDA graph (on the CPU, or on CUDA with `cuda_graph=False`), every step `generate()` sends to the compiled
forward (decode steps; also prefill chunks and assisted decoding's checks) enters it through Dynamo: its frame
evaluation checks ~1,000 guards and runs the bytecode that gathers the graph's inputs from the model, the cache and
the arguments, then rebuilds the output; 0.6-1.0 ms of a ~20 ms int4 token on a 2-core CPU. Within one `generate()`
call the steps of one input signature run one compiled graph over the same parameters and cache buffers; only the
step's input tensors differ. So the `hybrid_moe` backend's callable records the arguments it is called with
(`recording`), and `DecodeReplay` sends the first two steps of a signature through Dynamo (every guard checked).
Later steps call that graph directly, with their own tensors in those places, when both recorded steps called the
same graph with the same other arguments, returned nothing but the forward's output, ran no module hook, and
changed no attribute (one level deep) of the model's modules, its configs, the cache or the cache's layers.

What is checked again at every replayed step: the input signature (shapes, strides, dtypes, aliasing, other
values), the identity of every attribute of the cache and its layers, torch's global state as Dynamo guards it
(grad and autocast modes, default dtype, deterministic flags, ...) and torch's global module hooks. What is not:
the model itself. Rebinding its parameters or attributes, or registering hooks on its modules, during one
`generate()` call is not seen until the next call, as with the CUDA graph replay (`decode_graphs.py`).
"""

from __future__ import annotations

import contextlib
import operator
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch
import torch.utils._pytree as pytree

_RECORDING = threading.local()  # per thread: another thread's compiled calls are never recorded into this one's
_PRIMITIVES = (int, float, bool, str, type(None))
_RECORD_STEPS = 2  # steps of a signature through Dynamo that must agree before the next is replayed
_MAX_SIGNATURES = 16  # more in one generate() call (an object leaf new at every step): start over rather than grow
_GLOBAL_HOOKS = tuple(
    getattr(torch.nn.modules.module, name)
    for name in (
        "_global_forward_hooks",
        "_global_forward_pre_hooks",
        "_global_backward_hooks",
        "_global_backward_pre_hooks",
    )
)


@dataclass(frozen=True)
class _Call:
    fn: Callable
    args: tuple
    result: object


def recordable(compiled: Callable) -> Callable:
    """`compiled` (a backend's result, which Dynamo calls with the graph's inputs), noting each call made while
    this thread is `recording`."""

    def run(*args: object) -> object:
        result = compiled(*args)
        calls = getattr(_RECORDING, "calls", None)
        if calls is not None:
            calls.append(_Call(compiled, args, result))
        return result

    return run


@contextlib.contextmanager
def recording() -> Iterator[list[_Call]]:
    """The calls of `recordable` callables on this thread while the block runs."""
    outer = getattr(_RECORDING, "calls", None)
    calls: list[_Call] = []
    _RECORDING.calls = calls
    try:
        yield calls
    finally:
        _RECORDING.calls = outer


@dataclass(frozen=True)
class _Replay:
    """How to call one recorded graph with a step's leaves, and rebuild the forward's output from its result."""

    fn: Callable
    args: tuple
    inputs: tuple[tuple[int, int], ...]  # (argument position, kwargs leaf index): the step's own tensors
    outputs: tuple[tuple[bool, Any], ...]  # per output leaf: (True, result index) or (False, the leaf itself)
    spec: pytree.TreeSpec


def _python_state(objects: list[object]) -> list[object]:
    """What Dynamo's bytecode may write back after a graph, as one flat list (compared by `_same_state`): every
    attribute of these objects, and the items of attributes that are dicts or lists (a module's parameters, a cache's
    layers), each preceded by their count; the values held, so that a freed one's id cannot return as another's. Flat
    rather than a tuple per attribute: a recorded step snapshots ~2,000 attributes twice, on caches the step's
    weights have just flushed (0.3-0.5 ms a snapshot against 0.9-2.5)."""
    state: list[object] = []
    for obj in objects:
        attrs = getattr(obj, "__dict__", None)
        if attrs is None:
            continue
        values = list(attrs.values())
        state.append(len(values))
        state += attrs
        state += values
        for v in values:
            if isinstance(v, dict):
                state.append(len(v))
                state += v
                state += v.values()
            elif isinstance(v, list):
                state.append(len(v))
                state += v
    return state


def _same_state(a: list[object], b: list[object]) -> bool:
    """Two `_python_state` snapshots agree: each item the same object, or primitives of one type and value."""
    if len(a) != len(b):
        return False
    return all(map(operator.is_, a, b)) or all(
        x is y or type(x) is type(y) and isinstance(x, _PRIMITIVES) and x == y for x, y in zip(a, b)
    )


def _held(leaves: list) -> list[object]:
    """The objects among a step's leaves (the cache) and their layers: state a step's graph is specialised on."""
    objects = [v for v in leaves if not isinstance(v, (torch.Tensor, *_PRIMITIVES))]
    return objects + [layer for v in objects for layer in getattr(v, "layers", ())]


def _plan(call: _Call, leaves: list, out: object) -> _Replay | None:
    """The replay of `call` (which took the step's kwargs leaves and whose forward returned `out`); None when an
    argument is neither a tensor nor an int (a dynamic size, fixed by the signature's shapes), an output tensor did
    not come from the graph, or the graph returned more than the output (values Dynamo's bytecode writes back)."""
    if not all(isinstance(a, torch.Tensor | int) for a in call.args) or not isinstance(call.result, list | tuple):
        return None
    position = {id(leaf): j for j, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)}
    inputs = tuple((i, position[id(a)]) for i, a in enumerate(call.args) if id(a) in position)
    produced = {id(r): k for k, r in enumerate(call.result)}
    out_leaves, spec = pytree.tree_flatten(out)
    outputs = []
    for leaf in out_leaves:
        if isinstance(leaf, torch.Tensor):
            if id(leaf) not in produced:
                return None
            outputs.append((True, produced[id(leaf)]))
        else:
            outputs.append((False, leaf))
    if len({k for made, k in outputs if made}) != len(call.result):
        return None
    return _Replay(call.fn, call.args, inputs, tuple(outputs), spec)


def _same(x: object, y: object) -> bool:
    """One fixed argument of two steps: the same object, or equal numbers: a dynamic size, or a module's float
    attribute, which Dynamo passes as a new 0-d float64 CPU tensor each call once it has seen two values."""
    if x is y or type(x) is type(y) is int and x == y:
        return True
    return (
        isinstance(x, torch.Tensor)
        and isinstance(y, torch.Tensor)
        and x.dim() == y.dim() == 0
        and x.dtype == y.dtype == torch.float64
        and x.device.type == y.device.type == "cpu"
        and bool(torch.equal(x, y))
    )


def _agree(a: _Replay, b: _Replay) -> bool:
    """Two steps' plans name the same graph, fixed arguments and output layout (the step's tensors aside)."""
    fixed = {i for i, _ in a.inputs}
    return (
        a.fn is b.fn
        and a.inputs == b.inputs
        and a.spec == b.spec
        and len(a.args) == len(b.args)
        and all(_same(x, y) for i, (x, y) in enumerate(zip(a.args, b.args)) if i not in fixed)
        and [(t, k if t else id(k)) for t, k in a.outputs] == [(t, k if t else id(k)) for t, k in b.outputs]
    )


@dataclass
class _Signature:
    """One input signature's steps in a `generate()` call, valid while its object leaves' attributes stay put."""

    held: tuple  # the object leaves (the cache, its layers) and their attribute values, compared by identity
    steps: list[_Replay | None] = field(default_factory=list)  # its steps so far through Dynamo
    settled: bool = False  # `_RECORD_STEPS` seen: `plan` is the graph to call, or None (Dynamo for every step)
    plan: _Replay | None = None
    state: Any = None  # torch's global state when it settled, as Dynamo guards it (a GlobalStateGuard)


class DecodeReplay:
    """The compiled forward of one `generate()` call: Dynamo for a signature's first steps, then its graph."""

    def __init__(self, model: torch.nn.Module, compiled: Callable) -> None:
        self.model = model
        self.compiled = compiled
        self.signatures: dict[tuple, _Signature] = {}
        self.replays = 0

    def __call__(self, **kwargs: object) -> object:
        key, leaves = _signature(kwargs)
        try:
            entry = self.signatures.get(key)
        except TypeError:  # a tree node whose spec cannot be hashed: Dynamo for every such step
            return self.compiled(**kwargs)
        held = _held_values(leaves)
        if entry is not None and entry.settled and entry.plan is not None:
            if not any(_GLOBAL_HOOKS) and _same_held(entry.held, held) and entry.state.check():
                self.replays += 1
                return _run(entry.plan, leaves)
            entry = None  # the cache's attributes, torch's global state or its global hooks moved: record again
        elif entry is not None and not _same_held(entry.held, held):
            entry = None
        if entry is None:
            if len(self.signatures) >= _MAX_SIGNATURES:
                self.signatures.clear()
            entry = self.signatures[key] = _Signature(held)
        if entry.settled:  # its steps disagreed: Dynamo for every step of this signature
            return self.compiled(**kwargs)
        return self._record(entry, kwargs, leaves)

    def _record(self, entry: _Signature, kwargs: dict[str, object], leaves: list) -> object:
        """One step through Dynamo, noted in `entry`: a plan, or None when it cannot be replayed."""
        modules = list(self.model.modules())
        configs = [getattr(self.model, name, None) for name in ("config", "generation_config")]
        objects = [*modules, *(c for c in configs if c is not None), *_held(leaves)]
        before = _python_state(objects)
        with recording() as calls:
            out = self.compiled(**kwargs)
        hooked = any(_GLOBAL_HOOKS) or any(m._forward_hooks or m._forward_pre_hooks for m in modules)
        clean = len(calls) == 1 and not hooked and _same_state(_python_state(objects), before)
        entry.steps.append(_plan(calls[0], leaves, out) if clean else None)
        if len(entry.steps) == _RECORD_STEPS:
            first = entry.steps[0]
            entry.settled = True
            if first is not None and all(p is not None and _agree(first, p) for p in entry.steps):
                entry.plan = entry.steps[-1]
                entry.state = torch._C._dynamo.guards.GlobalStateGuard()
            entry.steps.clear()
        return out


def _same_held(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _held_values(leaves: list) -> tuple:
    """The object leaves, their layers and every attribute value of each, held rather than copied: compared by
    identity, a changed attribute shows even where the old value's memory would have been reused."""
    return tuple(chain.from_iterable((obj, *getattr(obj, "__dict__", {}).values()) for obj in _held(leaves)))


def _signature(kwargs: dict[str, object]) -> tuple[tuple, list]:
    """(key, leaves) of a step: what a recorded graph call stands for.

    The key holds the tree's shape; each tensor leaf's shape, strides, dtype, device, grad flag and the first leaf
    it is the same tensor as (Dynamo compiles aliased inputs as one); every other leaf's type and value (objects
    by identity; their state is checked apart, `_held_values`); and the grad modes."""
    leaves, spec = pytree.tree_flatten(kwargs)
    parts: list[object] = [spec, torch.is_grad_enabled(), torch.is_inference_mode_enabled()]
    first: dict[int, int] = {}
    for j, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            alias = first.setdefault(id(leaf), j)
            parts.append((tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device, leaf.requires_grad, alias))
        else:
            parts.append((type(leaf), leaf if isinstance(leaf, _PRIMITIVES) else id(leaf)))
    return tuple(parts), leaves


def _run(plan: _Replay, leaves: list) -> object:
    args = list(plan.args)
    for i, j in plan.inputs:
        args[i] = leaves[j]
    result = plan.fn(*args)
    return pytree.tree_unflatten([result[k] if made else k for made, k in plan.outputs], plan.spec)
