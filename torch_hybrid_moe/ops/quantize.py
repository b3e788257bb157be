"""Weight-only int8 / int4 expert weights with one fp16 scale per group of columns.

At decode the CPU experts' time is their bytes over memory bandwidth, so fewer bytes per weight is a
direct speedup (at 32-column groups, as GGUF's Q8_0 / Q4_0 blocks: int8 about 1.9x fewer bytes than bf16, int4
about 3.6x; fp32 scales made int4 0.625 bytes a weight against 0.5625, a ninth more to read). The kernel
multiplies them in integers, by activations rounded to int8 per 32 columns (`quantize_activations`). The
layout is the one `csrc/moe_cpu.cpp` reads: int8 as is; int4 as q + 8 in [0, 15], columns 2j and 2j + 1
in the low and high nibble of byte j. Symmetric rounding to nearest: w ~ q * scale, with the scale rounded up to
fp16 first and q rounded against it (so |q| stays in range and the fp16 rounding adds no error beyond q's own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import host_memory

BITS = {"int8": 8, "int4": 4}
SCALE_DTYPE = torch.float16
# The scales' range: the smallest positive fp16 (a group below it is all but zero: its weights come back within
# 2^-25 of themselves) and the largest.
SCALE_MIN, SCALE_MAX = 2.0**-24, torch.finfo(SCALE_DTYPE).max
QUANTIZE_ELEMENTS = 1 << 22  # weights converted at a time: 16 MiB of fp32 temporaries, not an LM head's or expert's


def block_rows(columns: int) -> int:
    """Rows of a `columns`-wide weight quantised, dequantised or read at a time (QUANTIZE_ELEMENTS weights)."""
    return max(1, QUANTIZE_ELEMENTS // columns)


@dataclass(frozen=True)
class QuantizedWeight:
    """[E, N, K] expert weights quantised along K (the reduction dimension) in groups of `group_size`. int4 experts
    may be laid out for the AVX-512 kernel (`lay_out`, expert by expert: `laid`); `rows` reads them row by row."""

    data: torch.Tensor  # int8 [E, N, K], or uint8 [E, N, K / 2] for int4 (laid out: [E, N / 16, K / 8, 64])
    scale: torch.Tensor  # fp16 [E, N, K / group_size] (laid out: [E, N / 16, K / group_size, 16])
    bits: int
    group_size: int

    @classmethod
    def from_kernel_operands(cls, data: torch.Tensor, scale: torch.Tensor) -> QuantizedWeight:
        """The weight `hybrid_moe::cpu_experts` was given: int8 or packed int4 (uint8), group size from the scales."""
        bits = 8 if data.dtype == torch.int8 else 4
        columns = data.shape[-1] * (8 // bits)
        return cls(data, scale, bits, columns // scale.shape[-1])

    @property
    def laid(self) -> bool:
        return self.data.dim() == 4

    @property
    def shape(self) -> tuple[int, int, int]:
        if self.laid:
            e, panels, vectors, _ = self.data.shape
            return e, panels * LANE_ROWS, vectors * 8
        e, n, k = self.data.shape
        return e, n, k * 2 if self.bits == 4 else k

    def rows(self, experts: int | slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(data, scale) of experts `experts` as stored row by row ([N, K'] / [N, K / group], or [k, ...] for a
        slice or index tensor), on the device they are: views where the experts are not laid out, else new tensors."""
        if not self.laid:
            return self.data[experts], self.scale[experts]
        return row_major(self.data[experts], self.scale[experts])

    def __getitem__(self, expert: int) -> torch.Tensor:
        """Expert `expert` dequantised to fp32: what the kernel computes with, for fallbacks and slot fills."""
        return dequantize(*self.rows(expert), self.bits, self.group_size)

    def nbytes_per_expert(self) -> int:
        return self.data[0].nbytes + self.scale[0].nbytes


def bytes_per_weight(bits: int, group_size: int) -> float:
    """Host bytes per weight of a `bits`-bit format with one fp16 scale per `group_size` columns."""
    return bits / 8 + 2 / group_size


def expert_bytes_per_weight(bits: int, group_size: int, hidden: int, inter: int) -> float:
    """Host bytes per weight of one SiLU-gated expert (gate and up: `hidden` columns; down: `inter`) quantised in
    groups of `group_size`, each projection in the group `check_group_size` gives it: a projection narrower than the
    group has one scale per row, so an expert's bytes are not `bytes_per_weight(bits, group_size)` there."""
    gate_up = bytes_per_weight(bits, check_group_size(hidden, group_size))
    down = bytes_per_weight(bits, check_group_size(inter, group_size))
    return (2 * gate_up + down) / 3


def check_group_size(columns: int, group_size: int, options: str = "cpu_weight") -> int:
    """The group used for a K-column weight: min(group_size, K); it must be a multiple of 32 dividing K. `options`:
    the prefix of the config options the error names (`dense_weight` for the dense layers')."""
    group = min(group_size, columns)
    if group % 32 or columns % group:
        smaller = f"try {options}_group_size=32, or " if group_size > 32 and columns % 32 == 0 else ""
        raise ValueError(
            f"cannot quantise {columns} columns in groups of {group_size}: the group must be a multiple of 32 "
            f"that divides the column count ({smaller}keep {options}_dtype='model')"
        )
    return group


def quantize(weight: torch.Tensor, bits: int, group_size: int) -> QuantizedWeight:
    """Quantise [E, N, K] weights expert by expert (peak extra memory: one expert in fp32)."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    num_experts, rows, cols = weight.shape
    group = check_group_size(cols, group_size)
    qmax = 127 if bits == 8 else 7
    data = host_memory.empty(
        (num_experts, rows, cols if bits == 8 else cols // 2), torch.int8 if bits == 8 else torch.uint8
    )
    scale = host_memory.empty((num_experts, rows, cols // group), SCALE_DTYPE)
    step = block_rows(cols)  # a dense weight (an LM head) is one expert: bound the fp32 temporaries
    for e in range(num_experts):
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            w = weight[e, r0:r1].detach().to("cpu", torch.float32).reshape(r1 - r0, cols // group, group)
            s = fp16_scales(w.abs().amax(dim=-1) / qmax, qmax)
            q = torch.round(w / s.float().unsqueeze(-1)).clamp_(-qmax - (bits == 4), qmax).reshape(r1 - r0, cols)
            scale[e, r0:r1] = s
            if bits == 8:
                data[e, r0:r1] = q.to(torch.int8)
            else:
                u = (q + 8).to(torch.uint8)
                data[e, r0:r1] = u[:, 0::2] | (u[:, 1::2] << 4)
    return QuantizedWeight(data, scale, bits, group)


LANE_ROWS = 16  # rows of a laid-out int4 panel: the AVX-512 kernel's lanes


def lay_out(data: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed int4 rows [..., N, K / 2] (N a multiple of 16, K of 64) and their fp16 scales [..., N, K / group] in the
    order the AVX-512 kernel reads a decode token's products fastest (its `Matrix::laid`): [..., N / 16, K / 8, 64],
    each 64 bytes four of every row of a panel of 16, and scales [..., N / 16, K / group, 16] (leading dimensions:
    experts, each laid out alone). The same bytes in another order, so a product is unchanged but for the order of its
    fp32 sums; `row_major` undoes it. New CPU tensors."""
    *lead, n, half = data.shape
    if data.dtype != torch.uint8 or n % LANE_ROWS or half % 32 or scale.shape[:-1] != data.shape[:-1]:
        raise ValueError(f"lay_out takes packed int4 rows [N, K / 2], N and K multiples of 16 and 64: {data.shape}")
    panels = n // LANE_ROWS
    laid = host_memory.empty((*lead, panels, half // 4, 64), torch.uint8)
    laid.view(*lead, panels, half // 4, LANE_ROWS, 4).copy_(
        data.view(*lead, panels, LANE_ROWS, half // 4, 4).transpose(-3, -2)
    )
    laid_scale = host_memory.empty((*lead, panels, scale.shape[-1], LANE_ROWS), scale.dtype)
    laid_scale.copy_(scale.view(*lead, panels, LANE_ROWS, -1).transpose(-2, -1))
    return laid, laid_scale


def lay_out_experts_(weight: QuantizedWeight) -> QuantizedWeight:
    """int4 experts [E, N, K] laid out (`lay_out`) in place, one expert at a time (peak extra memory: one expert's
    bytes, not a layer's); the weight that reads them so. `weight` itself must not be used after."""
    experts, rows, columns = weight.shape
    if weight.bits != 4 or weight.laid or rows % LANE_ROWS or columns % 64:
        raise ValueError(f"lay_out_experts_ takes int4 rows, N and K multiples of 16 and 64: {weight.shape}")
    half = columns // 2
    data = weight.data.view(experts, rows // LANE_ROWS, half // 4, 64)
    scale = weight.scale.view(experts, rows // LANE_ROWS, weight.scale.shape[2], LANE_ROWS)
    for e in range(experts):
        laid = lay_out(weight.data[e], weight.scale[e])
        data[e].copy_(laid[0])
        scale[e].copy_(laid[1])
    return QuantizedWeight(data, scale, 4, weight.group_size)


def weight_rows(weight: torch.Tensor) -> int:
    """A dense weight's output features: its rows, or 16 a panel where it is laid out (3-D)."""
    return weight.shape[0] * (LANE_ROWS if weight.dim() == 3 else 1)


def row_major(laid: torch.Tensor, laid_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`lay_out`'s inverse: packed int4 rows [..., N, K / 2] and scales [..., N, K / group], new tensors on the laid-out
    ones' device (on the CPU, where the kernel grants them, on huge pages)."""
    return laid_rows(laid, scales=False), laid_rows(laid_scale, scales=True)


def laid_rows(laid: torch.Tensor, scales: bool) -> torch.Tensor:
    """One half of `row_major`: the data [..., N / 16, K / 8, 64] or (`scales`) the scales [..., N / 16, K / group,
    16] of laid-out rows as rows [..., N, K / 2] or [..., N, K / group]."""
    *lead, panels, inner, _ = laid.shape
    shape = (*lead, panels * LANE_ROWS, inner if scales else inner * 4)
    if laid.device.type == "cpu":
        rows = host_memory.empty(shape, laid.dtype)
    else:
        rows = torch.empty(shape, dtype=laid.dtype, device=laid.device)
    if scales:
        rows.view(*lead, panels, LANE_ROWS, inner).copy_(laid.transpose(-2, -1))
    else:
        panel_rows = laid.view(*lead, panels, inner, LANE_ROWS, 4).transpose(-3, -2)
        rows.view(*lead, panels, LANE_ROWS, inner, 4).copy_(panel_rows)
    return rows


def fp16_scales(scale: torch.Tensor, qmax: int) -> torch.Tensor:
    """fp32 group scales (max |w| / qmax) as fp16, each rounded up to the next fp16 value (never below, so no weight
    needs a |q| past qmax) and at least SCALE_MIN (an all-zero group: any scale reproduces it). ValueError on weights
    the format cannot hold."""
    if not bool(torch.isfinite(scale).all()) or bool((scale > SCALE_MAX).any()):
        raise ValueError(
            f"cannot quantise weights of magnitude {float(scale.max()) * qmax:.3g} (or non-finite): the int8 / int4 "
            f"formats' fp16 group scales hold at most {SCALE_MAX * qmax:.3g}; keep cpu_weight_dtype='model'"
        )
    scale = scale.clamp(min=SCALE_MIN)
    rounded = scale.to(SCALE_DTYPE)
    below = rounded.float() < scale
    return torch.where(below, torch.nextafter(rounded, torch.full_like(rounded, torch.inf)), rounded)


def dequantize(data: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """fp32 weights [..., N, K] from their quantised form (on whatever device the data lives)."""
    if bits == 8:
        q = data.to(torch.float32)
    else:
        low, high = (data & 15).to(torch.float32) - 8, (data >> 4).to(torch.float32) - 8
        q = torch.stack((low, high), dim=-1).flatten(-2)
    groups = q.unflatten(-1, (-1, group_size))
    return (groups * scale.float().unsqueeze(-1)).flatten(-2)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K % 32 == 0) as int8 / int4 layers compute with it: rounded to int8 per block of 32 columns,
    scale = max |x| / 127, as the C++ kernel's integer dot products (and llama.cpp's q8_0 activations) do; in fp32.
    Every route through a quantised layer applies it, so where a product runs does not change its value. A block
    whose 1 / scale is not finite (all zeros, or |x| below 127 / FLT_MAX) becomes zeros."""
    blocks = x.float().unflatten(-1, (-1, 32))
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = 1 / scale
    inverse = torch.where(inverse.isfinite(), inverse, torch.zeros_like(inverse))
    return (torch.round(blocks * inverse) * scale).flatten(-2)


def to_cpu_format(weight: torch.Tensor, fmt: str, group_size: int) -> torch.Tensor | QuantizedWeight:
    """[E, N, K] expert weights in a `HybridMoEConfig.cpu_weight_dtype` format ("model" returns them as they are;
    the others are new CPU tensors, on huge pages where the kernel grants them)."""
    if fmt == "model":
        return weight
    if fmt == "bfloat16":
        return host_memory.empty(tuple(weight.shape), torch.bfloat16).copy_(weight.detach())
    return quantize(weight, BITS[fmt], group_size)


def empty_cpu_format(
    shape: tuple[int, int, int], dtype: torch.dtype, fmt: str, group_size: int
) -> torch.Tensor | QuantizedWeight:
    """Uninitialised [E, N, K] expert weights of dtype `dtype` in a `cpu_weight_dtype` format, filled one expert at
    a time by `set_expert`: a loader converting as it reads never holds a whole layer in the source format."""
    experts, rows, cols = shape
    if fmt in ("model", "bfloat16"):
        return host_memory.empty(shape, dtype if fmt == "model" else torch.bfloat16)
    bits, group = BITS[fmt], check_group_size(cols, group_size)
    data = host_memory.empty(
        (experts, rows, cols if bits == 8 else cols // 2), torch.int8 if bits == 8 else torch.uint8
    )
    return QuantizedWeight(data, host_memory.empty((experts, rows, cols // group), SCALE_DTYPE), bits, group)


def set_expert(dst: torch.Tensor | QuantizedWeight, expert: int, weight: torch.Tensor, row: int = 0) -> None:
    """Rows `row`... of expert `expert` of `dst` (from `empty_cpu_format`) from an [n, K] weight (all N rows by
    default), converted to dst's format."""
    rows = slice(row, row + weight.shape[0])
    if isinstance(dst, QuantizedWeight):
        q = quantize(weight.unsqueeze(0), dst.bits, dst.group_size)
        dst.data[expert, rows], dst.scale[expert, rows] = q.data[0], q.scale[0]
    else:
        dst[expert, rows].copy_(weight)


def kernel_operands(weight: torch.Tensor | QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weights, scales or None) as `hybrid_moe::cpu_experts` takes them."""
    if isinstance(weight, QuantizedWeight):
        return weight.data, weight.scale
    return weight, None
