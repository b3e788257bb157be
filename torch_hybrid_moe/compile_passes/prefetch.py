"""Pass 2: right after layer l's routing is known, ask layer l+1 to prefetch; layer l's dispatch then reads the
hidden states through the prefetch op, so the prefetch runs before it in Inductor's schedule too."""

from __future__ import annotations

import torch.fx as fx

from ..runtime import get_layer
from .graph_utils import DISPATCH, PREFETCH, calls, insertion_point_after


def insert_prefetch(gm: fx.GraphModule) -> int:
    """Insert `prefetch(hidden_l, topk_ids_l, handle_{l+1})` for each dispatch whose next layer has slots; returns
    how many."""
    graph = gm.graph
    done = {(n.args[1], n.args[2]) for n in graph.nodes if calls(n, PREFETCH)}
    inserted = 0
    for node in [n for n in graph.nodes if calls(n, DISPATCH)]:
        hidden, ids, _, handle = node.args
        nxt = get_layer(handle).next_handle
        # A layer without slots (expert_budget 0) has nowhere to prefetch into: no op call in its decode step.
        if nxt is None or (ids, nxt) in done or get_layer(nxt).store.num_slots == 0:
            continue
        with graph.inserting_after(insertion_point_after(graph, hidden, ids)):
            started = graph.call_function(PREFETCH.default, (hidden, ids, nxt))
        node.args = (started, *node.args[1:])
        inserted += 1
    return inserted
