"""Pass 3 (opt-in, approximate): KTransformers' Expert Deferral.

At MoE layer k (every MoE layer but the last), each token's `N` lowest-weight routed experts are
deferred: layer k's dispatch runs only the top-(K - N) pairs by weight, a second dispatch of the same
layer runs the N deferred pairs, and its output is added to the residual stream right after the next
MoE layer's block output has been added to it:

    O_k     = I_k + S_k(I_k) + R_{k-1}^def(I_{k-1}) + R_k^imm(I_k)      (R_{k-1}^def absent at the first MoE layer,
    O_last  = I_L + S_L(I_L) + R_{L-1}^def(I_{L-1}) + R_L^all(I_L)       the last one defers nothing)

with O the decoder layer's output after its MoE block. The immediate half is a whole step of the top-(K - N)
pairs (`dispatch_begin` and `dispatch_end` back to back, part `runtime.graph_path.Part.LEADING`: it counts the step
and leaves its slot fills to the deferred half, whose slot reads then need not wait for those copies). The
deferred half is split: `dispatch_begin` right after it (the graph goes on with the immediate output passed
through it), `dispatch_end` right before its output is added, after the next block's residual add (on which it
depends, so Inductor cannot move it earlier). On the replay-safe (CUDA graph) path the deferred CPU experts then
run on the CPU worker while the next decoder block's attention and GPU experts do (KTransformers' overlap); it
uses its own pinned task buffers (`runtime.graph_path.Part.BEHIND`). Elsewhere `dispatch_begin` runs the whole step
and `dispatch_end` only rounds.

The residual add is found from each MoE layer's (original) dispatch node: the nodes reachable from it
through its users while still inside the MoE block (the module enclosing the `*Experts` module in
`nn_module_stack`: a view / reshape, a shared-expert add) must leave the block through exactly one node,
and that node must be an add in the decoder layer (the module enclosing the block), i.e. transformers'
`hidden_states = residual + hidden_states`. Anything else is an error, raised before the graph changes.
The next MoE layer is the one the layer's `next_handle` names; it must be in the same graph
(compile with fullgraph=True).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..runtime import get_layer
from ..runtime.graph_path import Part
from .graph_utils import DISPATCH, DISPATCH_BEGIN, DISPATCH_END, begin_after, block_and_layer, calls, module_paths

_ADDS = {operator.add, operator.iadd, torch.add, torch.Tensor.add, torch.ops.aten.add.Tensor}


class ExpertDeferralPatternError(RuntimeError):
    """The graph does not have the shape the pass needs; nothing was changed."""


@dataclass
class _MoELayer:
    dispatch: fx.Node
    handle: int
    residual_add: fx.Node


def _block_and_layer(node: fx.Node) -> tuple[str, str]:
    found = block_and_layer(node)
    if found is None:
        raise ExpertDeferralPatternError(
            f"expert deferral: dispatch {node.name} has no experts module inside an MoE block inside a decoder "
            f"layer in its nn_module_stack ({[p for p, _ in module_paths(node)]})"
        )
    return found


def _is_add(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in _ADDS
    return node.op == "call_method" and node.target in ("add", "__add__", "__radd__")


def find_residual_add(dispatch: fx.Node) -> fx.Node:
    """The decoder layer's `residual + mlp_output` add fed by this dispatch; raises if the pattern is absent."""
    block, layer = _block_and_layer(dispatch)

    def inside(n: fx.Node) -> bool:
        return any(path == block for path, _ in module_paths(n))

    seen, todo, exits = {dispatch}, [dispatch], []
    while todo:
        for user in todo.pop().users:
            if user in seen:
                continue
            seen.add(user)
            if inside(user):
                todo.append(user)
            elif user not in exits:
                exits.append(user)
    paths = [module_paths(n)[-1][0] if module_paths(n) else None for n in exits]
    if len(exits) != 1 or not _is_add(exits[0]) or paths[0] != layer:
        raise ExpertDeferralPatternError(
            f"expert deferral: the output of dispatch {dispatch.name} (MoE block {block}) should leave the block "
            f"through exactly one add in decoder layer {layer} (residual + block output); it leaves through "
            f"{[(n.name, n.op, str(n.target), p) for n, p in zip(exits, paths)]}"
        )
    return exits[0]


def insert_expert_deferral(gm: fx.GraphModule, deferred_experts: int | None = None) -> int:
    """Split each deferring layer's dispatch into immediate and deferred calls; returns how many layers defer.

    deferred_experts: None takes each layer's `config` (mode "expert_deferral" and its `deferred_experts`;
    mode "exact" layers are left alone); an int applies that count to every layer (0: no change).
    """
    graph = gm.graph
    dispatches = [n for n in graph.nodes if calls(n, DISPATCH)]  # a layer split already has none left
    by_handle = {n.args[3]: n for n in dispatches}

    def count(handle: int) -> int:
        if deferred_experts is not None:
            return deferred_experts
        config = get_layer(handle).config
        return config.deferred_experts if config.mode == "expert_deferral" else 0

    # Plan everything first: a graph the pass cannot handle raises before any node changes.
    plans: list[tuple[_MoELayer, _MoELayer, int, int]] = []
    for node in dispatches:
        handle = node.args[3]
        n_def = count(handle)
        nxt = get_layer(handle).next_handle
        if n_def == 0 or nxt is None:  # the last MoE layer never defers
            continue
        if nxt not in by_handle:
            raise ExpertDeferralPatternError(
                f"expert deferral: layer {get_layer(handle).name} defers to the next MoE layer "
                f"({get_layer(nxt).name}), whose dispatch is not in this graph; compile with fullgraph=True"
            )
        weights = node.args[2]
        example = weights.meta.get("example_value") if isinstance(weights, fx.Node) else None
        top_k = example.shape[-1] if isinstance(example, torch.Tensor) else None
        if not isinstance(top_k, int):
            raise ExpertDeferralPatternError(f"expert deferral: top-k of dispatch {node.name} is not a static size")
        get_layer(handle).config.replace(mode="expert_deferral", deferred_experts=n_def).check_top_k(top_k)
        this = _MoELayer(node, handle, find_residual_add(node))
        after = _MoELayer(by_handle[nxt], nxt, find_residual_add(by_handle[nxt]))
        plans.append((this, after, top_k, n_def))

    for this, after, top_k, n_def in plans:
        _split(graph, this, after, top_k, n_def)
    return len(plans)


def _split(graph: fx.Graph, this: _MoELayer, after: _MoELayer, top_k: int, n_def: int) -> None:
    node = this.dispatch
    hidden, ids, weights, handle = node.args
    keep = top_k - n_def
    with graph.inserting_before(node):
        # Each token's pairs by descending weight (stable: ties keep the router's order).
        order = graph.call_function(
            operator.getitem,
            (graph.call_function(torch.sort, (weights,), {"dim": -1, "descending": True, "stable": True}), 1),
        )
        ids_sorted = graph.call_function(torch.gather, (ids, -1, order))
        w_sorted = graph.call_function(torch.gather, (weights, -1, order))

        def part(t: fx.Node, start: int, length: int) -> fx.Node:
            return graph.call_method("contiguous", (graph.call_function(torch.narrow, (t, -1, start, length)),))

        imm_ids, imm_w = part(ids_sorted, 0, keep), part(w_sorted, 0, keep)
        def_ids, def_w = part(ids_sorted, keep, n_def), part(w_sorted, keep, n_def)
    with graph.inserting_before(node):  # the immediate half: a whole step that leaves its slot fills to the other
        begun = graph.call_function(DISPATCH_BEGIN.default, (hidden, imm_ids, imm_w, handle, int(Part.LEADING), imm_w))
        first = graph.call_function(operator.getitem, (begun, 0))
        immediate = graph.call_function(DISPATCH_END.default, (first, hidden, handle, int(Part.LEADING), first))
    for new in (begun, first, immediate):
        new.meta["nn_module_stack"] = dict(node.meta.get("nn_module_stack") or {})
    node.replace_all_uses_with(immediate)
    graph.erase_node(node)
    partial = begin_after(graph, immediate, (hidden, def_ids, def_w, handle, int(Part.BEHIND)))
    residual = after.residual_add
    with graph.inserting_after(residual):
        deferred = graph.call_function(DISPATCH_END.default, (partial, hidden, handle, int(Part.BEHIND), residual))
    with graph.inserting_after(deferred):
        shaped = graph.call_method("view_as", (deferred, residual))
    with graph.inserting_after(shaped):
        total = graph.call_function(operator.add, (residual, shaped))
    residual.replace_all_uses_with(total, delete_user_cb=lambda user: user not in (deferred, shaped, total))
