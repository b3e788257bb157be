"""Complex rotary products in real arithmetic: `view_as_real(view_as_complex(x) * c)` becomes the same four
products on x's pairs and c's (real, imaginary) parts.

DeepSeek-V2's rotary embedding (transformers' `apply_rotary_emb`) multiplies the query's and key's rotary parts as
complex numbers. Inductor has no complex kernels, so each layer's two products ran as six eager calls (two
`view_as_complex`, two complex `mul`, two `view_as_real`) with their allocations between the graph's kernels, on one
thread. In real arithmetic Inductor fuses them into the kernels around them; each layer reads `c` (the step's
rotary factors) through one `view_as_real` view. The products are the ones torch's vectorised CPU complex multiply
computes, (a c - b d, a d + b c) with each product rounded: Inductor's CPU kernels compile without FMA contraction
(its default), so where that multiply runs in whole vectors (DeepSeek-V2-Lite's 32 pairs a head) the bits are the
same; its scalar tail, and GPU kernels that fuse multiply-adds, differ from them by fp32 rounding only
(`tests/test_complex_products.py` checks the CPU's against float64 and the bits; not run on a GPU).
"""

from __future__ import annotations

import operator
from typing import TypeGuard

import torch
import torch.fx as fx


def _is_mul(node: fx.Node) -> bool:
    """`a * b` as Dynamo records it: `operator.mul`, `torch.mul` or the `mul` method, without keywords."""
    if node.kwargs:
        return False
    return node.target == "mul" if node.op == "call_method" else node.target in (operator.mul, torch.mul)


def _complex_dtype(node: object) -> torch.dtype | None:
    """complex64 / complex128 where Dynamo recorded the graph value as such a tensor; None for anything else (complex32
    too: its eager multiply is not these products in fp16)."""
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    if isinstance(value, torch.Tensor) and value.dtype in (torch.complex64, torch.complex128):
        return value.dtype
    return None


def _one_input(node: object, target: object) -> TypeGuard[fx.Node]:
    """Whether `node` calls `target` on one positional input and nothing else."""
    return isinstance(node, fx.Node) and node.target is target and len(node.args) == 1 and not node.kwargs


def lower_complex_products(gm: fx.GraphModule) -> int:
    """Rewrite every `view_as_real(view_as_complex(x) * c)` of `gm` whose complex intermediates have no other user and
    whose factors share a dtype into real arithmetic; returns how many were rewritten. The new nodes carry no
    `example_value` until `graph_utils.fill_example_values` (the backend's last step) gives them one: a pass that
    reads it must run before this one. The caller lints and recompiles `gm`."""
    graph, done = gm.graph, 0
    parts_of: dict[fx.Node, fx.Node] = {}  # each complex factor's (real, imaginary) view, made once
    for node in list(graph.nodes):
        if not (node.op == "call_function" and _one_input(node, torch.view_as_real)):
            continue
        product = node.args[0]
        if not (isinstance(product, fx.Node) and _is_mul(product) and len(product.users) == 1):
            continue
        pair = [a for a in product.args if _one_input(a, torch.view_as_complex)]
        if len(product.args) != 2 or len(pair) != 1 or len(pair[0].users) != 1:
            continue
        packed = pair[0]
        factor = product.args[1] if product.args[0] is packed else product.args[0]
        dtypes = {_complex_dtype(n) for n in (packed, factor, product)}
        if len(dtypes) != 1 or None in dtypes or not isinstance(factor, fx.Node):  # (a Node already: for mypy)
            continue
        # Everything goes where the product was: its inputs are ready there, and nothing between it and its
        # view_as_real (an in-place op on x, say) may change what it reads. A factor's view goes before its first
        # product, past the graph's inputs.
        with graph.inserting_before(product):
            if factor not in parts_of:
                parts_of[factor] = graph.call_function(torch.view_as_real, (factor,))
            parts, x = parts_of[factor], packed.args[0]
            a, b, c, d = (graph.call_function(torch.select, (t, -1, i)) for t in (x, parts) for i in (0, 1))
            real = graph.call_function(
                operator.sub, (graph.call_function(operator.mul, (a, c)), graph.call_function(operator.mul, (b, d)))
            )
            imag = graph.call_function(
                operator.add, (graph.call_function(operator.mul, (a, d)), graph.call_function(operator.mul, (b, c)))
            )
            out = graph.call_function(torch.stack, ([real, imag],), {"dim": -1})
        node.replace_all_uses_with(out)
        for dead in (node, product, packed):
            graph.erase_node(dead)
        done += 1
    for parts in parts_of.values():
        _view_before_reshaping(graph, parts)
    return done


def _view_before_reshaping(graph: fx.Graph, view: fx.Node) -> None:
    """Move `view` (a `view_as_real`) above the `unsqueeze` and device-only `.to` calls that made its complex input
    and that nothing else reads: the same values, as real tensors Inductor handles (a complex `unsqueeze` is an eager
    fallback through its proxy executor, once a layer in DeepSeek-V2's step)."""
    while True:
        src = view.args[0]
        if not (isinstance(src, fx.Node) and len(src.users) == 1 and src.args and isinstance(src.args[0], fx.Node)):
            return
        base, rest = src.args[0], src.args[1:]  # complex as `src` is: neither call changes the dtype
        name = src.target if src.op == "call_method" else getattr(src.target, "__name__", None)
        if name == "unsqueeze" and len(rest) == 1 and isinstance(rest[0], int) and not src.kwargs:
            with graph.inserting_before(src):  # where the call ran: what it read is as it was then
                real = graph.call_function(torch.view_as_real, (base,))
                dim = rest[0]  # the real view has one more (last) dimension
                moved = graph.call_function(torch.unsqueeze, (real, dim if dim >= 0 else dim - 1))
        elif (
            name == "to"
            and src.op == "call_method"
            and all(isinstance(a, (torch.device, str)) for a in rest)
            and set(src.kwargs) <= {"device", "non_blocking", "copy"}
        ):
            with graph.inserting_before(src):  # where the call ran: what it read is as it was then
                real = graph.call_function(torch.view_as_real, (base,))
                moved = graph.call_method("to", (real, *rest), dict(src.kwargs))
        else:
            return
        view.replace_all_uses_with(moved)
        graph.erase_node(view)
        graph.erase_node(src)
        view = real
