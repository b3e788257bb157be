"""Small helpers shared by the FX passes."""

from __future__ import annotations

import torch
import torch.fx as fx

DISPATCH = torch.ops.hybrid_moe.dispatch
PREFETCH = torch.ops.hybrid_moe.prefetch


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
