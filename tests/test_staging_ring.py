"""The prefill staging ring: which experts stream (against every subset), what they compute (against the per-expert
float64 loop), and a patched model streaming them (against the unpatched model). CPU-run: the CPU stands in for
CUDA (where alone streaming pays; `cpu_as_cuda`), and on CUDA the same code adds a copy stream and events, which
test_cuda.py's GPU runs cover."""

import copy
import itertools
import random

import pytest
import torch

import torch_hybrid_moe as thm
from torch_hybrid_moe.cost_model import EXPERT_SHAPES, HARDWARE, CostModel
from torch_hybrid_moe.ops.expert_math import expert_into_
from torch_hybrid_moe.ops.quantize import dequantize, lay_out_experts_, quantize
from torch_hybrid_moe.policies.streaming import plan_streaming, streaming_makespan
from torch_hybrid_moe.runtime import staging_ring
from torch_hybrid_moe.runtime.expert_store import ExpertStore
from torch_hybrid_moe.runtime.staging_ring import StagingRing

from .conftest import float64_experts
from .test_exactness import assert_logits_close, inputs

COSTS = [CostModel(HARDWARE[h], EXPERT_SHAPES[s]) for h in ("dali", "rtx4090", "rtx5090") for s in EXPERT_SHAPES]


@pytest.mark.parametrize("costs", COSTS, ids=lambda c: f"{c.hardware.name}-{c.expert.name}")
def test_plan_is_the_best_subset(costs):
    """Against brute force over every subset of the CPU's experts, on prompts of 16 to 4096 tokens."""
    rng = random.Random(0)
    for tokens in (16, 128, 512, 4096):
        for _ in range(5):
            counts = [rng.randint(0, 2 * tokens // 8) for _ in range(12)]
            active = [e for e, c in enumerate(counts) if c]
            accelerator = active[:2]
            cpu = active[2:]
            streamed = plan_streaming(counts, cpu, accelerator, costs)
            assert set(streamed) <= set(cpu)
            got = streaming_makespan(counts, streamed, sorted(set(cpu) - set(streamed)), accelerator, costs)
            best = min(
                streaming_makespan(counts, s, sorted(set(cpu) - set(s)), accelerator, costs)
                for k in range(len(cpu) + 1)
                for s in itertools.combinations(cpu, k)
            )
            assert got == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("costs", COSTS, ids=lambda c: f"{c.hardware.name}-{c.expert.name}")
def test_lone_token_streams_nothing(costs):
    """A step of one token on one CPU expert: the CPU computes it before the link could copy it, on every preset
    (a decode token's eight CPU experts may stream one where the CPU is slow beside the link: the plan's choice)."""
    assert plan_streaming([0, 1], [1], [], costs) == []


def _experts(num_experts=6, hidden=64, inter=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5,
        torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5,
    )


@pytest.mark.parametrize("depth", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("bits", [None, 4, "laid"])
@pytest.mark.parametrize("streamed", [[4, 0, 5, 2], [3, 1, 5, 0, 2, 4]])
def test_ring_computes_streamed_pairs(depth, bits, streamed, monkeypatch):
    """More experts than buffers (each buffer reused), int4 masters dequantised into the buffers (row by row, or
    "laid" out for the CPU kernel's lanes, as a store with no slots may hold them); with four buffers
    or more, half of them computed together by grouped GEMMs while the other half fills, a group's consecutive ids
    copied together: the sum over the streamed experts' pairs, and nothing of the others, against the float64
    per-expert loop."""
    grouped = []  # the experts of each grouped call
    monkeypatch.setattr(
        staging_ring, "expert_into_", lambda *a: (a[7] is not None and grouped.append(len(a[4]))) or expert_into_(*a)
    )
    gate_up, down = _experts(inter=64 if bits == "laid" else 32)  # laid out: steps of 64 columns
    if bits:
        qg, qd = quantize(gate_up, 4, 32), quantize(down, 4, 32)
        gate_up, down = (dequantize(q.data, q.scale, q.bits, q.group_size) for q in (qg, qd))
        if bits == "laid":
            qg, qd = lay_out_experts_(qg), lay_out_experts_(qd)
        store = ExpertStore(qg, qd, 0, torch.device("cpu"), torch.float32)
    else:
        store = ExpertStore(gate_up, down, 0, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(40, 64, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(40)])
    weights = torch.rand(40, 2, generator=g)
    got = torch.zeros(40, 64)
    copies = []  # (first expert, experts) of each copy
    copy_experts = store.copy_experts
    monkeypatch.setattr(store, "copy_experts", lambda e, gu, dn: copies.append((e, len(gu))) or copy_experts(e, gu, dn))
    ring = StagingRing(store.device, tuple(gate_up.shape[1:]), tuple(down.shape[1:]), torch.float32, depth)
    moved = ring.run(store, got, hidden, ids, weights, streamed)
    assert moved == len(streamed) * store.expert_bytes
    only = torch.where(torch.isin(ids, torch.tensor(streamed)), ids, -1)
    want = float64_experts(hidden, only, weights, gate_up.double(), down.double(), rounded=bits is not None)
    assert torch.allclose(got.double(), want, rtol=0, atol=1e-5)
    group = min(depth // 2, -(-len(streamed) // 2)) if depth >= 4 else 1  # at least two groups
    assert grouped == ([min(group, len(streamed) - g) for g in range(0, len(streamed), group)] if group > 1 else [])
    order = sorted(streamed)  # each group's runs of consecutive ids, in one copy each
    runs = []
    for g in range(0, len(order), group):
        for e in order[g : g + group]:
            if runs and e == runs[-1][0] + runs[-1][1] and runs[-1][0] >= order[g]:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((e, 1))
    assert copies == runs


def test_ring_refuses_no_buffers():
    with pytest.raises(ValueError, match="at least one buffer"):
        StagingRing(torch.device("cpu"), (64, 64), (64, 32), torch.float32, 0)


@pytest.fixture
def cpu_as_cuda(monkeypatch):
    """Streaming planned as on CUDA while the CPU stands in for the accelerator (it never streams there itself)."""
    from torch_hybrid_moe.model_patches import base
    from torch_hybrid_moe.runtime import costs

    monkeypatch.setattr(
        base, "streaming_costs", lambda config, device_type, *a: costs.streaming_costs(config, "cuda", *a)
    )


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v2"])
def test_patched_model_streams_prefill_exactly(reference_models, arch, cpu_as_cuda):
    """A cost model that streams (the CPU stand-in as the accelerator): prefill streams some experts and computes
    the rest on the CPU, decode streams none, and the logits are the unpatched model's."""
    ref = reference_models[arch]
    model = thm.patch_model(copy.deepcopy(ref), expert_budget=0.25, hardware="dali", expert_shape="deepseek-v2-lite")
    with torch.no_grad():
        x = inputs(3, 64)
        assert_logits_close(model(x).logits, ref(x).logits)
        prefill = thm.stats(model)
        assert all(s.streamed_experts > 0 and s.cpu_experts > 0 for s in prefill.values())
        thm.reset_stats(model)
        x = inputs(1, 1)
        assert_logits_close(model(x).logits, ref(x).logits)
        assert all(s.streamed_experts == 0 for s in thm.stats(model).values())


def test_the_cpu_itself_never_streams(reference_models):
    """Without CUDA the accelerator is the CPU: a copy into CPU buffers gains nothing, whatever the cost model."""
    model = thm.patch_model(
        copy.deepcopy(reference_models["mixtral"]), expert_budget=0.25, hardware="dali", expert_shape="deepseek-v2-lite"
    )
    with torch.no_grad():
        model(inputs(3, 64))
    assert all(s.streamed_experts == 0 and s.cpu_experts > 0 for s in thm.stats(model).values())


def test_staging_slots_off_and_bad(reference_models, cpu_as_cuda):
    """0 buffers: nothing streams whatever the cost model; a negative count is refused."""
    model = thm.patch_model(
        copy.deepcopy(reference_models["mixtral"]),
        expert_budget=0.25,
        hardware="dali",
        expert_shape="deepseek-v2-lite",
        staging_slots=0,
    )
    with torch.no_grad():
        model(inputs(3, 64))
    assert all(s.streamed_experts == 0 for s in thm.stats(model).values())
    with pytest.raises(ValueError, match="staging_slots must be a non-negative int"):
        thm.HybridMoEConfig(staging_slots=-1)


@pytest.mark.slow
def test_chunked_prefill_matches(reference_models, cpu_as_cuda):
    """Long prompts prefill in chunks through transformers' `prefill_chunk_size`, streaming per chunk: the same
    greedy tokens as one whole-prompt prefill of the unpatched model."""
    ref = reference_models["qwen3_moe"]
    model = thm.patch_model(copy.deepcopy(ref), expert_budget=0.25, hardware="dali", expert_shape="deepseek-v2-lite")
    x = inputs(1, 96)
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = ref.generate(x, **settings)
        got = model.generate(x, prefill_chunk_size=32, **settings)
    assert torch.equal(got, want)
    assert all(s.streamed_experts > 0 for s in thm.stats(model).values())


def test_cpu_share_worker_computes_with_its_own_thread_count():
    """A CPU share beside the accelerator's runs one thread short (runtime/layer.py): on its worker, which keeps that
    count for every share, while the thread that queues the accelerator's work keeps its own."""
    from torch_hybrid_moe.runtime.layer import cpu_share_worker

    before = torch.get_num_threads()
    try:
        worker = cpu_share_worker(1)
        assert worker.submit(torch.get_num_threads).result() == 1
        assert cpu_share_worker(1) is worker and worker.submit(torch.get_num_threads).result() == 1
        assert torch.get_num_threads() == before
    finally:  # ATen starts later threads with the worker's count: the rest of the suite's with this process's
        torch.set_num_threads(before)
