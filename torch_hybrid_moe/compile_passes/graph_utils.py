"""Small helpers shared by the FX passes."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..runtime import layer_ops  # noqa: F401  (registers the ops named below)

DISPATCH = torch.ops.hybrid_moe.dispatch
PREFETCH = torch.ops.hybrid_moe.prefetch
DISPATCH_BEGIN = torch.ops.hybrid_moe.dispatch_begin
DISPATCH_END = torch.ops.hybrid_moe.dispatch_end


def calls(node: fx.Node, packet: torch._ops.OpOverloadPacket) -> bool:
    """True if the node calls the op, whether Dynamo recorded the packet or an overload."""
    return node.op == "call_function" and (
        node.target is packet or getattr(node.target, "overloadpacket", None) is packet
    )


def insertion_point_after(graph: fx.Graph, *nodes: fx.Node) -> fx.Node:
    """The latest of `nodes` in graph order, never in the middle of the placeholders."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    anchor = max(nodes, key=order.__getitem__)
    if anchor.op == "placeholder":
        anchor = list(graph.find_nodes(op="placeholder"))[-1]
    return anchor


def begin_after(graph: fx.Graph, node: fx.Node, args: tuple) -> fx.Node:
    """Insert `dispatch_begin(*args, carry=node)` right after `node` and route every other user of `node` through
    its carried copy, so nothing downstream runs before it; returns the node of its partial sum."""
    with graph.inserting_after(node):
        begun = graph.call_function(DISPATCH_BEGIN.default, (*args, node))
    with graph.inserting_after(begun):
        carried = graph.call_function(operator.getitem, (begun, 1))
    with graph.inserting_after(carried):
        partial = graph.call_function(operator.getitem, (begun, 0))
    node.replace_all_uses_with(carried, delete_user_cb=lambda user: user is not begun)
    for new in (begun, carried, partial):
        new.meta["nn_module_stack"] = dict(node.meta.get("nn_module_stack") or {})
    return partial


def module_paths(node: fx.Node) -> list[tuple[str, type]]:
    """The (path, class) of each module enclosing the node, outermost first (Dynamo's `nn_module_stack`)."""
    return list((node.meta.get("nn_module_stack") or {}).values())


def block_and_layer(node: fx.Node) -> tuple[str, str] | None:
    """Module paths of the MoE block holding a dispatch's experts module and of its decoder layer; None if absent."""
    stack = module_paths(node)
    for i, (_, cls) in enumerate(stack):
        if isinstance(cls, type) and hasattr(cls, "_apply_gate"):  # transformers' *Experts modules
            return (stack[i - 1][0], stack[i - 2][0]) if i >= 2 else None
    return None


def fill_example_values(gm: fx.GraphModule, original: set[fx.Node]) -> int:
    """Give each node the passes inserted (every node not in `original`, the graph as Dynamo gave it) the
    `example_value` (a fake tensor of its result) that Dynamo's own nodes carry, computed under the graph's fake mode
    from its inputs' values. AOTAutograd reuses a compiled graph from its disk cache only where every method call's
    receiver has one; without, each new process traced the decode step again (DeepSeek-V2-Lite's shape, 4 layers:
    its first step 5.2-7.0 s against 3.2-4.5 from the cache; benchmarks/RESULTS.md, 2026-12-01). Dynamo's own nodes
    are never run here: some switch torch's global state (grad mode, autocast) for real. A node whose inputs lack
    values, whose op cannot run on fake tensors, or whose result is not tensors is left as it was: a method call on it
    then bypasses the cache, as before. Returns how many were filled."""
    from torch._subclasses.fake_tensor import FakeTensor

    modes = (v.fake_mode for n in gm.graph.nodes if isinstance(v := n.meta.get("example_value"), FakeTensor))
    mode = next(modes, None)
    filled = 0
    if mode is None:
        return filled
    with mode:
        for node in gm.graph.nodes:
            if node in original or node.op not in ("call_function", "call_method") or "example_value" in node.meta:
                continue
            if any("example_value" not in a.meta for a in node.all_input_nodes):
                continue
            args, kwargs = fx.map_arg((node.args, node.kwargs), lambda a: a.meta["example_value"])
            call = node.target if node.op == "call_function" else getattr(args[0], str(node.target))
            try:
                value = call(*(args if node.op == "call_function" else args[1:]), **kwargs)
            except Exception:  # a fake-tensor limit (data-dependent output, no fake kernel): only the cache is lost
                continue
            parts = value if isinstance(value, (tuple, list)) else (value,)
            if parts and all(isinstance(v, FakeTensor) for v in parts):
                node.meta["example_value"] = value
                filled += 1
    return filled
