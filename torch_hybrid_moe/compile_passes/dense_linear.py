"""Pass: CPU linear layers with bf16 / fp16 weights run through `hybrid_moe::linear` where that was measured
faster on this machine (ops/dense_linear.py), up to the token count where they stopped winning.

Only weights that are graph inputs (parameters) and only graphs compiled without autograd: the op has no
backward. The choice is made here, once per weight shape, and baked into the graph.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..ops import dense_linear

_LINEAR = {torch._C._nn.linear, F.linear, torch.ops.aten.linear.default}


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
        node.target = torch.ops.hybrid_moe.linear.default
        node.args = (x, weight, None, bias, limit)
        replaced += 1
    return replaced
