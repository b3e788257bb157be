"""The `hybrid_moe::cpu_experts` and `hybrid_moe::cpu_moe` ops and what every `hybrid_moe` op shares: the routing
contract and the tags.

The ops that call into a live layer (dispatch, its halves, prefetch) live beside it, in runtime/layer_ops.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import cpu_kernel
from .expert_math import accumulate_experts_
from .quantize import QuantizedWeight

# Host synchronisation and CPU compute inside: Inductor must not put these inside a CUDA graph.
TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


def require(condition: bool, message: Callable[[], str]) -> None:
    """torch._check for concrete tensors: the same error, without its symbolic-shape machinery (ten checks in each
    decode layer's step)."""
    if not condition:
        raise RuntimeError(message())


def check_routing(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    check: Callable[[bool, Callable[[], str]], None] = require,
) -> None:
    """The ops' shape contract; fake implementations pass torch._check (their shapes may be symbolic)."""
    check(hidden.dim() == 2, lambda: f"hidden must be [T, H], got {tuple(hidden.shape)}")
    check(topk_ids.dim() == 2, lambda: f"topk_ids must be [T, K], got {tuple(topk_ids.shape)}")
    check(topk_ids.shape == topk_weights.shape, lambda: "topk_ids and topk_weights shapes differ")
    check(topk_ids.shape[0] == hidden.shape[0], lambda: "topk_ids and hidden disagree on tokens")
    check(not topk_ids.is_floating_point(), lambda: "topk_ids must be an integer tensor")


def cpu_experts_into(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_scale: torch.Tensor | None,
    down_scale: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """Accumulate into fp32 `out` the experts of the pairs whose id is >= 0 (-1: computed elsewhere).

    Weights are bf16 / fp16 / fp32 [E, 2I, H] and [E, H, I], or int8 / packed-int4 (uint8) with fp16 scales
    [E, N, K / group] (see ops/quantize.py). Writing into a caller-owned accumulator lets partial
    sums from several devices combine with one final rounding, and lets a captured graph point at a
    static buffer. Runs the C++ kernel; the per-expert torch loop where it could not be built.

    The body of `hybrid_moe::cpu_experts`, callable as a plain function by code already inside an op (the
    dispatch): going through the op machinery again costs ~0.17 ms per call (benchmarks/cpu_decode_costs.py).
    """
    check_routing(hidden, topk_ids, topk_weights)
    num_experts = gate_up.shape[0]
    if topk_ids.numel():
        low, high = (int(v) for v in torch.aminmax(topk_ids))
        if low < -1 or high >= num_experts:
            raise ValueError(f"topk_ids must lie in [-1, {num_experts}), got [{low}, {high}]")
    if out.shape != hidden.shape or out.dtype != torch.float32:
        raise ValueError(
            f"out must be fp32 shaped like hidden {tuple(hidden.shape)}, got {out.dtype} {tuple(out.shape)}"
        )
    if cpu_kernel.best_isa() >= 0:
        cpu_kernel.moe_experts(hidden, topk_ids, topk_weights, gate_up, down, out, gate_up_scale, down_scale)
        return
    experts = [
        w if s is None else QuantizedWeight.from_kernel_operands(w, s)
        for w, s in ((gate_up, gate_up_scale), (down, down_scale))
    ]
    accumulate_experts_(out, hidden, topk_ids, topk_weights, experts[0], experts[1])


cpu_experts = torch.library.custom_op(
    "hybrid_moe::cpu_experts",
    mutates_args=("out",),
    schema=(
        "(Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor gate_up, Tensor down, Tensor? gate_up_scale, "
        "Tensor? down_scale, Tensor(a!) out) -> ()"
    ),
    device_types="cpu",
)(cpu_experts_into)


@cpu_experts.register_fake
def _(hidden, topk_ids, topk_weights, gate_up, down, gate_up_scale, down_scale, out) -> None:
    check_routing(hidden, topk_ids, topk_weights, torch._check)
    torch._check(out.is_contiguous(), lambda: "out must be a contiguous fp32 tensor")  # as the C++ kernel says


# `hybrid_moe::cpu_moe`: the decode step of a layer whose every expert runs on the CPU, named by its handle as
# `dispatch` names one, in hidden's dtype (one rounding of the fp32 sum), on the micro-kernels (fewer tokens than any
# measured GEMM route starts at). Its kernel is C++ (csrc/cpu_layers.cpp, registered when the kernel module loads),
# reading the experts the layer published under the handle (runtime/layer.py): compiled decode steps call it in
# place of `dispatch` for such layers (compile_passes/cpu_dispatch.py) with no Python on the way; a handle that names
# no published layer any more (it went to a layer with slots) is passed on to `dispatch`.
_LIB = torch.library.Library("hybrid_moe", "FRAGMENT")
_LIB.define("cpu_moe(Tensor hidden, Tensor topk_ids, Tensor topk_weights, int layer) -> Tensor")


@torch.library.register_fake("hybrid_moe::cpu_moe", lib=_LIB)
def _(hidden, topk_ids, topk_weights, layer) -> torch.Tensor:
    check_routing(hidden, topk_ids, topk_weights, torch._check)
    return hidden.new_empty(hidden.shape)  # row-major, as the kernel's
