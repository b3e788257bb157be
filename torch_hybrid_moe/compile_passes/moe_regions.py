"""Pass 1: find the routed-experts region of every MoE block and replace it with the dispatch op.

Works on Dynamo-level graphs, where each node's `nn_module_stack` names the module it came from.
A patched model already calls `hybrid_moe::dispatch` there; a stock transformers model traces the
body of its `*Experts` module (grouped_mm, batched_mm or the fp32 fallback op), which this pass cuts
out and replaces, whatever the implementation, by the region's inputs and output alone.
"""

from __future__ import annotations

import inspect
import logging
import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..config import HybridMoEConfig
from ..errors import InputError
from ..runtime import get_layer
from ..runtime.expert_store import EXPERT_DTYPES
from ..runtime.stock import StockSites
from .graph_utils import DISPATCH, calls

log = logging.getLogger(__name__)
_SILU = {F.silu, torch.ops.aten.silu.default, torch.ops.aten.silu}
# The flags of transformers' `use_experts_implementation` under which its experts compute what dispatch does (its
# defaults): gate and up concatenated in one untransposed weight without biases, nothing after the down projection.
_DISPATCH_LAYOUT = {
    "has_gate": True,
    "has_bias": False,
    "is_transposed": False,
    "is_concatenated": True,
    "has_post_expert_norm": False,
}


@dataclass
class ExpertsRegion:
    path: str
    cls: type  # the experts module's class
    nodes: list[fx.Node] = field(default_factory=list)
    params: dict[str, fx.Node] = field(default_factory=dict)


def _experts_module(node: fx.Node) -> tuple[str, type] | None:
    for path, cls in (node.meta.get("nn_module_stack") or {}).values():
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module) and hasattr(cls, "_apply_gate"):
            return path, cls
    return None


def _param_name(node: fx.Node) -> str | None:
    grapharg = node.meta.get("grapharg")
    source = grapharg.source.name if grapharg is not None else node.name
    for name in ("gate_up_proj", "down_proj"):
        if name in source:
            return name
    return None


def find_experts_regions(graph: fx.Graph) -> list[ExpertsRegion]:
    regions: dict[str, ExpertsRegion] = {}
    for node in graph.nodes:
        found = _experts_module(node)
        if found is None:
            continue
        region = regions.setdefault(found[0], ExpertsRegion(*found))
        if node.op == "placeholder":
            if (name := _param_name(node)) is not None:
                region.params[name] = node
        else:
            region.nodes.append(node)
    return list(regions.values())


def rewrite_experts_regions(gm: fx.GraphModule, example_inputs: list, config: HybridMoEConfig) -> StockSites:
    """Replace stock experts regions with dispatch calls; returns the sites the compiled graph must be bound
    to before each call (`StockSites.wrap`), one per rewritten region."""
    graph = gm.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    # A patched model already dispatches; only stock regions are rewritten.
    stock = [r for r in find_experts_regions(graph) if not any(calls(n, DISPATCH) for n in r.nodes)]
    for cls in _eager_experts():
        log.warning(
            "hybrid_moe: left %s as it is: its experts run transformers' eager per-expert loop, which Dynamo splits "
            "into pieces no pass can rewrite; model.set_experts_implementation('grouped_mm') before torch.compile "
            "puts them in the graph",
            cls.__name__,
        )
    _check_graph_holds_enough(stock, config)
    sites = StockSites(config, len(stock))
    for ordinal, region in enumerate(stock):
        problem = _rewrite(graph, region, placeholders, example_inputs, sites, ordinal)
        if problem is not None:
            log.warning("hybrid_moe: left %s as it is: %s", region.path, problem)
    # The passes that follow find layer l + 1 through layer l's next_handle: here, the next site.
    for prev, cur in zip(sites.sites, sites.sites[1:]):
        get_layer(prev.handle).next_handle = cur.handle
    return sites


def _eager_experts() -> list[type]:
    """The experts classes whose eager forward (`experts_implementation="eager"`) this graph was traced from. Dynamo
    breaks the graph inside its loop over experts, so no graph shows the experts module and the experts would run
    unchanged without a word. `use_experts_implementation` keeps that forward as its dispatcher's `__wrapped__`.
    (With Dynamo's nested_graph_breaks the broken forward is no frame's root and is not named here.)"""
    context = torch._guards.TracingContext.try_get()
    codes = dict.fromkeys(getattr(context, "traced_code", None) or ())  # inlined once per call: each code once
    found = []
    for code in (c for c in codes if c.co_name == "forward"):
        module = inspect.getmodule(code)
        for cls in vars(module).values() if module is not None else ():
            if not (isinstance(cls, type) and hasattr(cls, "_apply_gate")):
                continue
            wrapped = getattr(vars(cls).get("forward"), "__wrapped__", None)
            if getattr(wrapped, "__code__", None) is code:
                found.append(cls)
    return found


def _check_graph_holds_enough(stock: list[ExpertsRegion], config: HybridMoEConfig) -> None:
    """What a compiled graph holding some of the model's MoE layers cannot apply (a model compiled layer by layer,
    or split by graph breaks), refused before any change: a byte budget is the model's layers' together, and the
    approximate modes reach from one MoE layer into the next."""
    if stock and isinstance(config.expert_budget, str):
        raise InputError(
            f"expert_budget={config.expert_budget!r} is a byte budget for all the model's MoE layers, and a compiled "
            "graph may hold some of them only (compiled layer by layer, each took all of it): give the backend a "
            "fraction of each layer's experts, or patch_model(model, expert_budget=...) and compile that"
        )
    if len(stock) == 1 and config.mode != "exact":
        raise InputError(
            f"mode={config.mode!r} reaches from one MoE layer into the next, and this compiled graph holds one (a "
            "model compiled layer by layer, or split by a graph break): compile the whole model with fullgraph=True"
        )


def _layout(cls: type) -> dict[str, object]:
    """The flags `use_experts_implementation` built `cls` with. It keeps them in the closure of the `__init__` it
    wraps (each instance copies them there), so a class is read without one; a flag a transformers version does
    not have yet is at its default."""
    init = next(vars(k)["__init__"] for k in cls.__mro__ if "__init__" in vars(k))  # as the instance's runs
    code, closure = getattr(init, "__code__", None), getattr(init, "__closure__", None)
    cells = dict(zip(code.co_freevars, closure)) if code is not None and closure else {}
    return {name: cells[name].cell_contents if name in cells else default for name, default in _DISPATCH_LAYOUT.items()}


def _rewrite(
    graph: fx.Graph,
    region: ExpertsRegion,
    placeholders: list[fx.Node],
    example_inputs: list,
    sites: StockSites,
    ordinal: int,
) -> str | None:
    """Replace one region by a dispatch call naming a new site; returns why it was left alone, if it was."""
    if set(region.params) != {"gate_up_proj", "down_proj"}:
        return "its gate_up_proj/down_proj are not graph inputs"
    if not any(n.target in _SILU for n in region.nodes):
        return "no SiLU activation found in the experts body"
    # transformers' default gate is act(gate) * up; a class of its own (a clamped SwiGLU, GPT-OSS's) computes
    # something else, which dispatch does not
    if getattr(getattr(region.cls, "_apply_gate", None), "__name__", "") != "_default_apply_gate":
        return f"{region.cls.__name__} gates its experts its own way (_apply_gate), not as SiLU(gate) * up"
    # a weightless post-expert norm leaves no trace among the region's inputs: only the flag tells
    differs = [f"{k}={v}" for k, v in _layout(region.cls).items() if v != _DISPATCH_LAYOUT[k]]
    if differs:
        return f"{region.cls.__name__} is built with {', '.join(differs)}, which dispatch does not compute"
    inside = set(region.nodes)
    params = set(region.params.values())
    inputs = [a for n in region.nodes for a in n.all_input_nodes if a not in inside and a not in params]
    tensors = list(dict.fromkeys(a for a in inputs if isinstance(a.meta.get("example_value"), torch.Tensor)))
    outputs = [n for n in region.nodes if any(u not in inside for u in n.users)]
    tensor_outputs = [n for n in outputs if isinstance(n.meta.get("example_value"), torch.Tensor)]
    if len(tensors) != 3 or len(tensor_outputs) != 1:
        return f"expected 3 tensor inputs and 1 tensor output, found {len(tensors)} and {len(tensor_outputs)}"
    gate_up_arg, down_arg = (placeholders.index(region.params[p]) for p in ("gate_up_proj", "down_proj"))
    gate_up, down = example_inputs[gate_up_arg], example_inputs[down_arg]
    if gate_up.dtype not in EXPERT_DTYPES or down.dtype != gate_up.dtype:
        return f"its experts are {gate_up.dtype} / {down.dtype}; dispatch computes {', '.join(map(str, EXPERT_DTYPES))}"
    if (
        gate_up.dim() != 3
        or down.dim() != 3
        or (gate_up.shape[1], down.shape[1]) != (2 * down.shape[2], gate_up.shape[2])
    ):
        return f"its weights are {tuple(gate_up.shape)} and {tuple(down.shape)}, not (E, 2I, H) and (E, H, I)"
    ids = [a for a in tensors if not a.meta["example_value"].is_floating_point()]
    floats = [a for a in tensors if a.meta["example_value"].is_floating_point()]
    hidden_size = gate_up.shape[-1]
    hidden = [a for a in floats if a.meta["example_value"].shape[-1] == hidden_size]
    if len(ids) != 1 or len(hidden) != 1:
        return "cannot tell hidden states, expert ids and routing weights apart"
    (weights,) = [a for a in floats if a is not hidden[0]]
    match = re.search(r"layers\.(\d+)\.", region.path)
    name = re.sub(r"^L\['self'\]\.", "", region.path)
    sites.add(gate_up, down, gate_up_arg, down_arg, name, int(match.group(1)) if match else ordinal)
    (out,) = tensor_outputs
    with graph.inserting_before(out):
        new = graph.call_function(DISPATCH.default, (hidden[0], ids[0], weights, sites.sites[-1].handle))
    new.meta.update(out.meta)
    out.replace_all_uses_with(new)
    for node in reversed(region.nodes):
        if not node.users:
            graph.erase_node(node)
    return None
