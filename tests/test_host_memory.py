"""Weights on transparent huge pages (ops/host_memory.py)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_hybrid_moe.ops import host_memory

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def anon_huge_kb() -> int:
    line = next(ln for ln in Path("/proc/self/smaps_rollup").read_text().splitlines() if ln.startswith("AnonHuge"))
    return int(line.split()[1])


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_advised_buffer_lands_on_huge_pages():
    before = anon_huge_kb()
    t = host_memory.empty((64 * 2**20,), torch.uint8)
    t.fill_(7)
    assert anon_huge_kb() - before >= 8 * 1024  # a few of its 2 MB pages at least (memory may be fragmented)
    assert bool((t == 7).all())


def test_small_and_filled_tensors_are_left_as_they_are():
    small = torch.arange(10)
    assert host_memory.advise_huge_pages(small) is small and small.tolist() == list(range(10))
    big = torch.arange(2**21, dtype=torch.float32)
    assert host_memory.advise_huge_pages(big) is big and torch.equal(big, torch.arange(2**21, dtype=torch.float32))


FREED_HEAP = """
import threading, torch
from pathlib import Path
from torch_hybrid_moe.ops import host_memory

def anon_kb():
    lines = Path("/proc/self/status").read_text().splitlines()
    return next(int(ln.split()[1]) for ln in lines if ln.startswith("RssAnon"))

kept = []
def work():  # 64 KiB tensors sit below glibc's mmap threshold: they come from the thread's heap arena
    blocks = [torch.ones(16 * 1024) for _ in range(2048)]  # 128 MiB, touched
    kept.append(torch.ones(16 * 1024))  # allocated last: the arena's top stays in use, so free() cannot shrink it
    del blocks
threads = [threading.Thread(target=work) for _ in range(2)]
[t.start() for t in threads]
[t.join() for t in threads]
before = anon_kb()
host_memory.release_free_heap()
print(before, anon_kb())
"""


@pytest.mark.skipif(host_memory._malloc_trim() is None, reason="no glibc malloc_trim here")
def test_freed_heap_pages_go_back_to_the_kernel():
    """A load's freed temporaries would otherwise stay resident in the threads' arenas (a fresh process: a clean
    heap)."""
    out = subprocess.run([sys.executable, "-c", FREED_HEAP], capture_output=True, text=True, check=True).stdout
    before, after = map(int, out.split())
    assert before - after >= 128 * 1024  # at least half of the 256 MiB freed left the process
