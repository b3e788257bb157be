"""`hybrid_moe::linear`: a dense CPU linear layer at decode, on the expert kernel's micro-kernels.

At decode a linear layer is a matrix-vector product bound by reading its weight. On CPUs without native
bf16 arithmetic torch's bf16 GEMM runs well below the read bandwidth (2x below on an AVX2 EPYC); on others
(AVX512-BF16, AMX) it does not. So the route is chosen per weight shape by timing both at compile time
(`kernel_token_limit`): the op runs the micro-kernels up to the largest measured token count at which they
won, and torch's GEMM above it.
The result is accumulated in fp32 and rounded once to the activations' dtype, as torch's bf16 GEMM does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_kernel
from .measured import count, flag, measured
from .quantize import (
    BITS,
    LANE_ROWS,
    QuantizedWeight,
    block_rows,
    dequantize,
    lay_out,
    quantize,
    quantize_activations,
    row_major,
    weight_rows,
)

TOKEN_COUNTS = (1, 4, 16, 64)  # where the two routes are compared
# Where an int8 / int4 linear's micro-kernels and dequantising route are compared. 128 and 512 are there because the
# switch-over falls between counts: a 512-row int4 weight (a KV projection) on an AVX2 CPU tied at 256 and won at 128
# (1.5x in the model, 3x timed alone), so comparing at 256 alone sent 128-token prefills to the slower route.
QUANTIZED_COUNTS = (128, 256, 512, 1024)
PREFILL_ROWS = 128  # where torch's GEMM in the weight's dtype and in fp32 are compared
# Both routes stream the weight by rows, so time scales with the row count: a larger weight is timed on this
# many of its rows (64 MiB of bf16 at K = 2048: still well beyond the caches), keeping warm-up short.
MEASURED_ROWS = 16384
# At QUANTIZED_COUNTS both int8 / int4 routes are bound by arithmetic, not by reading the weight, so fewer rows
# time them alike, and keep the measurement's fp32 outputs and copies small beside a freshly loaded model.
QUANTIZED_ROWS = 4096
KERNEL_DTYPES = (torch.bfloat16, torch.float16)


# `hybrid_moe::matvecs`: x [..., K] times sibling weights that read it (attention's q / k / v), each [N_i, K] (bf16 /
# fp16 / fp32, or int8 / packed int4 with fp16 group scales, int4 maybe laid out: ops/quantize.py `lay_out`), plus
# their biases: the outputs side by side in one tensor [..., sum N_i] of x's dtype, summed in fp32 and rounded once.
# Its CPU kernel is C++ (csrc/moe_cpu.cpp), registered when the kernel module loads, so a compiled decode step reaches
# it through the dispatcher alone; one call streams all the siblings' rows on every thread at once, preparing x
# once. One output tensor, not a list: Inductor's C++ wrapper reads a list-returning custom op's result wrongly (it
# crashed), and calls a single-output one without Python.
_LIB = torch.library.Library("hybrid_moe", "FRAGMENT")
_LIB.define("matvecs(Tensor x, Tensor[] weights, Tensor?[] scales, Tensor?[] biases) -> Tensor")


@torch.library.register_fake("hybrid_moe::matvecs", lib=_LIB)
def _(
    x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor | None], biases: list[torch.Tensor | None]
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], sum(weight_rows(w) for w in weights)))


@torch.library.custom_op(
    "hybrid_moe::linear",
    mutates_args=(),
    device_types="cpu",
    schema="(Tensor x, Tensor weight, Tensor? scale, Tensor? bias, int max_tokens) -> Tensor",
)
def linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, max_tokens: int
) -> torch.Tensor:
    """F.linear(x, weight, bias), through the micro-kernels when x has at most `max_tokens` rows. More rows go to
    torch's GEMM, in fp32 (weight converted per call, one rounding) where that was measured faster than its bf16 /
    fp16 GEMM on this machine (CPUs without native bf16 arithmetic: ~8x). With `scale`, `weight` is int8 / packed
    int4 (ops/quantize.py), x is rounded as the kernel rounds it, and more rows multiply the dequantised weight in
    fp32."""
    if x.numel() // x.shape[-1] > max_tokens:
        if scale is None:
            return gemm(x, weight, bias, weight.dtype in KERNEL_DTYPES and upcast_wins(weight))
        if weight.dim() == 3:  # laid out: only where the kernel runs, which gathers its rows into panels
            return cpu_kernel.dense_gemm(x, weight, scale, bias)
        return dequantized_linear(x, QuantizedWeight.from_kernel_operands(weight, scale), bias)
    return torch.ops.hybrid_moe.matvecs(x, [weight], [scale], [bias])


def dequantized_linear(x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x times an [N, K] quantised weight through torch's fp32 GEMM on the dequantised weight, never all of it in fp32
    at once (an LM head's fp32 copy would be 4 bytes per weight, held beside the model during every prefill call).
    Where the kernel is built, C++ rounds the activations and dequantises the weight a panel of rows at a time (in
    torch ops, dequantising a 4,096 x 2,048 int4 weight took two thirds of the GEMM's own time: benchmarks/RESULTS.md,
    2026-11-27 night); else torch does, `block_rows` output features at a time."""
    if cpu_kernel.best_isa() >= 0:
        return cpu_kernel.dense_gemm(x, q.data, q.scale, bias)
    xq = quantize_activations(x)
    out = xq.new_empty((*x.shape[:-1], q.data.shape[0]))
    step = block_rows(x.shape[-1])
    for start in range(0, out.shape[-1], step):
        rows = slice(start, start + step)
        out[..., rows] = F.linear(
            xq,
            dequantize(q.data[rows], q.scale[rows], q.bits, q.group_size),
            None if bias is None else bias[rows].float(),
        )
    return out.to(x.dtype)


@linear.register_fake
def _(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, max_tokens: int
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight_rows(weight)))


class RoutedLinear(torch.nn.Module):
    """An nn.Linear of a CPU bf16 / fp16 model, its calls through `hybrid_moe::linear` with the routes measured for
    its shape here: decode rows on the micro-kernels where they win, prefill rows on fp32 GEMM where that wins.
    Keeps the linear's own `weight` / `bias` parameters (state dict, ties and saving unchanged). `patch_model`
    puts it in place so eager prefill gets the routes too; compiled graphs of stock models get them from the
    backend's pass (compile_passes/dense_linear.py)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.max_tokens, self.upcast = kernel_token_limit(linear.weight), upcast_wins(linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Decided in Python, so a compiled graph holds only the route its shapes take: the op (and its fixed
        # cost) only where the micro-kernels run, plain aten GEMMs for Inductor elsewhere.
        wants_grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)  # the kernel has none
        if (
            wants_grad
            or x.dtype != self.weight.dtype
            or x.device != self.weight.device
            or x.numel() // x.shape[-1] > self.max_tokens
        ):
            return gemm(x, self.weight, self.bias, self.upcast and x.dtype == self.weight.dtype)
        return torch.ops.hybrid_moe.matvecs(x, [self.weight], [None], [self.bias])

    def extra_repr(self) -> str:
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{shape}, micro-kernels up to {self.max_tokens} rows"


class QuantizedLinear(torch.nn.Module):
    """An nn.Linear whose weight is held as int8 / int4 with one fp16 scale per `group_size` columns (the experts'
    CPU formats), for `HybridMoEConfig(dense_weight_dtype=...)`: an approximate mode that cuts the bytes every
    decode token reads from the dense layers (the LM head above all). Rows run on the micro-kernels up to the
    count where multiplying a dequantised copy was measured faster (`quantized_token_limit`). An int4 weight is held
    laid out for the AVX-512 kernel (`lay_out`) where that was measured faster at one token. `weight`: the linear's
    weight already quantised so (a loader's, read from the checkpoint a block of rows at a time), else quantised
    from `linear.weight`."""

    qweight: torch.Tensor
    scale: torch.Tensor

    def __init__(
        self, linear: torch.nn.Linear, fmt: str, group_size: int, weight: QuantizedWeight | None = None
    ) -> None:
        super().__init__()
        q = weight if weight is not None else quantize(linear.weight.detach().unsqueeze(0), BITS[fmt], group_size)
        self.in_features, self.out_features, self.fmt = linear.in_features, linear.out_features, fmt
        data, scale = q.data[0], q.scale[0]
        if q.bits == 4 and laid_out_wins(data, scale):
            data, scale = lay_out(data, scale)
        self.register_buffer("qweight", data)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.max_tokens = quantized_token_limit(self.qweight, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As RoutedLinear: a graph traced for few rows holds the kernel's own op, not the op that picks a route.
        if 0 < x.numel() // x.shape[-1] <= self.max_tokens:
            return torch.ops.hybrid_moe.matvecs(x, [self.qweight], [self.scale], [self.bias])
        return torch.ops.hybrid_moe.linear(x, self.qweight, self.scale, self.bias, self.max_tokens)

    def hold_row_major(self) -> None:
        """Hold the weight row by row (undo `lay_out`), for a caller that reads its rows (MLA's absorbed attention
        takes kv_b_proj's value rows as they are)."""
        if self.qweight.dim() == 3:
            self.qweight, self.scale = row_major(self.qweight, self.scale)
            self.max_tokens = quantized_token_limit(self.qweight, self.scale)

    def extra_repr(self) -> str:
        laid = ", laid out" if self.qweight.dim() == 3 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt}{laid}"


def applies_to(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the op can stand in for F.linear(x, weight): CPU, a 2-D bf16 / fp16 weight, same dtype input."""
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype in KERNEL_DTYPES
        and x.dtype == weight.dtype
        and cpu_kernel.best_isa() >= 0
    )


def kernel_token_limit(weight: torch.Tensor, repeats: int = 5) -> int:
    """The largest of TOKEN_COUNTS at which the micro-kernels beat torch's GEMM for this weight's shape and
    dtype on this machine, with every smaller count won too; 0 where they lose at one token."""
    return _measure(
        (min(weight.shape[0], MEASURED_ROWS), weight.shape[1]), weight.dtype, torch.get_num_threads(), repeats
    )


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, upcast: bool) -> torch.Tensor:
    """torch's GEMM route: in the weight's dtype, or (`upcast`) in fp32 with one rounding to x's dtype."""
    if not upcast:
        return F.linear(x, weight, bias)
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


def upcast_wins(weight: torch.Tensor, repeats: int = 3) -> bool:
    """Whether F.linear in fp32 (converting this bf16 / fp16 weight at each call) beats torch's GEMM in the weight's
    dtype at PREFILL_ROWS rows, for its shape on this machine (measured once per shape and dtype)."""
    return _upcast_wins(
        (min(weight.shape[0], MEASURED_ROWS), weight.shape[1]), weight.dtype, torch.get_num_threads(), repeats
    )


@measured(decode=flag)
def _upcast_wins(shape: tuple[int, int], dtype: torch.dtype, threads: int, repeats: int) -> bool:
    weight = torch.empty(shape, dtype=dtype).normal_(0, 0.02)
    x = torch.randn(PREFILL_ROWS, shape[1], dtype=dtype)
    native_s, upcast_s = cpu_kernel.interleaved_medians(
        (lambda: F.linear(x, weight), lambda: F.linear(x.float(), weight.float())), repeats
    )
    return upcast_s < native_s


def quantized_token_limit(qweight: torch.Tensor, scale: torch.Tensor, repeats: int = 5) -> int:
    """Up to how many rows an int8 / int4 linear (ops/quantize.py operands) stays on the micro-kernels: at least
    TOKEN_COUNTS[-1], and on through QUANTIZED_COUNTS while they beat dequantising the weight for torch's GEMM
    (with VNNI integer dots they win at every count: no limit); measured once per shape and format, 5 turns each
    (with 3, a 15% lead of the micro-kernels at 512 rows was once measured as a loss). 0 where the kernel could not
    be built: every row count takes the dequantised route."""
    if cpu_kernel.best_isa() < 0:
        return 0
    laid = qweight.dim() == 3
    columns = qweight.shape[1] * (8 if laid else 2 if qweight.dtype == torch.uint8 else 1)
    return _measure_quantized(
        (min(weight_rows(qweight), QUANTIZED_ROWS), columns),
        8 if qweight.dtype == torch.int8 else 4,
        columns // scale.shape[1],  # the groups are dimension 1 either way
        torch.get_num_threads(),
        repeats,
        QUANTIZED_COUNTS,  # part of the stored key: limits measured at other counts are measured again
        laid,
    )


def laid_out_wins(data: torch.Tensor, scale: torch.Tensor, repeats: int = 5) -> bool:
    """Whether packed int4 rows [N, K / 2] multiply one token faster laid out (`lay_out`) than row by row, for
    their shape on this machine: only the AVX-512 VNNI kernels read that layout, in panels of 16 rows and steps of
    64 columns (the activations' pairs of blocks)."""
    if cpu_kernel.best_isa() < 2 or data.shape[0] % LANE_ROWS or data.shape[1] % 32:
        return False
    rows = min(data.shape[0], MEASURED_ROWS) // LANE_ROWS * LANE_ROWS
    columns = data.shape[1] * 2
    return _laid_out_wins((rows, columns), columns // scale.shape[1], torch.get_num_threads(), repeats)


@measured(decode=flag)
def _laid_out_wins(shape: tuple[int, int], group: int, threads: int, repeats: int) -> bool:
    q = quantize(torch.empty(1, *shape, dtype=torch.bfloat16).normal_(0, 0.02), 4, group)
    rows, laid = (q.data[0], q.scale[0]), lay_out(q.data[0], q.scale[0])
    x = torch.randn(1, shape[1], dtype=torch.bfloat16)
    row_s, laid_s = cpu_kernel.interleaved_medians(
        [lambda w=w, s=s: torch.ops.hybrid_moe.matvecs(x, [w], [s], [None]) for w, s in (rows, laid)], repeats
    )
    return laid_s < row_s


@measured(decode=count)
def _measure_quantized(
    shape: tuple[int, int], bits: int, group: int, threads: int, repeats: int, counts: tuple[int, ...], laid: bool
) -> int:
    q = quantize(torch.empty(1, *shape, dtype=torch.bfloat16).normal_(0, 0.02), bits, group)
    weight, scale = lay_out(q.data[0], q.scale[0]) if laid else (q.data[0], q.scale[0])
    limit = TOKEN_COUNTS[-1]
    for tokens in counts:
        x = torch.randn(tokens, shape[1], dtype=torch.bfloat16)
        kernel_s, dequantized_s = cpu_kernel.interleaved_medians(
            [lambda x=x, n=n: torch.ops.hybrid_moe.linear(x, weight, scale, None, n) for n in (tokens, 0)], repeats
        )
        if kernel_s >= dequantized_s:
            return limit
        limit = tokens
    return cpu_kernel.UNLIMITED


@measured(decode=count)
def _measure(shape: tuple[int, int], dtype: torch.dtype, threads: int, repeats: int) -> int:
    weight = torch.empty(shape, dtype=dtype).normal_(0, 0.02)  # a weight of its own: the model's may be shared
    limit = 0
    for tokens in TOKEN_COUNTS:
        x = torch.randn(tokens, shape[1], dtype=dtype)
        # the op as a compiled decode graph calls it: its fixed cost decides small linears
        torch_s, kernel_s = cpu_kernel.interleaved_medians(
            (
                lambda x=x: F.linear(x, weight),
                lambda x=x: torch.ops.hybrid_moe.matvecs(x, [weight], [None], [None]),
            ),
            repeats,
        )
        if kernel_s >= torch_s:
            break
        limit = tokens
    return limit
