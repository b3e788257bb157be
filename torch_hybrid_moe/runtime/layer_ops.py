"""The `hybrid_moe` ops that run a live layer's step: `dispatch`, its two halves, and `prefetch`.

They take only tensors and ints: a layer is named by an integer handle into the runtime registry, so a captured
graph holds no Python object and stays valid across replays. Registered here, beside the layer they call (as
vLLM registers its MoE forward op), so the ops package below never imports the runtime.
"""

from __future__ import annotations

import torch

from ..ops.library import TAGS, check_routing
from .registry import get_layer


@torch.library.custom_op(
    "hybrid_moe::dispatch",
    mutates_args=(),
    schema="(Tensor hidden, Tensor topk_ids, Tensor topk_weights, int layer) -> Tensor",
    tags=TAGS,
)
def dispatch(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer: int) -> torch.Tensor:
    """Run each activated expert of `layer` from its slot or on the CPU, as its placement plan says."""
    check_routing(hidden, topk_ids, topk_weights)
    return get_layer(layer).forward(hidden, topk_ids, topk_weights)


@dispatch.register_fake
def _(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer: int) -> torch.Tensor:
    check_routing(hidden, topk_ids, topk_weights, torch._check)
    return hidden.new_empty(hidden.shape)  # row-major, as the kernel's: empty_like would keep a transposed layout


@torch.library.custom_op(
    "hybrid_moe::dispatch_begin",
    mutates_args=(),
    schema="(Tensor hidden, Tensor topk_ids, Tensor topk_weights, int layer, int part, Tensor carry) "
    "-> (Tensor, Tensor)",
    tags=TAGS,
)
def dispatch_begin(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    layer: int,
    part: int,
    carry: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`dispatch` in two halves, for a result needed later (Expert Deferral's deferred experts, DAOP's early
    pairs): on a captured step the CPU share is handed to the worker and this returns with it still running;
    `dispatch_end` of the same (layer, part) waits for it. `part` is runtime.graph_path's Part: AHEAD (begun before the
    layer's plain dispatch of the step, which counts and admits for it), BEHIND (begun after a LEADING one,
    computes only, then queues the slot fills it left) or LEADING (a whole step ended at once, Expert Deferral's
    immediate half); each has its own pinned task buffers, so a half-finished step never shares them.

    Returns (fp32 partial sum, a copy of `carry`). The graph goes on with that copy instead of `carry`, so
    whatever follows it runs after the CPU share was handed over: without the data dependency Inductor may
    schedule this op, which nothing else consumes until `dispatch_end`, as late as it likes."""
    check_routing(hidden, topk_ids, topk_weights)
    return get_layer(layer).begin(hidden, topk_ids, topk_weights, part), carry.clone()


@dispatch_begin.register_fake
def _(hidden, topk_ids, topk_weights, layer, part, carry):
    check_routing(hidden, topk_ids, topk_weights, torch._check)
    return torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device), torch.empty_like(carry)


@torch.library.custom_op(
    "hybrid_moe::dispatch_end",
    mutates_args=(),
    schema="(Tensor partial, Tensor hidden, int layer, int part, Tensor after) -> Tensor",
    tags=TAGS,
)
def dispatch_end(
    partial: torch.Tensor, hidden: torch.Tensor, layer: int, part: int, after: torch.Tensor
) -> torch.Tensor:
    """Finish what `dispatch_begin` started: wait for its CPU share, add it, round once to hidden's dtype.
    `after` is not read: depending on it keeps Inductor from moving the wait before the work it should overlap."""
    out = get_layer(layer).end(partial, hidden, part)
    return out.clone() if out.data_ptr() == partial.data_ptr() else out  # an op's output may not alias its input


@dispatch_end.register_fake
def _(partial, hidden, layer, part, after):
    return hidden.new_empty(hidden.shape)


@torch.library.custom_op(
    "hybrid_moe::prefetch",
    mutates_args=(),
    schema="(Tensor hidden, Tensor topk_ids, int layer) -> Tensor",
    tags=TAGS,
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


# They change the layer's state (slot fills, admissions, statistics, a begun step): kept where their outputs are not
# read, which today only the passes' data dependencies ensure.
for _op in (dispatch, dispatch_begin, dispatch_end, prefetch):
    torch.fx.node.has_side_effect(_op._opoverload)
