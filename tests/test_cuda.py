"""The same exactness on a real CUDA accelerator: pinned host masters, slots in GPU memory."""

import pytest
import torch

import torch_hybrid_moe as thm
from torch_hybrid_moe.config import OURS_WINDOW
from torch_hybrid_moe.runtime import model_layers
from torch_hybrid_moe.tiny_models import TINY_ARCHITECTURES, tiny_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU; none on this machine"),
]


@pytest.mark.parametrize("budget", [0.0, 0.25, 1.0])
@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_cuda_matches_reference(arch, budget):
    ref = tiny_model(arch).cuda()
    model = thm.patch_model(tiny_model(arch), expert_budget=budget, device="cuda")
    for layer in model_layers(model).values():
        assert layer.store.host_gate_up.is_pinned() and layer.store.slot_gate_up.is_cuda
    compiled = torch.compile(model, backend="hybrid_moe", fullgraph=True, dynamic=True)
    x = torch.randint(3, 96, (2, 11), device="cuda")
    with torch.no_grad():
        want = ref(x).logits.double()
        for got in (model(x).logits, compiled(x).logits):
            assert ((got.double() - want).abs().max() / want.abs().max()) < 1e-4
    tokens = ref.generate(x, max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(x, max_new_tokens=8, do_sample=False), tokens)


def test_cuda_default_stack_is_ours():
    """On CUDA with the decode graph, an unconfigured patch runs ours: queue-aware placement over ours' window,
    costed by this machine's profile."""
    model = thm.patch_model(tiny_model("mixtral"), expert_budget=0.25, device="cuda")
    layers = list(model_layers(model).values())
    assert layers and all(
        (layer.config.scheduler, layer.config.cache_policy, layer.config.cache_options, layer.config.hardware)
        == ("queue_aware", "dali_window", OURS_WINDOW, "local")
        for layer in layers
    )


def test_a_step_waits_for_its_own_experts_copies_only():
    """Uncaptured, the accelerator's share waits for the fills of the slots it reads, not for a copy still crossing
    for another expert (the simulator's uncaptured step prices it so); what it reads is the copied expert."""
    from torch_hybrid_moe.runtime import ExpertStore

    gate_up, down = torch.randn(6, 8, 4), torch.randn(6, 4, 4)
    store = ExpertStore(gate_up, down, 2, torch.device("cuda"), torch.float32)
    torch.cuda.synchronize()
    store.load(5, 0)
    with torch.cuda.stream(store._copy_stream):
        torch.cuda._sleep(2_000_000_000)  # ~1 s of copy-stream work queued behind expert 5's fill
    late = torch.cuda.Event()
    late.record(store._copy_stream)
    store.wait_for([1])  # slot 1 holds expert 1, filled when the store was made
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    assert not late.query()  # the step went ahead of the copy stream's queue
    store.wait_for([5])
    assert torch.equal(store.slot_gate_up[0].cpu(), gate_up[5])  # expert 5's own fill, waited for


def test_uncaptured_ours_sees_the_copies_its_store_queued():
    """Uncaptured, ours plans with the link's state: every layer's store reports its copies to one clock per device,
    each landed copy reads as ready, and the outputs stay exact."""
    from torch_hybrid_moe.runtime.link_clock import link_for

    ref = tiny_model("mixtral").cuda()
    config = thm.HybridMoEConfig(scheduler="queue_aware", hardware="rtx4090", cuda_graph=False)
    model = thm.patch_model(tiny_model("mixtral"), config, expert_budget=0.25, device="cuda")
    layers = list(model_layers(model).values())
    clock = link_for(torch.device("cuda"))
    assert all(
        layer.store.timeline is layer.scheduler.timeline and layer.store.timeline.clock is clock for layer in layers
    )
    x = torch.randint(3, 96, (1, 11), device="cuda")
    before = clock.free_at
    assert torch.equal(
        model.generate(x, max_new_tokens=8, do_sample=False), ref.generate(x, max_new_tokens=8, do_sample=False)
    )
    assert clock.free_at > before  # the admissions' copies were booked
    torch.cuda.synchronize()
    assert all(layer.store.timeline.ready_in(e) == 0.0 for layer in layers for e in range(layer.info.num_experts))
    assert clock.idle()


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v2"])
def test_cuda_prefill_streams_through_ring(arch):
    """The staging ring on a real copy stream: prefill streams experts while the CPU computes the rest at the same
    time, and the logits stay the unpatched model's. The LRU stack sends every expert not in a slot to the ring's
    plan (a cost-aware scheduler may fetch some into slots instead)."""
    ref = tiny_model(arch).cuda()
    model = thm.patch_model(
        tiny_model(arch),
        expert_budget=0.25,
        device="cuda",
        scheduler="cached_on_accelerator",
        cache_policy="lru",
        hardware="dali",
        expert_shape="deepseek-v2-lite",
    )
    x = torch.randint(3, 96, (3, 64), device="cuda")
    with torch.no_grad():
        want = ref(x).logits.double()
        got = model(x).logits.double()
    assert ((got - want).abs().max() / want.abs().max()) < 1e-4
    assert all(s.streamed_experts > 0 and s.cpu_experts > 0 for s in thm.stats(model).values())


def test_cuda_ring_reuses_a_buffer_only_after_its_compute():
    """One buffer, many experts, two steps, a lagging compute stream: a copy that overwrote the buffer before the
    compute reading it had run would change the sum."""
    from torch_hybrid_moe.ops.expert_math import accumulate_experts_
    from torch_hybrid_moe.runtime.expert_store import ExpertStore
    from torch_hybrid_moe.runtime.staging_ring import StagingRing

    g = torch.Generator().manual_seed(0)
    experts, hidden_size, inter, tokens = 16, 256, 128, 64
    gate_up = torch.randn(experts, 2 * inter, hidden_size, generator=g) / hidden_size**0.5
    down = torch.randn(experts, hidden_size, inter, generator=g) / inter**0.5
    store = ExpertStore(gate_up, down, 0, torch.device("cuda"), torch.float32)
    ring = StagingRing(store.device, (2 * inter, hidden_size), (hidden_size, inter), torch.float32, 1)
    hidden = torch.randn(tokens, hidden_size, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g)
    out = torch.zeros(tokens, hidden_size, device="cuda")
    for _ in range(2):  # the second step reuses the buffer after the first step's last compute
        torch.cuda._sleep(10**7)  # the compute stream lags behind the copies
        ring.run(store, out, hidden.cuda(), ids, weights, list(range(experts)))
    want = accumulate_experts_(
        torch.zeros(tokens, hidden_size, dtype=torch.float64),
        hidden.double(),
        ids,
        weights.double(),
        gate_up.double(),
        down.double(),
    )
    torch.testing.assert_close(out.double().cpu(), 2 * want, rtol=1e-4, atol=1e-4)


def test_grouped_slot_experts_replay_under_new_routing():
    """The decode graph's slot share on bf16 slots (grouped GEMMs reading each used slot in place), captured once
    and replayed under fresh routing each time, against a float64 loop; pairs off the slots (-1) left out."""
    from torch_hybrid_moe.ops.expert_math import accumulate_experts_, grouped_slots, slot_experts_
    from torch_hybrid_moe.profiling import captured

    slots, h, i, tokens, k = 8, 64, 48, 3, 4
    gate_up = (torch.randn(slots, 2 * i, h) / h**0.5).to("cuda", torch.bfloat16)
    down = (torch.randn(slots, h, i) / i**0.5).to("cuda", torch.bfloat16)
    if not grouped_slots(gate_up):
        pytest.skip("torch's grouped GEMM has no device kernel on this GPU: the gathered form runs instead")
    hidden = torch.empty(tokens, h, device="cuda", dtype=torch.bfloat16)
    ids = torch.empty(tokens, k, device="cuda", dtype=torch.long)
    weights, out = torch.empty(tokens, k, device="cuda"), torch.empty(tokens, h, device="cuda")

    def draw() -> None:
        hidden.copy_(torch.randn(tokens, h))
        routed = torch.stack([torch.randperm(slots)[:k] for _ in range(tokens)])
        routed[torch.rand(routed.shape) < 0.3] = -1
        ids.copy_(routed)
        weights.copy_(torch.rand(tokens, k))
        out.fill_(float("nan"))

    def run() -> None:
        out.zero_()
        slot_experts_(out, hidden, ids, weights, gate_up, down)

    draw()
    graph = captured(run)
    for _ in range(3):
        draw()
        graph.replay()
        torch.cuda.synchronize()
        want = accumulate_experts_(
            torch.zeros(tokens, h, dtype=torch.float64),
            hidden.double().cpu(),
            ids.cpu(),
            weights.double().cpu(),
            gate_up.double().cpu(),
            down.double().cpu(),
        )
        assert torch.isfinite(out).all()
        assert (out.double().cpu() - want).norm() <= 1e-2 * want.norm() + 1e-12  # all pairs may be off the slots


def test_every_graph_scheduler_placement_is_timed_inside_a_graph():
    """The profile's placement times (`hybrid-moe simulate --graph` charges them): one positive device time per
    graph-capable scheduler (printed: ours' is one Triton program, the cached rule's one comparison)."""
    from torch_hybrid_moe import profiling
    from torch_hybrid_moe.cost_model import EXPERT_SHAPES, HARDWARE, CostModel
    from torch_hybrid_moe.policies import SCHEDULERS

    expert = EXPERT_SHAPES["deepseek-v2-lite"]
    seconds = profiling.measure_placement(CostModel(HARDWARE["rtx4090"], expert), expert, 3)
    print({name: f"{s * 1e6:.1f} us" for name, s in seconds.items()})
    assert set(seconds) == set(SCHEDULERS.graph_names()) and all(0 < s < 0.01 for s in seconds.values())


def test_grouped_slot_share_is_timed_inside_a_graph():
    """The decode graph's slot share, timed over 1 and SHARE_EXPERTS experts (printed): positive, and more experts
    take longer, which the per-expert profile cannot say (its fit may read an expert in no time)."""
    from torch_hybrid_moe import profiling
    from torch_hybrid_moe.cost_model import EXPERT_SHAPES

    share = profiling.measure_share(EXPERT_SHAPES["deepseek-v2-lite"], 3, 2 * 2**30)
    print({k: f"{s * 1e6:.1f} us" for k, s in share.items()})
    assert sorted(share) == [1, profiling.SHARE_EXPERTS] and 0 < share[1] < share[profiling.SHARE_EXPERTS] < 0.01


def test_gpu_expert_times_and_their_fixed_cost_fit_a_plausible_bandwidth():
    """The profile times a GPU expert's fixed cost on tiny experts inside a graph (printed): below a real expert's
    1-token time, and the fit then reads a DeepSeek-V2-Lite expert at a bandwidth a GPU has (a free fit of the H200's
    times gave 1,016,257 GB/s)."""
    from torch_hybrid_moe import profiling
    from torch_hybrid_moe.cost_model import EXPERT_SHAPES

    expert = EXPERT_SHAPES["deepseek-v2-lite"]
    m = profiling.measure(expert, (1, 4, 16, 64), repeats=3, pool_bytes=2 * 2**30, progress=False)
    print(f"GPU overhead {m.gpu_overhead_s * 1e6:.1f} us, 1 token {m.gpu_s[1] * 1e6:.1f} us")
    assert 0 < m.gpu_overhead_s < m.gpu_s[1] and 0 < m.cpu_overhead_s < m.cpu_s[1]
    assert 100 < profiling.HardwareProfile(expert, m).hardware.gpu_bandwidth_gb_s < 20_000


def test_compiled_placement_and_slot_programs_choose_as_the_cpu_forms():
    """Ours' placement program, the slot pairing and the tables' update, compiled and run on the GPU, against their
    torch forms on the CPU (the interpreter cannot show the compiled code's rounding or memory order), on random
    steps full of ties."""
    import random

    from torch_hybrid_moe.cost_model import EXPERT_SHAPES, HARDWARE, CostModel
    from torch_hybrid_moe.ops.slot_swaps import claim_slots
    from torch_hybrid_moe.policies.device_caching import fetch_admissions
    from torch_hybrid_moe.policies.device_scheduling import QueueAwareForm

    rng = random.Random(0)
    for _ in range(100):  # few shapes: each new one compiles the programs again
        hardware, shape = rng.choice(sorted(HARDWARE)), rng.choice(sorted(EXPERT_SHAPES))
        form = QueueAwareForm(CostModel(HARDWARE[hardware], EXPERT_SHAPES[shape]))
        experts, slots = rng.choice([64, 160]), rng.choice([4, 16])
        ids = torch.stack([torch.randperm(experts)[:6] for _ in range(rng.choice([1, 8]))])
        counts = torch.bincount(ids.flatten(), minlength=experts).float()
        expert_slot = torch.full((experts,), -1)
        slot_expert = torch.randperm(experts)[:slots]
        expert_slot[slot_expert] = torch.arange(slots)
        values = torch.tensor([float(rng.choice([0, 1, 2])) for _ in range(experts)])
        k = min(slots, ids.numel())
        cpu_on = form.place(counts, expert_slot >= 0, slots, min(experts, ids.numel()))
        gpu_on = form.place(counts.cuda(), (expert_slot >= 0).cuda(), slots, min(experts, ids.numel()))
        assert torch.equal(gpu_on.cpu(), cpu_on)
        want = fetch_admissions(cpu_on & (expert_slot < 0), cpu_on, values, expert_slot, slot_expert, k)
        cuda = [t.cuda() for t in (cpu_on, expert_slot, values, slot_expert)]
        got = fetch_admissions(cuda[0] & (cuda[1] < 0), cuda[0], cuda[2], cuda[1], cuda[3], k)
        assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want))
        claim_slots(*want, expert_slot, slot_expert)  # the tables' update, torch form
        claim_slots(*got, cuda[1], cuda[3])  # and program
        assert torch.equal(cuda[1].cpu(), expert_slot) and torch.equal(cuda[3].cpu(), slot_expert)
