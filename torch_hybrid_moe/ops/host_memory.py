"""Host weights on transparent huge pages.

A decode token streams every active weight from DRAM once. On 4 KB pages a bf16 row of 2048 columns is one page,
and the stream takes a TLB miss per row; where Linux's transparent huge pages are on request ("madvise", the
usual default) a weight allocated by torch stays on 4 KB pages. On 2 MB pages the micro-kernels read a Qwen3 LM
head at 64 GB/s against 54 in one run on 2 threads of an AVX-512 EPYC (`python benchmarks/cpu_decode_costs.py`
prints both).
So buffers that will hold weights are advised before anything is written to them (an advice on pages already
touched only lets the kernel's background collapse reach them, slowly).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

MADV_HUGEPAGE = 14  # <sys/mman.h>, Linux
HUGE_PAGE = 2 << 20  # smaller buffers cannot hold an aligned huge page
FILL_THREADS = max(1, min(4, os.cpu_count() or 1))  # threads filling one layer's expert weights at once


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return fn


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None).malloc_trim  # glibc's; musl and others lack it
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_size_t,), ctypes.c_int
    return fn


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the kernel (glibc's malloc_trim, every arena). Freed temporaries of a
    load (blocks read and converted on FILL_THREADS threads, each with its own arena) otherwise stay resident and
    raise the process's peak by the next layer; a no-op where the C library has no malloc_trim."""
    if (trim := _malloc_trim()) is not None:
        trim(0)


def advise_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """Ask for 2 MB pages under a CPU tensor's storage (the whole pages inside it: never a neighbour's), and return
    it. Meant for buffers not yet written; a no-op off Linux, for small or non-CPU tensors, or where the kernel
    refuses (THP off: the pages stay 4 KB, nothing else changes)."""
    madvise = _madvise()
    storage = tensor.untyped_storage()
    if madvise is None or tensor.device.type != "cpu" or storage.nbytes() < 2 * HUGE_PAGE:
        return tensor
    start = storage.data_ptr()
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = (start + storage.nbytes()) // mmap.PAGESIZE * mmap.PAGESIZE
    madvise(first, last - first, MADV_HUGEPAGE)
    return tensor


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty on the CPU, on huge pages where the kernel grants them: for weights filled after allocation."""
    return advise_huge_pages(torch.empty(shape, dtype=dtype))


def fill_in_parallel(fill: Callable[[int], None], count: int) -> None:
    """fill(0), ..., fill(count - 1) on FILL_THREADS threads: a read into fresh memory is bound by faulting it in
    (zeroing, huge-page compaction), which runs on the reading thread's core. A filler's error is raised here."""
    with ThreadPoolExecutor(FILL_THREADS) as pool:
        list(pool.map(fill, range(count)))
