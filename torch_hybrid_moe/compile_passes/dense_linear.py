"""Passes: CPU linear layers with bf16 / fp16 weights run through `hybrid_moe::linear` where that was measured
faster on this machine (ops/dense_linear.py), up to the token count where they stopped winning (a graph traced for
a fixed token count within it calls the kernel's `hybrid_moe::matvecs` directly); and sibling
`hybrid_moe::matvecs` calls that read one input (attention's q / k / v, a shared expert's gate / up) become one call.

Only weights that are graph inputs (parameters) and only graphs compiled without autograd: the op has no
backward. The choice is made here, once per weight shape, and baked into the graph.
"""

from __future__ import annotations

import bisect
import operator
from typing import cast

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..ops import dense_linear
from ..ops.quantize import weight_rows
from .graph_utils import calls

_LINEAR = {torch._C._nn.linear, F.linear, torch.ops.aten.linear.default}
_MATVECS = torch.ops.hybrid_moe.matvecs


def route_dense_linears(gm: fx.GraphModule, example_inputs: list) -> int:
    """Replace qualifying linear calls by the op; returns how many were replaced."""
    if torch.is_grad_enabled():
        return 0
    inputs = dict(zip(gm.graph.find_nodes(op="placeholder"), example_inputs))
    replaced = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _LINEAR or node.kwargs:
            continue
        x, weight, bias = (*node.args, None)[:3] if len(node.args) == 2 else node.args[:3]
        w = inputs.get(weight)
        example = x.meta.get("example_value") if isinstance(x, fx.Node) else None
        if not isinstance(w, torch.Tensor) or not isinstance(example, torch.Tensor):
            continue
        limit = dense_linear.kernel_token_limit(w) if dense_linear.applies_to(example, w) else 0
        if not limit:
            continue
        rows = example.numel() // example.shape[-1]
        if isinstance(rows, int) and rows <= limit:  # a graph of this token count only (decode): the kernel's own op
            node.target, node.args = _MATVECS.default, (x, [weight], [None], [bias])
        else:  # a token count that varies: the op that picks the route per call
            node.target, node.args = torch.ops.hybrid_moe.linear.default, (x, weight, None, bias, limit)
        replaced += 1
    return replaced


def _mutates(node: fx.Node) -> bool:
    """Whether `node` writes a tensor in place (an op with a mutable schema, `x.mul_(...)`, `x *= ...`,
    `x[i] = ...`), as a Dynamo-level graph may."""
    if node.op not in ("call_function", "call_method"):
        return False
    target = node.target
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return schema.is_mutable
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    in_place_operator = getattr(target, "__module__", None) in ("operator", "_operator") and name.startswith("i")
    return (name.endswith("_") and not name.endswith("__")) or in_place_operator or target is operator.setitem


def fuse_sibling_matvecs(gm: fx.GraphModule) -> int:
    """Merge the `hybrid_moe::matvecs` calls that read the same input with weights of one dtype into one call at the
    first one's place: one pass of the threads over all their rows, one op call, the input prepared once (for k / v
    projections of a few MB the op's fixed cost is a large share of their time). Results are unchanged: every
    output row is the same fp32 sum; each call's output becomes its columns of the merged one (a view). Calls with
    an in-place write between them are not merged (the write may change the input). Returns how many calls were
    merged away."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    writes = [order[node] for node in gm.graph.nodes if _mutates(node)]
    groups: dict[tuple[fx.Node, torch.dtype, int], list[tuple[fx.Node, list[list], int]]] = {}
    for node in gm.graph.nodes:
        if not calls(node, _MATVECS) or node.kwargs:
            continue
        x, operands = node.args[0], [list(cast(list, a)) for a in node.args[1:4]]  # weights, scales, biases
        examples = [w.meta.get("example_value") if isinstance(w, fx.Node) else None for w in operands[0]]
        if isinstance(x, fx.Node) and all(isinstance(e, torch.Tensor) for e in examples):
            width = sum(weight_rows(cast(torch.Tensor, e)) for e in examples)
            run = bisect.bisect(writes, order[node])  # calls merge only within a run free of in-place writes
            groups.setdefault((x, cast(torch.Tensor, examples[0]).dtype, run), []).append((node, operands, width))
    merged_away = 0
    for (x, _, _), members in groups.items():
        first = members[0][0]
        inputs = [a for _, operands, _ in members for listed in operands for a in listed if isinstance(a, fx.Node)]
        if len(members) < 2 or any(order[a] > order[first] for a in inputs):
            continue  # one call, or a weight computed after the first call: nothing to merge at its place
        with gm.graph.inserting_before(first):
            merged = gm.graph.call_function(
                _MATVECS.default, (x, *([a for _, operands, _ in members for a in operands[i]] for i in range(3)))
            )
        offset = 0
        for node, _, width in members:
            with gm.graph.inserting_before(node):
                columns = gm.graph.call_function(torch.ops.aten.slice.Tensor, (merged, -1, offset, offset + width))
            node.replace_all_uses_with(columns)
            gm.graph.erase_node(node)
            offset += width
        merged_away += len(members) - 1
    return merged_away
