"""The `hybrid_moe` torch.compile backend: MoE passes on the Dynamo graph, then Inductor.

Passes: rewrite stock experts regions into dispatch (moe_regions.py), insert prefetches (prefetch.py), call the
C++ step of layers whose experts all run on the CPU (cpu_dispatch.py),
route CPU bf16 / fp16 linear layers to the decode micro-kernels where measured faster and merge the decode
linears that read one input into one call (dense_linear.py),
lower complex rotary products to real arithmetic Inductor fuses (complex_products.py),
and, for layers configured with mode="expert_deferral" only, Expert Deferral (expert_deferral.py), or with
mode="daop_precalc" only, DAOP's predictive CPU pre-calculation of decode steps (daop_precalc.py).

Registered through the `torch_dynamo_backends` entry point, so `backend="hybrid_moe"` works in a
fresh interpreter. `options` may carry HybridMoEConfig fields (used for stock models the backend
rewrites); the remaining options and the mode go to Inductor. A stock model's compiled graph is bound to the
calling model's own experts before every call (runtime/stock.py): Dynamo shares it between models of one
architecture, and it follows in-place weight changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.fx as fx

from ..config import HybridMoEConfig
from ..errors import InputError
from ..runtime.decode_replay import recordable
from .complex_products import lower_complex_products
from .cpu_dispatch import direct_cpu_dispatch
from .daop_precalc import insert_daop_precalc
from .dense_linear import fuse_sibling_matvecs, route_dense_linears
from .expert_deferral import insert_expert_deferral
from .graph_utils import DISPATCH, calls, fill_example_values
from .moe_regions import rewrite_experts_regions
from .prefetch import insert_prefetch

_CONFIG_FIELDS = {f.name for f in dataclasses.fields(HybridMoEConfig)}
# Inductor options for a CPU decode step (torch.compile(..., options=CPU_DECODE_OPTIONS)): the graph's wrapper in
# C++, which calls our ops through the dispatcher, instead of ~300 lines of Python a step for 4 layers. On 4 int4 /
# int8 layers of Qwen3-30B-A3B's shape, 2 threads of an AVX2 EPYC: 0.7-1.0 / 1.9 ms a token less, paired
# (`benchmarks/decode_profile.py --wrapper`; benchmarks/RESULTS.md, "The CPU decode step's graph wrapper in C++").
CPU_DECODE_OPTIONS = {"cpp_wrapper": True}


def hybrid_moe_backend(
    gm: fx.GraphModule, example_inputs: list, mode: str | None = None, options: dict | None = None
) -> Callable:
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    options = dict(options or {})
    given = {k: options.pop(k) for k in list(options) if k in _CONFIG_FIELDS}
    config = HybridMoEConfig(**given)
    if config.dense_weight_dtype != "model":  # a lossy option must not pass silently unapplied
        raise InputError(
            f"dense_weight_dtype={config.dense_weight_dtype!r} quantises dense layers when a model is patched, which "
            "the backend cannot do to a compiled graph: patch_model(model, dense_weight_dtype=...), then compile it"
        )
    original = set(gm.graph.nodes)  # Dynamo's nodes: fill_example_values gives values to the passes' ones only
    sites = rewrite_experts_regions(gm, example_inputs, config)
    if given and not sites.sites and any(calls(n, DISPATCH) for n in gm.graph.nodes):
        warnings.warn(
            f"hybrid_moe: options {sorted(given)} configure stock models the backend rewrites; this model is patched "
            "and runs the config patch_model gave it",
            stacklevel=2,
        )
    insert_prefetch(gm)
    insert_expert_deferral(gm)  # only layers whose config has mode="expert_deferral"; others stay exact
    insert_daop_precalc(gm)  # likewise mode="daop_precalc", and decode graphs only
    direct_cpu_dispatch(gm)  # layers with every expert on the CPU: the C++ op, no Python a step
    route_dense_linears(gm, example_inputs)  # CPU bf16 / fp16 linears where the micro-kernels were measured faster
    fuse_sibling_matvecs(gm)  # decode linears reading one input (q / k / v): one kernel call
    lower_complex_products(gm)  # DeepSeek-V2's rotary products: fused by Inductor, not six eager calls a layer
    fill_example_values(gm, original)  # last: the values of every node the passes inserted
    gm.graph.lint()
    gm.recompile()
    patches = {**list_mode_options(mode), **options} if mode else options
    inference = torch.is_grad_enabled() and _calls_our_ops(gm)
    if inference:  # the ops have no backward: traced with autograd, compiling would fail at the first of them
        warnings.warn(
            "hybrid_moe: the experts' ops are inference-only, so this graph runs without autograd (its outputs carry "
            "no gradient); call the model under torch.no_grad() or torch.inference_mode() to say so",
            stacklevel=2,
        )
        _drop_grad_mode_switches(gm)
    with torch.no_grad() if inference else contextlib.nullcontext():
        compiled = compile_fx(gm, example_inputs, config_patches=patches or None)
    run = cast(Callable[..., Any], compiled)  # not AOT: the compiled callable
    # recordable, so that uncaptured decode steps can call it past Dynamo
    return recordable(sites.wrap(_without_grad(run) if inference else run))


def _calls_our_ops(gm: fx.GraphModule) -> bool:
    return any(
        node.op == "call_function" and getattr(node.target, "namespace", None) == "hybrid_moe"
        for node in gm.graph.nodes
    )


def _drop_grad_mode_switches(gm: fx.GraphModule) -> None:
    """Remove the graph's own grad-mode switches: torch 2.11's Dynamo keeps a `torch.no_grad()` region of the model
    (transformers' rotary embedding) as `_set_grad_enabled(False)` ... `_set_grad_enabled(True)`, and the second
    turned autograd back on for the layers after it, inside a graph that is to run without autograd."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            gm.graph.erase_node(node)
    gm.recompile()


def _without_grad(compiled: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(compiled)
    def run(*args: Any) -> Any:
        with torch.no_grad():
            return compiled(*args)

    return run
