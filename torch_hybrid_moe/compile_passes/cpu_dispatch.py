"""Pass: in a decode graph, the dispatch of a layer whose every expert runs on the CPU becomes `hybrid_moe::cpu_moe`.

Such a layer has nothing to decide at run time (no slots, no placement, no admission), so its step is the expert
kernel alone; `cpu_moe` reaches it through the dispatcher with no Python (~0.3 ms a layer at decode against the
Python `dispatch` op: benchmarks/cpu_decode_costs.py). Only graphs of a fixed token count below every measured GEMM
route (decode): they need no route, so nothing the host format decides is baked in, and at prefill the op's fixed
cost is noise beside the layer's work. Runs after the passes that split or prefetch around dispatches (Expert
Deferral, DAOP and prefetching take only other layers' dispatches, or none at budget 0).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..ops import library  # noqa: F401  (registers hybrid_moe::cpu_moe)
from ..ops.cpu_kernel import ROUTE_TOKENS, best_isa
from ..runtime.registry import get_layer
from .graph_utils import DISPATCH, calls


def direct_cpu_dispatch(gm: fx.GraphModule) -> int:
    """Rewrite each qualifying dispatch in place; returns how many were rewritten."""
    if best_isa() < 0:
        return 0
    rewritten = 0
    for node in gm.graph.nodes:
        if not calls(node, DISPATCH):
            continue
        hidden, ids, weights, handle = node.args
        example = hidden.meta.get("example_value") if isinstance(hidden, fx.Node) else None
        layer = get_layer(handle)
        if not (
            layer.all_on_cpu
            and isinstance(example, torch.Tensor)
            and example.device.type == "cpu"
            and isinstance(example.shape[0], int)
            and example.shape[0] < ROUTE_TOKENS[0]
        ):
            continue
        node.target = torch.ops.hybrid_moe.cpu_moe.default
        rewritten += 1
    return rewritten
