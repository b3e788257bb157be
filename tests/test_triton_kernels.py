"""The project's Triton kernels without a GPU: each compiles for an H100 (sm_90, Triton's own ptxas), and runs
under Triton's interpreter on CPU tensors against the torch form it stands in for. Skipped where Triton is
not installed (the CPU wheel of torch does not bring it)."""

import os
import random
import subprocess
import sys

import pytest
import torch

from torch_hybrid_moe.ops import placement_walks, row_copy, slot_swaps

triton = pytest.importorskip("triton", reason="Triton is not installed here")


def _interpreted(build, monkeypatch):
    """The kernels `build` makes, decorated anew under TRITON_INTERPRET=1 (the cached ones stay as they are)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernels = build.__wrapped__()
    if "Interpreted" not in type(kernels[0] if isinstance(kernels, tuple) else kernels).__name__:
        pytest.skip("this Triton decides interpretation at import, before the test could ask for it")
    return kernels


def test_kernels_compile_for_an_h100():
    from triton.backends.compiler import GPUTarget

    dali, hybrimoe, place = placement_walks._kernels()
    f64, i8, i64 = "*fp64", "*i8", "*i64"
    cases = (
        (
            row_copy._kernel(),
            {"dst": "*i32", "src": "*i32", "dst_idx": i64, "src_idx": i64, "row_words": "i32", "BLOCK": "constexpr"},
            {"BLOCK": row_copy._BLOCK},
        ),
        (
            dali,
            {
                "n_ptr": "*fp32",
                "res_ptr": i8,
                "cpu_ptr": f64,
                "gpu_ptr": f64,
                "room_ptr": i64,
                "take_ptr": i8,
                "steps": "constexpr",
            },
            {"steps": 6},
        ),
        (
            hybrimoe,
            {
                "res_ptr": i8,
                "cpu_ptr": f64,
                "gpu_ptr": f64,
                "room_ptr": i64,
                "active_ptr": i64,
                "transfer_ptr": f64,
                "take_ptr": i8,
                "steps": "constexpr",
                "size": "i32",
            },
            {"steps": 6},
        ),
        (
            place,
            {
                "counts_ptr": "*fp32",
                "res_ptr": "*u8",
                "take_ptr": i8,
                "scratch_ptr": f64,
                "slots": "i32",
                **dict.fromkeys(placement_walks._FLOAT_ARGS, i64),
                **dict.fromkeys(("E", "BLOCK_E", "SIZE", "BLOCK"), "constexpr"),
            },
            {"E": 160, "BLOCK_E": 256, "SIZE": 48, "BLOCK": 64},  # DeepSeek-V2's experts, a batch of 8
        ),
    )
    cases += (
        (
            slot_swaps._kernels()[1],
            {"expert_ptr": i64, "slot_ptr": i64, "expert_slot_ptr": i64, "slot_expert_ptr": i64, "K": "constexpr"},
            {"K": 6},
        ),
        (
            slot_swaps._kernels()[0],
            {
                "cand_ptr": f64,
                "keep_ptr": "*u8",
                "values_ptr": "*fp32",
                "slot_expert_ptr": i64,
                "expert_ptr": i64,
                "slot_ptr": i64,
                **dict.fromkeys(("E", "S", "K", "BLOCK_E", "BLOCK_S"), "constexpr"),
            },
            {"E": 160, "S": 40, "K": 40, "BLOCK_E": 256, "BLOCK_S": 64},
        ),
    )
    for bits, data in ((0, "*bf16"), (8, "*i8"), (4, "*u8")):
        cases += (
            (
                row_copy._converting_kernel(),
                {
                    "dst": "*fp32",
                    "data": data,
                    "scale": "*fp32",
                    "dst_idx": i64,
                    "src_idx": i64,
                    "elements": "i32",
                    "group": "i32",
                    "BITS": "constexpr",
                    "BLOCK": "constexpr",
                },
                {"BITS": bits, "BLOCK": row_copy._BLOCK},
            ),
        )
    for fn, signature, constexprs in cases:
        source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"]
    # ours' placement as launched: one warp, no fused multiply-adds, so every float64 sum and product rounds alone
    _, signature, constexprs = next(case for case in cases if case[0] is place)
    source = triton.compiler.ASTSource(fn=place, signature=signature, constexprs=constexprs)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=placement_walks.PLACE_OPTIONS).asm["ptx"]
    assert "div.rn.f64" in ptx and "fma" not in ptx
    # bf16 slots (the usual case) round like torch's .to(): to nearest even (the interpreter truncates instead)
    source = triton.compiler.ASTSource(
        fn=row_copy._converting_kernel(),
        signature={
            "dst": "*bf16",
            "data": "*i8",
            "scale": "*fp32",
            "dst_idx": i64,
            "src_idx": i64,
            "elements": "i32",
            "group": "i32",
            "BITS": "constexpr",
            "BLOCK": "constexpr",
        },
        constexprs={"BITS": 8, "BLOCK": row_copy._BLOCK},
    )
    assert "cvt.rn.bf16.f32" in triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


def test_walk_kernels_make_the_torch_walks_choices(monkeypatch):
    dali, hybrimoe, _ = _interpreted(placement_walks._kernels, monkeypatch)
    rng = random.Random(0)
    sent = 0
    for _ in range(200):
        size = rng.randint(1, 10)
        n = torch.tensor([float(rng.choice([0, 1, 2, 5, 20, 60])) for _ in range(size)])
        resident = torch.tensor([rng.random() < 0.4 for _ in range(size)])
        cpu, gpu = torch.rand(size, dtype=torch.float64), torch.rand(size, dtype=torch.float64)
        room, active, steps = torch.tensor(rng.randint(0, 4)), torch.tensor(rng.randint(0, size)), rng.randint(0, size)
        transfer = rng.random()
        for kernel, args, want in (
            (
                dali,
                (n, resident.to(torch.int8), cpu, gpu, room),
                placement_walks.dali_walk(n, resident, cpu, gpu, room, steps),
            ),
            (
                hybrimoe,
                (resident.to(torch.int8), cpu, gpu, room, active, torch.tensor(transfer, dtype=torch.float64)),
                placement_walks.hybrimoe_walk(resident, cpu, gpu, room, active, transfer, steps),
            ),
        ):
            take = torch.zeros(size, dtype=torch.int8)
            kernel[(1,)](*args, take, steps, *((size,) if kernel is hybrimoe else ()))
            assert torch.equal(take.bool(), want)
            sent += int(want.sum())
    assert sent > 100  # the walks sent experts both ways


_PLACE_CHECK = """
import random, types, torch
from torch_hybrid_moe.cost_model import EXPERT_SHAPES, HARDWARE, CostModel, Terms
from torch_hybrid_moe.ops import placement_walks
from torch_hybrid_moe.policies.device_scheduling import DaliGreedyForm, HybriMoEForm, QueueAwareForm
kernel = placement_walks._kernels()[2]
assert "Interpreted" in type(kernel).__name__
rng = random.Random(0)

def step(sizes):
    experts, tokens = rng.choice(sizes), rng.randint(1, 4)
    top = rng.randint(1, min(6, experts))
    ids = torch.stack([torch.randperm(experts)[:top] for _ in range(tokens)])
    resident = torch.rand(experts) < rng.random()
    return torch.bincount(ids.flatten(), minlength=experts).float(), resident, rng.randint(0, experts), ids.numel()

def terms():  # any shape of cost: the GPU slower than the CPU, overheads that dominate, no read floor
    return Terms(rng.choice([0.0, rng.random()]), rng.random() * rng.choice([0.1, 1, 3]), rng.choice([1.0, 2.0]),
                 rng.random(), rng.choice([0.3, 1.0, 4.0]))

cases, searched = [], 0
for _ in range(30):  # the presets' cost models
    costs = CostModel(HARDWARE[rng.choice(sorted(HARDWARE))], EXPERT_SHAPES[rng.choice(sorted(EXPERT_SHAPES))])
    cases.append((costs, *step([4, 6, 8, 12, 64, 160])))
for _ in range(3000):  # arbitrary ones, kept where the search moves off every start (the torch path is cheap)
    costs = types.SimpleNamespace(cpu=terms(), gpu=terms(), t_transfer=lambda t=rng.random() * 3: t)
    counts, resident, slots, pairs = step([4, 6, 8, 12])  # small layers: the torch form is quick there
    max_active = min(len(counts), pairs)
    want = QueueAwareForm(costs).place(counts, resident, slots, max_active)
    starts = [(counts > 0) & resident]
    starts += [f(costs).place(counts, resident, slots, max_active) for f in (DaliGreedyForm, HybriMoEForm)]
    if not any(torch.equal(want, s) for s in starts):
        cases.append((costs, counts, resident, slots, pairs))
        searched += 1
        if searched == 12:
            break
for costs, counts, resident, slots, pairs in cases:
    form, max_active = QueueAwareForm(costs), min(len(counts), pairs)
    want = form.place(counts, resident, slots, max_active)
    got = form.place_in_one_program(counts, resident, slots, max_active, kernel)
    assert torch.equal(got, want), (costs, counts, resident, slots, got.nonzero(), want.nonzero())
print(searched, len(cases))
"""


def _interpreted_script(script: str) -> list[str]:
    """What `script` prints, run in a fresh process under TRITON_INTERPRET=1: reductions call Triton's own jitted
    combine functions, which run interpreted only when the variable is set before Triton is imported."""
    run = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.split()


def test_placement_program_places_as_the_torch_ops():
    """Queue-aware placement as one program (times, the three starts, the search) against the composed torch form,
    on the presets' cost models and on arbitrary ones where the search moves off every start."""
    printed = _interpreted_script(_PLACE_CHECK)
    searched, cases = map(int, printed[-2:])
    assert searched == 12 and cases == 42


_SWAP_CHECK = """
import random, torch
from torch_hybrid_moe.ops import slot_swaps
from torch_hybrid_moe.policies import device_caching
kernel = slot_swaps._kernels()[0]
assert "Interpreted" in type(kernel).__name__
rng = random.Random(0)

def choose_slot_by_slot(cand, keep, values, slot_expert, k):
    # the Python path, copy by copy: the best candidate (lowest id on a tie) takes the slot the ranking gives up
    # first (a free one, then the least valuable holder, the lowest slot on a tie), never a kept expert's
    held = [float("-inf") if h < 0 else float("inf") if keep[h] else float(values[h]) for h in slot_expert.tolist()]
    cands = sorted(range(len(cand)), key=lambda e: (-float(cand[e]), e))[:k]
    slots = sorted(range(len(held)), key=lambda s: (held[s], s))[:k]
    admit = [float(cand[c]) > float("-inf") and held[v] < float("inf") for c, v in zip(cands, slots)]
    return [c if a else -1 for c, a in zip(cands, admit)], slots

ties = 0
for trial in range(120):
    experts = rng.choice([4, 8, 16, 64, 160])
    slots = rng.randint(1, experts)
    slot_expert = torch.where(torch.rand(slots) < rng.random() + 0.2, torch.randperm(experts)[:slots], -1)
    expert_slot = torch.full((experts,), -1)
    expert_slot[slot_expert[slot_expert >= 0]] = torch.arange(slots)[slot_expert >= 0]
    values = torch.tensor([float(rng.choice([0, 1, 2, 3])) for _ in range(experts)])  # ties everywhere
    keep = torch.rand(experts) < rng.random() * 0.5
    missing = (torch.rand(experts) < rng.random()) & (expert_slot < 0)
    if trial % 2:  # on-demand fetches: the lowest id first
        cand = torch.where(missing, torch.arange(experts, 0, -1, dtype=torch.float64), float("-inf"))
    else:  # the gate prefetch: by priority, with ties
        priority = torch.tensor([rng.choice([0.5, 1.0]) for _ in range(experts)])
        cand = torch.where(missing, priority, float("-inf"))
    k = rng.randint(1, slots)
    want = choose_slot_by_slot(cand, keep, values, slot_expert, k)
    got = slot_swaps.swap_in(cand, keep, values, slot_expert, k, kernel)
    torch_form = device_caching._swap_in(cand, keep, values, expert_slot, slot_expert, k)
    for pair in (got, torch_form):
        assert [pair[0].tolist(), pair[1].tolist()] == list(want), (trial, pair, want)
    ties += len(set(values[slot_expert[slot_expert >= 0]].tolist())) < int((slot_expert >= 0).sum())
print(ties)
"""


def test_swap_program_pairs_candidates_and_slots_as_choose_slot():
    """The on-demand fetches' and the gate prefetch's slot pairing, as one program and as torch ops, against the
    Python path's copy-by-copy choice, on rankings full of ties (top-k orders equal values as it likes; both forms
    must go lowest index first)."""
    printed = _interpreted_script(_SWAP_CHECK)
    assert int(printed[-1]) > 50  # most steps held tied slots


def test_claim_program_updates_the_slot_tables_as_the_torch_form(monkeypatch):
    """Admitted experts take their slots, the holders leave, skipped pairs (-1) change nothing: the program and the
    torch form (masked scatters) leave the same tables, on random pairings as the admissions make them."""
    claim = _interpreted(slot_swaps._kernels, monkeypatch)[1]
    rng = random.Random(0)
    moved = 0
    for _ in range(100):
        experts = rng.choice([4, 8, 16, 64])
        slots = rng.randint(1, experts)
        slot_expert = torch.where(torch.rand(slots) < 0.7, torch.randperm(experts)[:slots], -1)
        expert_slot = torch.full((experts,), -1)
        expert_slot[slot_expert[slot_expert >= 0]] = torch.arange(slots)[slot_expert >= 0]
        k = rng.randint(1, slots)
        missing = (expert_slot < 0).nonzero().flatten()
        newcomers = missing[torch.randperm(len(missing))][:k].tolist()
        expert = torch.tensor([e if rng.random() < 0.7 else -1 for e in newcomers] + [-1] * (k - len(newcomers)))
        slot = torch.randperm(slots)[:k]
        want, got = (expert_slot.clone(), slot_expert.clone()), (expert_slot.clone(), slot_expert.clone())
        slot_swaps.claim_slots(expert, slot, *want)
        slot_swaps.claim_slots(expert, slot, *got, kernel=claim)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert all(want[1][s] == e and want[0][e] == s for e, s in zip(expert.tolist(), slot.tolist()) if e >= 0)
        moved += int((expert >= 0).sum())
    assert moved > 100


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "int4"])
@pytest.mark.parametrize("slots", [torch.float32, torch.float16])  # bf16 slots: rounding checked in the PTX above
def test_converting_row_copy_kernel_equals_the_torch_form(fmt, slots, monkeypatch):
    """Slot fills from masters stored otherwise: dequantised or cast inside the copy, rows without a source
    untouched, exactly what the torch form (dequantize, then cast) writes."""
    from torch_hybrid_moe.ops.quantize import to_cpu_format

    kernel = _interpreted(row_copy._converting_kernel, monkeypatch)
    src = to_cpu_format(torch.randn(5, 6, row_copy._BLOCK // 4 + 64), fmt, 64)  # rows span several programs
    want = torch.full((4, *src.shape[1:]), 7.0, dtype=slots)
    got = want.clone()
    dst_idx, src_idx = torch.tensor([2, 0, 3]), torch.tensor([4, -1, 1])
    row_copy.copy_rows_(want, dst_idx, src, src_idx)  # the torch form (CPU tensors)
    row_copy.launch(got, dst_idx, src, src_idx, (None, kernel))  # the CUDA path's launch, interpreted
    assert torch.equal(got, want) and bool((got[0] == 7.0).all()) and not bool((got[2] == 7.0).any())


def test_row_copy_kernel_copies_what_the_torch_form_copies(monkeypatch):
    kernel = _interpreted(row_copy._kernel, monkeypatch)
    src = torch.randn(6, 3, row_copy._BLOCK + 7)  # rows span two programs
    want, got = torch.zeros(4, *src.shape[1:]), torch.zeros(4, *src.shape[1:])
    dst_idx, src_idx = torch.tensor([2, 0, 3]), torch.tensor([5, -1, 1])  # -1: nothing copied into slot 0
    row_copy.copy_rows_(want, dst_idx, src, src_idx)  # the torch form (CPU tensors)
    row_copy.launch(got, dst_idx, src, src_idx, (kernel, None))  # the CUDA path's launch, interpreted
    assert torch.equal(got, want) and got[0].abs().sum() == 0


def test_swap_program_refuses_more_pairs_than_slots():
    """Every pair must name a real slot (the tables' update indexes by it): refused before anything launches."""
    with pytest.raises(ValueError, match="3 pairs asked of 2 slots"):
        slot_swaps.swap_in(torch.zeros(4), torch.zeros(4, dtype=torch.bool), torch.zeros(4), torch.full((2,), -1), 3)
