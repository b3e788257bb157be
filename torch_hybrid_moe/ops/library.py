"""The `hybrid_moe` torch.library ops.

They take only tensors and ints: a layer is named by an integer handle into the runtime registry,
so a captured graph holds no Python object and stays valid across replays.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..runtime.registry import get_layer
from . import cpu_kernel
from .expert_math import accumulate_experts_
from .quantize import QuantizedWeight

# Host synchronisation and CPU compute inside: Inductor must not put these inside a CUDA graph.
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


def _require(condition: bool, message: Callable[[], str]) -> None:
    """torch._check for concrete tensors: the same error, without its symbolic-shape machinery (ten checks in each
    decode layer's step)."""
    if not condition:
        raise RuntimeError(message())


def _check_routing(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   check: Callable[[bool, Callable[[], str]], None] = _require) -> None:
    """The ops' shape contract; fake implementations pass torch._check (their shapes may be symbolic)."""
    check(hidden.dim() == 2, lambda: f"hidden must be [T, H], got {tuple(hidden.shape)}")
    check(topk_ids.dim() == 2, lambda: f"topk_ids must be [T, K], got {tuple(topk_ids.shape)}")
    check(topk_ids.shape == topk_weights.shape, lambda: "topk_ids and topk_weights shapes differ")
    check(topk_ids.shape[0] == hidden.shape[0], lambda: "topk_ids and hidden disagree on tokens")
    check(not topk_ids.is_floating_point(), lambda: "topk_ids must be an integer tensor")


@torch.library.custom_op(
    "hybrid_moe::dispatch",
    mutates_args=(),
    schema="(Tensor hidden, Tensor topk_ids, Tensor topk_weights, int layer) -> Tensor",
    tags=_TAGS,
)
def dispatch(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer: int) -> torch.Tensor:
    """Run each activated expert of `layer` from its slot or on the CPU, as its placement plan says."""
    _check_routing(hidden, topk_ids, topk_weights)
    return get_layer(layer).forward(hidden, topk_ids, topk_weights)


@dispatch.register_fake
def _(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer: int) -> torch.Tensor:
    _check_routing(hidden, topk_ids, topk_weights, torch._check)
    return torch.empty_like(hidden)


@torch.library.custom_op(
    "hybrid_moe::dispatch_begin",
    mutates_args=(),
    schema="(Tensor hidden, Tensor topk_ids, Tensor topk_weights, int layer, int part, Tensor carry) -> (Tensor, Tensor)",
    tags=_TAGS,
)
def dispatch_begin(
    hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer: int, part: int,
    carry: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`dispatch` in two halves, for a result needed later (Expert Deferral's deferred experts, DAOP's early
    pairs): on a captured step the CPU share is handed to the worker and this returns with it still running;
    `dispatch_end` of the same (layer, part) waits for it. `part` is runtime.graph_path's AHEAD (begun before the
    layer's plain dispatch of the step, which counts and admits for it), BEHIND (begun after a LEADING one,
    computes only, then queues the slot fills it left) or LEADING (a whole step ended at once, Expert Deferral's
    immediate half); each has its own pinned task buffers, so a half-finished step never shares them.

    Returns (fp32 partial sum, a copy of `carry`). The graph goes on with that copy instead of `carry`, so
    whatever follows it runs after the CPU share was handed over: without the data dependency Inductor may
    schedule this op, which nothing else consumes until `dispatch_end`, as late as it likes."""
    _check_routing(hidden, topk_ids, topk_weights)
    return get_layer(layer).begin(hidden, topk_ids, topk_weights, part), carry.clone()


@dispatch_begin.register_fake
def _(hidden, topk_ids, topk_weights, layer, part, carry):  # noqa: ANN001, ANN202
    _check_routing(hidden, topk_ids, topk_weights, torch._check)
    return torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device), torch.empty_like(carry)


@torch.library.custom_op(
    "hybrid_moe::dispatch_end",
    mutates_args=(),
    schema="(Tensor partial, Tensor hidden, int layer, int part, Tensor after) -> Tensor",
    tags=_TAGS,
)
def dispatch_end(partial: torch.Tensor, hidden: torch.Tensor, layer: int, part: int, after: torch.Tensor) -> torch.Tensor:
    """Finish what `dispatch_begin` started: wait for its CPU share, add it, round once to hidden's dtype.
    `after` is not read: depending on it keeps Inductor from moving the wait before the work it should overlap."""
    out = get_layer(layer).end(partial, hidden, part)
    return out.clone() if out.data_ptr() == partial.data_ptr() else out  # an op's output may not alias its input


@dispatch_end.register_fake
def _(partial, hidden, layer, part, after):  # noqa: ANN001, ANN202
    return torch.empty_like(hidden)


def cpu_experts_into(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_scale: torch.Tensor | None,
    down_scale: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """Accumulate into fp32 `out` the experts of the pairs whose id is >= 0 (-1: computed elsewhere).

    Weights are bf16 / fp16 / fp32 [E, 2I, H] and [E, H, I], or int8 / packed-int4 (uint8) with fp32 scales
    [E, N, K / group] (see ops/quantize.py). Writing into a caller-owned accumulator lets partial
    sums from several devices combine with one final rounding, and lets a captured graph point at a
    static buffer. Runs the C++ kernel; the per-expert torch loop where it could not be built.

    The body of `hybrid_moe::cpu_experts`, callable as a plain function by code already inside an op (the
    dispatch): going through the op machinery again costs ~0.17 ms per call (benchmarks/cpu_decode_costs.py).
    """
    _check_routing(hidden, topk_ids, topk_weights)
    num_experts = gate_up.shape[0]
    if topk_ids.numel():
        low, high = (int(v) for v in torch.aminmax(topk_ids))
        if low < -1 or high >= num_experts:
            raise ValueError(f"topk_ids must lie in [-1, {num_experts}), got [{low}, {high}]")
    if out.shape != hidden.shape or out.dtype != torch.float32:
        raise ValueError(f"out must be fp32 shaped like hidden {tuple(hidden.shape)}, got {out.dtype} {tuple(out.shape)}")
    if cpu_kernel.best_isa() >= 0:
        cpu_kernel.moe_experts(hidden, topk_ids, topk_weights, gate_up, down, out, gate_up_scale, down_scale)
        return
    experts = [w if s is None else QuantizedWeight.from_kernel_operands(w, s)
               for w, s in ((gate_up, gate_up_scale), (down, down_scale))]
    accumulate_experts_(out, hidden, topk_ids, topk_weights, *experts)


cpu_experts = torch.library.custom_op(
    "hybrid_moe::cpu_experts",
    mutates_args=("out",),
    schema=(
        "(Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor gate_up, Tensor down, Tensor? gate_up_scale, "
        "Tensor? down_scale, Tensor(a!) out) -> ()"
    ),
    device_types="cpu",
)(cpu_experts_into)


@cpu_experts.register_fake
def _(hidden, topk_ids, topk_weights, gate_up, down, gate_up_scale, down_scale, out) -> None:  # noqa: ANN001
    _check_routing(hidden, topk_ids, topk_weights, torch._check)


@torch.library.custom_op(
    "hybrid_moe::prefetch",
    mutates_args=(),
    schema="(Tensor hidden, Tensor topk_ids, int layer) -> Tensor",
    tags=_TAGS,
)
def prefetch(hidden: torch.Tensor, topk_ids: torch.Tensor, layer: int) -> torch.Tensor:
    """Ask `layer`'s prefetcher, given the previous layer's gate input and routing, what to copy into slots.

    Returns a copy of `hidden`, which the backend hands to the previous layer's own dispatch: Inductor orders
    ops by data alone, and this dependency makes the prefetch start before that dispatch (and keeps it)."""
    get_layer(layer).prefetch(hidden, topk_ids)
    return hidden.clone()


@prefetch.register_fake
def _(hidden: torch.Tensor, topk_ids: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(hidden)
