"""Masked row copies whose indices live in device tensors: how a replayed CUDA graph fills expert slots.

`copy_rows_(dst, dst_idx, src, src_idx)` copies dst[dst_idx[i]] = src[src_idx[i]] for every i with
src_idx[i] >= 0. The indices are decided on the device at replay time (by the cache policy's tensor form), so
nothing about which expert goes where is frozen into the graph, and a skipped row moves no bytes. On CUDA a
Triton kernel reads pinned host memory directly over PCIe (the pinned master's device-mapped address), so a
slot fill needs no host call and overlaps compute on its own stream; elsewhere plain torch indexing does it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .quantize import QuantizedWeight, dequantize

_BLOCK = 4096  # words per program: 16 KiB of an expert row


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on `device` aliasing pinned host memory (unified addressing maps it at the same address):
    kernels that read it pull the bytes over PCIe, with no staging copy."""
    if not host.is_pinned():
        raise ValueError("only pinned host memory can be read by device kernels; pin the host tensor first")

    class _Interface:
        __cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "strides": tuple(s * host.element_size() for s in host.stride()),
            "typestr": "|u1",
            "data": (host.data_ptr(), False),
            "version": 3,
        }

    if host.dtype != torch.uint8:
        return device_view(host.view(torch.uint8), device).view(host.dtype)
    view = torch.as_tensor(_Interface(), device=device)
    view._hybrid_moe_host = host  # type: ignore[attr-defined]  # the view does not own the memory: keep the pinned tensor alive with it
    return view


def _words(t: torch.Tensor) -> torch.Tensor:
    """Rows as flat 4-byte words when they divide evenly (fewer, wider loads), else bytes."""
    flat = t.reshape(t.shape[0], -1).view(torch.uint8)
    return flat.view(torch.int32) if flat.shape[1] % 4 == 0 else flat


def copy_rows_(
    dst: torch.Tensor, dst_idx: torch.Tensor, src: torch.Tensor | QuantizedWeight, src_idx: torch.Tensor
) -> None:
    """dst[dst_idx[i]] = src[src_idx[i]] where src_idx[i] >= 0, in dst's dtype; rows are dim 0 and must match in
    shape. A quantised `src` crosses as stored and is dequantised on the way, another dtype is converted on the
    way: one kernel either way, which reads nothing for a skipped row. No host synchronisation on CUDA."""
    if tuple(dst.shape[1:]) != tuple(src.shape[1:]):
        raise ValueError(f"row shapes differ: dst {tuple(dst.shape[1:])}, src {tuple(src.shape[1:])}")
    if dst.device.type != "cuda":
        keep = src_idx >= 0
        rows = src_idx[keep]
        if isinstance(src, QuantizedWeight):
            values = dequantize(*src.rows(rows), src.bits, src.group_size)
        else:
            values = src[rows]
        dst[dst_idx[keep]] = values.to(dst.device, dst.dtype)
        return
    parts = (src.data, src.scale) if isinstance(src, QuantizedWeight) else (src,)
    if isinstance(src, QuantizedWeight) and src.laid:
        raise ValueError("slot copies read experts row by row: fill slots from experts that are not laid out")
    if not all(t.is_contiguous() for t in (dst, *parts)):
        raise ValueError("slot copies address rows as flat memory: dst and src must be contiguous")
    launch(dst, dst_idx, src, src_idx)


def launch(
    dst: torch.Tensor,
    dst_idx: torch.Tensor,
    src: torch.Tensor | QuantizedWeight,
    src_idx: torch.Tensor,
    kernels: tuple[Any, Any] | None = None,
) -> None:
    """The one Triton launch behind `copy_rows_`: the word copy where dtypes match, else the converting kernel.
    `kernels` (word copy, converting) stands in for the compiled pair: the tests pass interpreted ones."""
    copy_kernel, converting_kernel = kernels or (_kernel(), _converting_kernel())
    if not isinstance(src, QuantizedWeight) and src.dtype == dst.dtype:
        d, s = _words(dst), _words(src)
        copy_kernel[(src_idx.numel(), -(-d.shape[1] // _BLOCK))](d, s, dst_idx, src_idx, d.shape[1], BLOCK=_BLOCK)
        return
    if isinstance(src, QuantizedWeight):
        data, scale, group_size, bits = src.data, src.scale, src.group_size, src.bits
    else:  # no scales for a plain cast: never read
        data, scale, group_size, bits = src, src, 1, 0
    elements = dst[0].numel()
    grid = (src_idx.numel(), -(-elements // _BLOCK))
    converting_kernel[grid](
        dst,
        data,
        scale,
        dst_idx,
        src_idx,
        elements,
        group_size,
        BITS=bits,
        BLOCK=_BLOCK,
    )


@functools.cache
def _kernel():
    """Built on first CUDA use: Triton comes with CUDA builds of torch, not with the CPU wheel."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_rows_kernel(dst, src, dst_idx, src_idx, row_words, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        s = tl.load(src_idx + i)
        d = tl.load(dst_idx + i)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < tl.where(s >= 0, row_words, 0)  # a skipped row (s == -1) moves no word
        row = tl.load(src + s.to(tl.int64) * row_words + offs, mask=mask)
        tl.store(dst + d.to(tl.int64) * row_words + offs, row, mask=mask)

    return copy_rows_kernel


@functools.cache
def _converting_kernel():
    """`copy_rows_` into another dtype: BITS 0 casts; 8 and 4 dequantise int8 / packed int4 (quantize.py's layout:
    column 2j in the low nibble of byte j, q + 8) with one scale per `group` consecutive elements of a row."""
    import triton
    import triton.language as tl

    @triton.jit
    def convert_rows_kernel(
        dst, data, scale, dst_idx, src_idx, elements, group, BITS: tl.constexpr, BLOCK: tl.constexpr
    ):
        i = tl.program_id(0)
        s = tl.load(src_idx + i).to(tl.int64)
        d = tl.load(dst_idx + i).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < tl.where(s >= 0, elements, 0)  # a skipped row (s == -1) reads nothing
        if BITS == 8:
            w = tl.load(data + s * elements + offs, mask=mask).to(tl.float32)
        elif BITS == 4:
            byte = tl.load(data + s * (elements // 2) + offs // 2, mask=mask)
            w = tl.where(offs % 2 == 0, byte & 15, byte >> 4).to(tl.float32) - 8.0
        else:
            w = tl.load(data + s * elements + offs, mask=mask)
        if BITS != 0:
            w = w * tl.load(scale + s * (elements // group) + offs // group, mask=mask).to(tl.float32)
        tl.store(dst + d * elements + offs, w.to(dst.dtype.element_ty), mask=mask)

    return convert_rows_kernel
