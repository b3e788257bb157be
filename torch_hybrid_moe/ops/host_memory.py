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
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

MADV_HUGEPAGE = 14  # <sys/mman.h>, Linux
HUGE_PAGE = 2 << 20  # smaller buffers cannot hold an aligned huge page
# gather_on_huge_pages moves tensors under GATHERED bytes: glibc serves requests below its mmap threshold, which
# grows to 32 MB, from its heap, whose reused pages an advice no longer reaches (a 4 MB int4 projection of
# Qwen3-30B-A3B's shape sat on 4 KB pages). SLAB: its unit, the most the process grows by while it moves them.
GATHERED, SLAB = 8 * HUGE_PAGE, 16 * HUGE_PAGE
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


def gather_on_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Move the storages under GATHERED bytes of the CPU tensors among `tensors` into slabs on huge pages, rebinding
    each tensor's `.data` in place to the same view of the moved storage (a Parameter or buffer stays the same
    object); returns the bytes moved. A decode token reads every dense weight once, and from 4 KB pages
    DeepSeek-V2-Lite's attention and shared-expert weights (1-3 MB each, int4) were read at 32-34 GB/s against
    36.5-37.4 from slabs (`python benchmarks/decode_layouts.py`, 2026-12-01, benchmarks/RESULTS.md). A storage moves
    with all its tensors, and only where every tensor on it is among `tensors` or one they are views of (MLA's
    absorbed value rows, views of kv_b_proj's rows, move with them; so does the quantiser's output that the dense int8
    / int4 modes' rows are views of); one that anything else holds (a router's weight and its prefetch replay's
    detached copy) would then be held twice, and stays. The originals go back to the kernel slab by slab, so the
    process grows by at most one SLAB meanwhile."""
    moving, moved = _whole_storages(tensors), 0
    while moving:  # slabs of SLAB bytes at most (a storage is under GATHERED), each filled from the next storages
        count, size = 0, 0
        while count < len(moving) and size + _line_aligned(moving[count][0].nbytes()) <= SLAB:
            size += _line_aligned(moving[count][0].nbytes())
            count += 1
        batch, moving = moving[:count], moving[count:]
        slab, offset = empty((size,), torch.uint8), 0
        for storage, members in batch:
            slab[offset : offset + storage.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
            for t in members:
                at = offset // t.element_size() + t.storage_offset()
                t.data = torch.empty(0, dtype=t.dtype).set_(slab.untyped_storage(), at, t.shape, t.stride())
            offset += _line_aligned(storage.nbytes())
            moved += storage.nbytes()
        del batch, storage, members  # the originals' last holders: freed now, with their heap pages below
        release_free_heap()
    return moved


def _whole_storages(tensors: Iterable[torch.Tensor]) -> list[tuple[torch.UntypedStorage, list[torch.Tensor]]]:
    """(storage, its tensors) for each plain CPU storage under GATHERED bytes that only tensors among `tensors` and the
    tensors they are views of hold (each tensor holds its storage once, and so does the one storage object kept here);
    a tensor listed twice counts once."""
    groups: dict[int, tuple[torch.UntypedStorage, dict[int, torch.Tensor]]] = {}
    for t in tensors:
        if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized or type(t) not in _PLAIN:
            continue  # sparse, quantised and subclass tensors have no plain storage of their own to move
        storage = t.untyped_storage()
        # a conjugate or negative view would lose its flag when rebound: left out, its storage stays (use count)
        if 0 < storage.nbytes() < GATHERED and storage.nbytes() % t.element_size() == 0 and not _flagged(t):
            members = groups.setdefault(storage.data_ptr(), (storage, {}))[1]
            members[id(t)] = t
            base = t._base  # the tensor a view was taken from holds the storage too (QuantizedLinear's rows: data[0])
            if base is not None and not _flagged(base) and base.untyped_storage().data_ptr() == storage.data_ptr():
                members[id(base)] = base  # (a view whose .data was rebound keeps a base on another storage)
    return [
        (storage, list(members.values()))
        for storage, members in groups.values()
        if torch._C._storage_Use_Count(storage._cdata) == len(members) + 1
    ]


def _flagged(t: torch.Tensor) -> bool:
    return t.is_conj() or t.is_neg()


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _line_aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64
