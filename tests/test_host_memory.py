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


def test_gather_moves_small_whole_tensors_into_shared_slabs_in_place():
    """Small tensors move into one slab, as the same objects with the same values; large ones, and tensors whose
    storage something unlisted also holds, stay where they are; a tensor listed twice moves once."""
    g = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(1000, 100, generator=g))
    int8 = torch.randint(-128, 127, (3 << 20,), generator=g, dtype=torch.int8)
    big = torch.randn(5 << 20, generator=g)  # 20 MB: `empty` advises such a buffer itself
    shared = torch.randn(100, generator=g)
    twin = shared.detach()  # another tensor on the same storage, not a view: moving one would hold it twice
    pinned = torch.randn(64, 64, generator=g)
    rows, other = pinned[8:], pinned.detach()  # a view, and its base's storage held by a tensor nobody lists
    kept = [t.clone() for t in (param, int8, big)]
    pointers = [t.data_ptr() for t in (big, shared, rows)]

    sparse = torch.eye(4).to_sparse()  # no plain storage: left alone, not an error
    moved = host_memory.gather_on_huge_pages([param, int8, param, big, shared, rows, sparse])

    assert moved == param.nbytes + int8.nbytes
    assert isinstance(param, torch.nn.Parameter) and param.requires_grad
    assert param.untyped_storage().data_ptr() == int8.untyped_storage().data_ptr()  # one slab holds both
    assert param.data_ptr() % 64 == 0 and int8.data_ptr() % 64 == 0
    assert [t.data_ptr() for t in (big, shared, rows)] == pointers and twin.data_ptr() == pointers[1]
    assert other.data_ptr() == pinned.data_ptr() == rows.data_ptr() - 8 * 64 * 4
    for now, before in zip((param, int8, big), kept):
        assert torch.equal(now.detach(), before)


def test_gather_moves_a_storage_with_all_its_views():
    """A weight and views of it (MLA's absorbed value rows over kv_b_proj's rows) move together, still views of one
    storage with their offsets, strides and values; so does a view with the tensor it was taken from, listed or not
    (QuantizedLinear's rows, `data[0]` of a tensor only they hold)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 48, generator=g)
    rows, cols = weight[16:40], weight[:, 8:].t()  # an offset view and a strided one
    halves = torch.randn(32, 8, generator=g)
    as_bytes = halves.view(torch.uint8)  # the same storage under another dtype
    first = torch.randn(2, 8, 8, generator=g)[0]  # a view whose base only it holds
    kept = [t.clone() for t in (weight, rows, cols, halves, first)]
    geometry = [(t.storage_offset(), t.stride()) for t in (rows, cols, as_bytes)]

    moved = host_memory.gather_on_huge_pages([weight, rows, cols, rows, halves, as_bytes, first])

    assert moved == weight.nbytes + halves.nbytes + 2 * first.nbytes
    storage = weight.untyped_storage()
    assert storage.nbytes() > weight.nbytes  # a slab
    assert all(t.untyped_storage().data_ptr() == storage.data_ptr() for t in (rows, cols, halves, as_bytes, first))
    start = weight.storage_offset()
    assert [(t.storage_offset() - start, t.stride()) for t in (rows, cols)] == geometry[:2]
    assert as_bytes.stride() == geometry[2][1] and as_bytes.data_ptr() == halves.data_ptr()
    assert first._base.data_ptr() == first.data_ptr()  # its base moved with it
    for now, before in zip((weight, rows, cols, halves, first), kept):
        assert torch.equal(now, before)
    weight[16, 8] = 7.0  # views still: a write shows through each
    assert rows[0, 8].item() == cols[0, 16].item() == 7.0


def test_gather_leaves_flagged_views_and_stale_bases_alone():
    """A conjugate or negative view, whose flag a rebind would drop, stays with its storage; a view whose `.data` was
    rebound keeps its old base on another storage, which must not be rebound onto the view's bytes."""
    c = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    conj, neg = c.conj(), torch._neg_view(torch.tensor([1.0, -2.0]))
    base = torch.arange(16.0).reshape(4, 4)
    view = base[1:]
    view.data = torch.full((3, 4), -1.0)  # its own storage now; `view._base` is still `base`
    other = view.detach()  # something unlisted holds the view's storage
    pointers = [t.data_ptr() for t in (conj, neg, base, view)]

    assert host_memory.gather_on_huge_pages([conj, neg, view]) == 0
    assert [t.data_ptr() for t in (conj, neg, base, view)] == pointers and other.data_ptr() == view.data_ptr()
    assert conj.tolist() == [1 - 2j, 3 + 4j] and neg.tolist() == [-1.0, 2.0]
    assert torch.equal(base, torch.arange(16.0).reshape(4, 4))


def test_gather_fills_slabs_of_at_most_a_slab_each():
    tensors = [torch.full((3 << 20,), i, dtype=torch.uint8) for i in range(20)]  # 60 MB of 3 MB tensors
    assert host_memory.gather_on_huge_pages(tensors) == 60 << 20
    slabs = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    assert len(slabs) == 2 and max(slabs.values()) <= host_memory.SLAB
    assert all(bool((t == i).all()) for i, t in enumerate(tensors))


@pytest.mark.parametrize("dense", ["model", "int8"])
def test_a_patched_cpu_model_reads_its_small_weights_from_slabs(dense):
    """After patching, the attention projections live in a slab (a storage larger than themselves), also as the
    dense int8 mode's rows and scales (views of the quantiser's output); the input embedding does not; and the model
    gives the unpatched logits (within the int8 mode's error)."""
    from torch_hybrid_moe.tiny_models import tiny_model

    from .conftest import patched_copy
    from .test_exactness import assert_logits_close

    ref = tiny_model("qwen3_moe")
    quantised = {} if dense == "model" else dict(dense_weight_dtype=dense, dense_weight_group_size=32)
    model = patched_copy(ref, expert_budget=0.0, **quantised)
    q_proj = model.model.layers[0].self_attn.q_proj
    for weight in [q_proj.weight] if dense == "model" else [q_proj.qweight, q_proj.scale]:
        assert weight.untyped_storage().nbytes() > weight.nbytes
    embedding = model.get_input_embeddings().weight  # a token reads one row: left where it is
    assert embedding.untyped_storage().nbytes() == embedding.nbytes
    ids = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_logits_close(model(ids).logits, ref(ids).logits, **({} if dense == "model" else dict(rel=0.05)))
