"""Weights on transparent huge pages (ops/host_memory.py)."""

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
