"""Masked row copies whose indices live in device tensors: how a replayed CUDA graph fills expert slots.

`copy_rows_(dst, dst_idx, src, src_idx)` copies dst[dst_idx[i]] = src[src_idx[i]] for every i with
src_idx[i] >= 0. The indices are decided on the device at replay time (by the cache policy's tensor form), so
nothing about which expert goes where is frozen into the graph, and a skipped row moves no bytes. On CUDA a
Triton kernel reads pinned host memory directly over PCIe (the pinned master's device-mapped address), so a
slot fill needs no host call and overlaps compute on its own stream; elsewhere plain torch indexing does it.
"""

from __future__ import annotations

import functools

import torch

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
    view._hybrid_moe_host = host  # the view does not own the memory: keep the pinned tensor alive with it
    return view


def _words(t: torch.Tensor) -> torch.Tensor:
    """Rows as flat 4-byte words when they divide evenly (fewer, wider loads), else bytes."""
    flat = t.reshape(t.shape[0], -1).view(torch.uint8)
    return flat.view(torch.int32) if flat.shape[1] % 4 == 0 else flat


def copy_rows_(dst: torch.Tensor, dst_idx: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor) -> None:
    """dst[dst_idx[i]] = src[src_idx[i]] where src_idx[i] >= 0; rows are dim 0 and must match in dtype and shape.
    No host synchronisation on CUDA."""
    if dst.shape[1:] != src.shape[1:] or dst.dtype != src.dtype:
        raise ValueError(f"row shapes/dtypes differ: dst {dst.dtype}{tuple(dst.shape[1:])}, "
                         f"src {src.dtype}{tuple(src.shape[1:])}")
    if dst.device.type != "cuda":
        keep = src_idx >= 0
        dst[dst_idx[keep]] = src[src_idx[keep]].to(dst.device)
        return
    d, s = _words(dst), _words(src)
    grid = (src_idx.numel(), -(-d.shape[1] // _BLOCK))
    _kernel()[grid](d, s, dst_idx, src_idx, d.shape[1], BLOCK=_BLOCK)


@functools.cache
def _kernel():  # noqa: ANN202 - a Triton JIT function
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
