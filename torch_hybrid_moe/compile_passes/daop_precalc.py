"""Pass 4 (opt-in, approximate): DAOP's decode mode, prediction-based CPU pre-calculation with graceful degradation.

At a decode step (one token per sequence), every MoE layer j of a layer configured with mode "daop_precalc"
whose decoder-block index is >= `precalc_from_layer` and whose previous MoE layer i is in the same graph:

1. Prediction. Layer j's routing is its own router applied to x_i, the hidden state that fed layer i's
   router, instead of x_j. The pass copies the model's traced routing nodes of layer j (the slice from
   the block's input to the dispatch's ids and weights, plus in-place ops on them such as DeepSeek-V3's
   group-mask `scatter_`) with x_i in place of x_j, so every architecture keeps its own softmax / sigmoid,
   group limit, top-k, renormalisation and scaling.
2. Graceful degradation (`degrade`). Given the layer's slot map when its step runs, a token keeps at most
   one predicted expert on the CPU, its best-scored one: each further CPU expert, lowest score first, is
   replaced by the best-scored GPU-resident expert the token did not select, while such alternatives last
   (none left: the rest of the original choice is kept). For top-2 this is the paper's rule. Scores are the
   router's softmax / sigmoid of the logits on x_i; alternatives are ranked by that score alone (DeepSeek-V3's
   selection bias and group limit do not restrict them). A replacement gets its own score as weight, with
   the per-token factor the model applied to its choice (w_e / s_e: scaling, and for renormalising routers
   1 / sum of the chosen scores, recomputed over the new set). Tokens with no swap keep the router's weights.
3. Pre-calculation. The selected experts that are not resident run on x_i, the resident ones on x_j, with
   complementary routing (-1 marks the pairs the other call computes). DAOP starts the first group on the
   CPU one block early: the prediction and the degradation are placed before layer i's dispatch (Inductor
   may move them, which changes nothing: no prefetcher may run with this mode, and a second half neither
   admits into slots nor counts, see `runtime.graph_path.Part.AHEAD`), `dispatch_begin` of layer j on x_i right
   after it, and `dispatch_end` at layer j, where its output is added to layer j's own `dispatch` of the
   resident pairs on x_j (data dependencies pin those two: `graph_utils.begin_after`). Inside a captured decode
   step the CPU worker computes them while layer i's block finishes and layer j's attention runs (the same
   two-halves mechanism as Expert Deferral, on the layer's second set of pinned task buffers).

Prefill stays exact, as in the paper. Dynamo specialises sizes 0 and 1, so a graph whose block input has a
static sequence length of 1 is a decode step; any other graph (a static length > 1, or a symbolic one,
which is then >= 2) is left unchanged. Earlier layers and the first MoE layer stay exact too.

Why a graph pass rather than the patched forward: the pass sees x_i, x_j and the router's traced code in one
graph, so it can replay the model's own routing on x_i without stashing tensors across modules or
re-implementing routers, and it decides decode versus prefill from static shapes. As with Expert
Deferral, the mode therefore applies to forwards compiled with `backend="hybrid_moe"` (fullgraph=True),
which includes the decode steps `generate()` compiles for a patched model; eager forwards stay exact.
The degradation reads the slot map as tensors (the device tables inside a captured step), and the counters
stay on the device, so the mode is replay-safe: nothing routing-dependent is frozen into a CUDA graph.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import cast

import torch
import torch.fx as fx

from ..ops.library import TAGS
from ..policies.prefetching import router_scores
from ..runtime import HybridMoELayer, get_layer
from ..runtime.graph_path import Part
from .graph_utils import DISPATCH, DISPATCH_END, PREFETCH, begin_after, block_and_layer, calls, module_paths


class DaopPrecalcPatternError(RuntimeError):
    """The graph does not have the shape the pass needs; nothing was changed."""


@dataclass
class PrecalcStats:
    """Routed pairs of one layer's approximated decode steps: how many the prediction changed (expert not in
    the exact top-k of x_j), how many degradation swapped to a resident expert, how many ran on x_i."""

    pairs: int = 0
    predicted_changed: int = 0
    degraded: int = 0
    early: int = 0


def precalc_stats(layers: dict[int, HybridMoELayer]) -> dict[int, PrecalcStats]:
    """Counters of the given layers (e.g. `runtime.model_layers(model)`), keyed as given; zero if never run."""
    return {
        idx: PrecalcStats()
        if layer.mode_counters is None
        else PrecalcStats(*(int(v) for v in layer.mode_counters.tolist()))
        for idx, layer in layers.items()
    }


def degrade(
    ids: torch.Tensor, weights: torch.Tensor, scores: torch.Tensor, resident: torch.Tensor, renormalise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Graceful degradation (module docstring, step 2): (ids, weights, swapped-pair mask), all [T, K].

    ids / weights: the router's top-k; scores [T, E]: its softmax / sigmoid scores; resident [E] bool.
    """
    tokens, k = ids.shape
    on_gpu = resident[ids]
    chosen = scores.gather(1, ids)
    # Rank each token's CPU pairs from the lowest score up (resident pairs last); the m lowest are swapped.
    order = torch.where(on_gpu, torch.inf, chosen).argsort(dim=1, stable=True)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(k, device=ids.device).expand(tokens, k))
    free = resident.expand(tokens, -1).clone().scatter_(1, ids, False)  # resident and not selected
    swaps = torch.minimum((~on_gpu).sum(1) - 1, free.sum(1)).clamp(min=0)
    swap = rank < swaps[:, None]
    best = scores.masked_fill(~free, -torch.inf).topk(k, dim=1).indices  # alternatives, best first
    new_ids = torch.where(swap, best.gather(1, rank), ids)
    new_scores = scores.gather(1, new_ids)
    # The model's per-token factor w / s, read off its best pair (never swapped), recomputed over the new set.
    top = weights.float().argmax(1, keepdim=True)
    factor = weights.float().gather(1, top) / chosen.gather(1, top)
    if renormalise:
        factor = factor * chosen.sum(1, keepdim=True) / new_scores.sum(1, keepdim=True)
    changed = swap.any(1, keepdim=True)
    new_weights = torch.where(changed, (factor * new_scores).to(weights.dtype), weights)
    return new_ids, new_weights, swap


@torch.library.custom_op(
    "hybrid_moe::precalc_routing",
    mutates_args=(),
    schema="(Tensor ids, Tensor weights, Tensor logits, int layer) -> (Tensor, Tensor, Tensor, Tensor)",
    tags=TAGS,
)
def precalc_routing(
    ids: torch.Tensor, weights: torch.Tensor, logits: torch.Tensor, layer: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Degrade the predicted routing against `layer`'s slot map now; (ids for x_i, ids for x_j, weights, swapped
    pairs), -1 where the other dispatch computes the pair. No host synchronisation on the replay-safe path (the
    device slot tables); uncaptured steps read the store's slot map."""
    hybrid = get_layer(layer)
    resident = hybrid.resident_mask(ids.device)
    rule = hybrid.routing
    assert rule is not None  # insert_daop_precalc adds this op only for layers with a routing rule
    scores = router_scores(logits, rule.score_fn)
    new_ids, new_weights, swap = degrade(ids.long(), weights, scores, resident, rule.renormalise)
    on_gpu = resident[new_ids]
    early, late = torch.where(on_gpu, -1, new_ids), torch.where(on_gpu, new_ids, -1)
    # row-major, as the fake kernel says, whatever the inputs' layout
    return (
        early.to(ids.dtype).contiguous(),
        late.to(ids.dtype).contiguous(),
        new_weights.contiguous(),
        swap.contiguous(),
    )


@precalc_routing.register_fake
def _(ids, weights, logits, layer):
    shape, device = ids.shape, ids.device
    return (
        torch.empty(shape, dtype=ids.dtype, device=device),
        torch.empty(shape, dtype=ids.dtype, device=device),
        torch.empty(shape, dtype=weights.dtype, device=device),
        torch.empty(shape, dtype=torch.bool, device=device),
    )


@torch.library.custom_op(
    "hybrid_moe::precalc_account",
    mutates_args=(),
    tags=TAGS,
    schema="(Tensor exact_ids, Tensor ids, Tensor swapped, Tensor early_ids, int layer) -> ()",
)
def precalc_account(
    exact_ids: torch.Tensor, ids: torch.Tensor, swapped: torch.Tensor, early_ids: torch.Tensor, layer: int
) -> None:
    """Add one step to `layer`'s PrecalcStats, on the device: predicted `ids` against the exact routing of x_j."""
    kept = (ids.long()[:, :, None] == exact_ids.long()[:, None, :]).any(2)
    step = torch.stack(
        (
            torch.full((), float(ids.numel()), dtype=torch.float64, device=ids.device),
            (~kept).sum().double(),
            swapped.sum().double(),
            (early_ids >= 0).sum().double(),
        )
    )
    hybrid = get_layer(layer)
    if hybrid.mode_counters is None or hybrid.mode_counters.device != step.device:
        hybrid.mode_counters = torch.zeros(4, dtype=torch.float64, device=step.device)
    hybrid.mode_counters += step


@precalc_account.register_fake
def _(exact_ids, ids, swapped, early_ids, layer):
    return None


torch.fx.node.has_side_effect(torch.ops.hybrid_moe.precalc_account.default)


@dataclass
class _Plan:
    dispatch: fx.Node  # layer j's
    previous: fx.Node  # layer i's dispatch
    hidden_i: fx.Node  # layer i's dispatch input (x_i, [T, H])
    block_input_i: fx.Node  # x_i as layer i's block receives it
    block_input_j: fx.Node
    routing: list[fx.Node]  # layer j's routing nodes from its block input, graph order
    logits: fx.Node
    hoisted: list[fx.Node]  # nodes the routing reads that appear after layer i's dispatch but need nothing of it


def _fail(message: str) -> DaopPrecalcPatternError:
    return DaopPrecalcPatternError(f"daop_precalc: {message}")


def _block_input(dispatch: fx.Node, graph: fx.Graph) -> fx.Node:
    """The one tensor from outside the dispatch's MoE block that the block computes from (its hidden states)."""
    found = block_and_layer(dispatch)
    if found is None:
        raise _fail(f"dispatch {dispatch.name} has no experts module inside an MoE block in its nn_module_stack")
    block = found[0]
    inside = [n for n in graph.nodes if any(path == block for path, _ in module_paths(n))]
    members = set(inside)
    inputs = {
        a
        for n in inside
        for a in n.all_input_nodes
        if a not in members
        and a.op not in ("placeholder", "get_attr")
        and isinstance(a.meta.get("example_value"), torch.Tensor)
    }
    if len(inputs) != 1:
        names = sorted(n.name for n in inputs)
        raise _fail(f"MoE block {block} should compute from exactly one outside tensor, found {names}")
    (x,) = inputs
    if x.meta["example_value"].dim() != 3:
        shape = tuple(x.meta["example_value"].shape)
        raise _fail(f"the input of MoE block {block} should be [batch, seq, hidden], got {shape}")
    return x


def _mutates(node: fx.Node) -> bool:
    if node.op == "call_method":
        name = cast(str, node.target)  # a method's name
    elif node.op == "call_function":
        if node.target is operator.setitem:
            return True
        name = getattr(node.target, "__name__", "")
    else:
        return False
    return name.endswith("_") and not name.startswith("__")


def _routing_slice(graph: fx.Graph, x: fx.Node, outputs: tuple[fx.Node, ...]) -> list[fx.Node]:
    """Nodes that compute `outputs` from `x`, in graph order, with in-place ops on them (results unused)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    wanted = set(outputs)
    while True:
        ancestors, todo = set(), list(wanted)
        while todo:
            n = todo.pop()
            if n not in ancestors and n is not x:
                ancestors.add(n)
                todo.extend(n.all_input_nodes)
        depends = {x}
        for n in sorted(ancestors, key=order.__getitem__):
            if any(a in depends for a in n.all_input_nodes):
                depends.add(n)
        nodes = depends - {x}
        extra = {u for n in nodes for u in n.users if u not in nodes and _mutates(u) and u.args and u.args[0] in nodes}
        if not extra:
            return sorted(nodes, key=order.__getitem__)
        wanted |= extra


def _hoistable(graph: fx.Graph, routing: list[fx.Node], x_j: fx.Node, prev: fx.Node, name: str) -> list[fx.Node]:
    """Nodes outside `routing` that it reads and that come after layer i's dispatch `prev` (such as a cast of the
    router weight), with what they need from after `prev`, in graph order: pure ops on values that exist before
    `prev`, so they can move before it. One that needs `prev` itself, an in-place op, or a value an in-place op
    changes after `prev` means the routing cannot run one block early."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    members, found, todo = set(routing), set(), [a for n in routing for a in n.all_input_nodes]
    while todo:
        a = todo.pop()
        if a in members or a is x_j or a in found or order[a] < order[prev]:
            continue
        if a is prev or a.op not in ("get_attr", "call_function", "call_method") or _mutates(a):
            raise _fail(
                f"the routing of {name} reads {a.name}, computed after the previous MoE layer's dispatch "
                "from its output or in place, so it cannot run one block early"
            )
        found.add(a)
        todo.extend(a.all_input_nodes)
    moved = members | found
    for a in {a for n in moved for a in n.all_input_nodes} - moved - {x_j}:
        changed = [
            u.name for u in a.users if u not in moved and _mutates(u) and u.args[0] is a and order[u] > order[prev]
        ]
        if changed:
            raise _fail(
                f"the routing of {name} reads {a.name}, which {changed} change in place after the previous "
                "MoE layer's dispatch, so it cannot run one block early"
            )
    return sorted(found, key=order.__getitem__)


def _is_linear(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "") == "linear"


def insert_daop_precalc(gm: fx.GraphModule) -> int:
    """Rewrite each qualifying layer (module docstring) of a decode graph; returns how many were rewritten."""
    graph = gm.graph
    dispatches = [n for n in graph.nodes if calls(n, DISPATCH)]
    previous = {get_layer(n.args[3]).next_handle: n for n in dispatches}
    plans: list[_Plan] = []
    # Plan everything first: a graph the pass cannot handle raises before any node changes.
    for node in dispatches:
        layer = get_layer(node.args[3])
        config = layer.config
        if config.mode != "daop_precalc" or layer.info.layer_idx < config.precalc_from_layer:
            continue
        prev = previous.get(node.args[3])
        if prev is None:  # the first MoE layer of the graph has nothing to predict from
            continue
        if layer.routing is None:
            raise _fail(f"layer {layer.name} has no routing rule: patch the model with torch_hybrid_moe.patch_model")
        x_j, x_i = _block_input(node, graph), _block_input(prev, graph)
        seq = x_j.meta["example_value"].shape[1]
        if not (isinstance(seq, int) and seq == 1):  # prefill (a symbolic length is >= 2): exact
            continue
        routing = _routing_slice(graph, x_j, (node.args[1], node.args[2]))
        logits = [n for n in routing if _is_linear(n)]
        bad = [n.name for n in routing if calls(n, DISPATCH) or calls(n, PREFETCH)]
        if len(logits) != 1 or bad or node.args[1] not in routing or node.args[2] not in routing:
            raise _fail(
                f"the routing of {layer.name} should be computed from its block input through exactly one linear "
                f"(the router logits) and no hybrid_moe op; found linears {[n.name for n in logits]}, ops {bad}"
            )
        hoisted = _hoistable(graph, routing, x_j, prev, layer.name)
        plans.append(_Plan(node, prev, prev.args[0], x_i, x_j, routing, logits[0], hoisted))

    for plan in plans:
        _rewrite(graph, plan)
    return len(plans)


def _rewrite(graph: fx.Graph, plan: _Plan) -> None:
    """Before layer i's dispatch: layer j's routing on x_i, degraded; right after it: the start of layer j's pairs
    on x_i; at layer j: the counters, its resident pairs on x_j, and the sum."""
    node = plan.dispatch
    hidden, exact_ids, _, handle = node.args
    stack = dict(node.meta.get("nn_module_stack") or {})
    env: dict[object, fx.Node] = {plan.block_input_j: plan.block_input_i}  # keyed by nodes, read by arguments
    for attr in plan.hoisted:
        plan.previous.prepend(attr)
    with graph.inserting_before(plan.previous):
        for n in plan.routing:
            env[n] = graph.node_copy(n, lambda a: env.get(a, a))
        predicted = env[node.args[1]]
        routed = graph.call_function(
            torch.ops.hybrid_moe.precalc_routing.default, (predicted, env[node.args[2]], env[plan.logits], handle)
        )
        early_ids, late_ids, weights, swapped = (graph.call_function(operator.getitem, (routed, i)) for i in range(4))
    partial = begin_after(graph, plan.previous, (plan.hidden_i, early_ids, weights, handle, int(Part.AHEAD)))
    with graph.inserting_before(node):
        account = graph.call_function(
            torch.ops.hybrid_moe.precalc_account.default, (exact_ids, predicted, swapped, early_ids, handle)
        )
    node.args = (hidden, late_ids, weights, handle)
    with graph.inserting_after(node):
        early = graph.call_function(DISPATCH_END.default, (partial, plan.hidden_i, handle, int(Part.AHEAD), node))
    with graph.inserting_after(early):
        total = graph.call_function(operator.add, (node, early))
    node.replace_all_uses_with(total, delete_user_cb=lambda user: user not in (total, early))
    for new in (routed, early_ids, late_ids, weights, swapped, account, early, total):
        new.meta["nn_module_stack"] = dict(stack)
