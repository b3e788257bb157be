"""The replay-safe layer step and its parts, on any machine: the CPU task bridge, the static-shape slot
experts, masked row copies, and the cache policies' tensor forms against their Python forms."""

import copy
import itertools
import random
from types import SimpleNamespace

import pytest
import torch

import torch_hybrid_moe as thm
from torch_hybrid_moe.cost_model import EXPERT_SHAPES, HARDWARE, CostModel, ExpertShape
from torch_hybrid_moe.embedded import load_model
from torch_hybrid_moe.ops import cpu_kernel
from torch_hybrid_moe.ops.expert_math import accumulate_experts_, slot_experts_
from torch_hybrid_moe.ops.placement_walks import queue_search
from torch_hybrid_moe.ops.quantize import kernel_operands
from torch_hybrid_moe.ops.row_copy import copy_rows_
from torch_hybrid_moe.policies import CACHE_POLICIES, SCHEDULERS, IdleLink, LayerInfo, Registry
from torch_hybrid_moe.policies.device_caching import admissions
from torch_hybrid_moe.policies.prefetching import Router
from torch_hybrid_moe.policies.schedulers import StepTimer, local_search
from torch_hybrid_moe.runtime import ExpertStore, HybridMoELayer, model_layers
from torch_hybrid_moe.runtime.graph_path import Part
from torch_hybrid_moe.runtime.layer_policies import build_policies
from torch_hybrid_moe.tiny_models import TINY_ARCHITECTURES, tiny_model

needs_kernel = pytest.mark.usefixtures("kernel")


def _routing(tokens: int, k: int, experts: int, drop: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
    ids[torch.rand(ids.shape) < drop] = -1
    return ids, torch.rand(tokens, k)


def _experts(e: int = 6, h: int = 32, i: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(e, 2 * i, h) / h**0.5, torch.randn(e, h, i) / i**0.5


def assert_kernel_output(out, hidden, ids, weights, gate_up, down) -> None:
    """`out` is the routed experts' sum over `hidden`, as the float64 per-pair loop computes it."""
    want = accumulate_experts_(
        torch.zeros(out.shape, dtype=torch.float64),
        hidden.double(),
        ids,
        weights.double(),
        gate_up.double(),
        down.double(),
    )
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)


@needs_kernel
def test_cpu_task_runs_the_kernel_on_its_buffers_each_submission():
    gate_up, down = _experts()
    hidden, ids, weights, out = torch.randn(5, 32), *_routing(5, 2, 6, drop=0.3), torch.full((5, 32), float("nan"))
    task = cpu_kernel.extension().CpuTask(hidden, ids, weights, gate_up, None, down, None, out, 2)
    for round_ in range(3):
        hidden.copy_(torch.randn(5, 32))  # the task reads the buffers as they are when it runs
        task.submit()
        task.wait()
        assert_kernel_output(out, hidden, ids, weights, gate_up, down)
        assert task.submits == task.syncs == task.runs == round_ + 1


@needs_kernel
@pytest.mark.parametrize("kernel", cpu_kernel.GEMM_KERNELS)
def test_cpu_task_runs_each_gemm_kernel_on_its_worker(kernel):
    """The measured prefill route reaches the worker thread: every expert over the route's token count takes the
    GEMM kernel named (AMX tiles configured on the worker's own threads); a code the kernel does not know is refused
    when the task is built, on the caller's thread."""
    if kernel == "amx" and not cpu_kernel.amx_fits(64, 32):
        pytest.skip("no AMX on this CPU")
    gate_up, down = (w.bfloat16() for w in _experts(h=64, i=32))
    hidden, (ids, weights), out = torch.randn(40, 64).bfloat16(), _routing(40, 2, 6), torch.zeros(40, 64)
    route = cpu_kernel.GemmRoute(1, kernel)
    task = cpu_kernel.extension().CpuTask(
        hidden, ids, weights, gate_up, None, down, None, out, 2, route.tokens, route.code
    )
    task.submit()
    task.wait()
    assert cpu_kernel.extension().take_task_error() == ""
    args = (hidden.double(), ids, weights.double(), gate_up.double(), down.double())
    want = accumulate_experts_(torch.zeros(40, 64, dtype=torch.float64), *args)
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    with pytest.raises(RuntimeError, match="unknown GEMM kernel"):
        cpu_kernel.extension().CpuTask(hidden, ids, weights, gate_up, None, down, None, out, 2, 1, 7)


@needs_kernel
def test_task_rounds_no_deadlock_with_a_busy_python_thread():
    """The CPU stand-in of test_cuda_graph's thousand replays: layers' tasks submitted and waited for in turn, as a
    graph's host functions do, from a thread that is not Python's main one while another Python thread holds the GIL
    as much as it can. Every round runs every task once, none blocks, and the last round's outputs are the kernel's.
    (Here each submit is a Python call that waits for the GIL: 300 rounds, the GIL handed over every 0.1 ms.)"""
    import sys
    import threading

    gate_up, down = _experts()
    layers = []
    for _ in range(3):
        hidden, (ids, weights) = torch.randn(4, 32), _routing(4, 2, 6, drop=0.2)
        out = torch.zeros(4, 32)
        layers.append(
            (
                hidden,
                ids,
                weights,
                out,
                cpu_kernel.extension().CpuTask(hidden, ids, weights, gate_up, None, down, None, out, 1),
            )
        )
    stop, done = threading.Event(), threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    def rounds() -> None:
        for _ in range(300):
            for *_, task in layers:
                task.submit()
                task.wait()
        done.set()

    busy, worker = threading.Thread(target=spin, daemon=True), threading.Thread(target=rounds, daemon=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        busy.start()
        worker.start()
        worker.join(timeout=120)
    finally:
        stop.set()
        busy.join()
        sys.setswitchinterval(interval)
    assert done.is_set(), "300 rounds did not finish in 120 s: deadlock"
    assert cpu_kernel.extension().take_task_error() == ""
    for hidden, ids, weights, out, task in layers:
        assert task.submits == task.syncs == task.runs == 300
        assert_kernel_output(out, hidden, ids, weights, gate_up, down)


@needs_kernel
def test_cpu_task_error_reaches_python_and_wait_without_submit_returns():
    gate_up, down = _experts()
    ids = torch.full((2, 2), 9)  # expert 9 of 6: the kernel refuses it on the worker thread
    task = cpu_kernel.extension().CpuTask(
        torch.randn(2, 32), ids, torch.rand(2, 2), gate_up, None, down, None, torch.zeros(2, 32), 1
    )
    task.wait()  # nothing submitted: must not block
    task.submit()
    task.wait()
    assert "9" in cpu_kernel.extension().take_task_error()
    assert cpu_kernel.extension().take_task_error() == ""


@needs_kernel
def test_cpu_task_thread_count_stays_on_its_worker():
    """A task's own thread count (HybridMoEConfig.cpu_threads) must not leak into the process's torch threads:
    the main thread keeps running prefill and the model's own ops with them."""
    gate_up, down = _experts()
    before = torch.get_num_threads()
    task = cpu_kernel.extension().CpuTask(
        torch.randn(2, 32), *_routing(2, 2, 6), gate_up, None, down, None, torch.zeros(2, 32), before + 1
    )
    task.submit()
    task.wait()
    assert task.runs == 1 and torch.get_num_threads() == before


@needs_kernel
def test_cpu_task_rejects_bad_buffers():
    gate_up, down = _experts()
    with pytest.raises(RuntimeError, match="int64 ids"):
        cpu_kernel.extension().CpuTask(
            torch.randn(2, 32),
            torch.zeros(2, 2, dtype=torch.int32),
            torch.rand(2, 2),
            gate_up,
            None,
            down,
            None,
            torch.zeros(2, 32),
            1,
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where no CUDA driver exists")
@needs_kernel
def test_host_function_launch_without_a_driver_is_a_clear_error():
    gate_up, down = _experts()
    task = cpu_kernel.extension().CpuTask(
        torch.randn(1, 32),
        torch.zeros(1, 2, dtype=torch.int64),
        torch.rand(1, 2),
        gate_up,
        None,
        down,
        None,
        torch.zeros(1, 32),
        1,
    )
    with pytest.raises(RuntimeError, match="libcuda|cuLaunchHostFunc"):
        task.launch_submit(0)


@pytest.mark.parametrize(
    "capability, dtype, hidden, inter, grouped",
    [
        ((9, 0), torch.bfloat16, 64, 48, True),  # H100 / H200
        ((10, 0), torch.bfloat16, 64, 48, True),  # B200
        ((8, 0), torch.bfloat16, 64, 48, False),  # A100: torch's grouped GEMM syncs with the host there
        ((8, 9), torch.bfloat16, 64, 48, False),  # RTX 4090
        ((12, 0), torch.bfloat16, 64, 48, False),  # RTX 5090
        ((9, 0), torch.float32, 64, 48, False),  # CUDA: bf16 only
        ((9, 0), torch.bfloat16, 64, 44, False),  # rows of I not 16 bytes apart
        ((9, 0), torch.bfloat16, 60, 48, False),  # rows of H not 16 bytes apart
    ],
)
def test_grouped_slot_form_only_where_a_graph_can_capture_it(capability, dtype, hidden, inter, grouped, monkeypatch):
    """The grouped form on CUDA only where torch has its device kernel (compute capability 9.x / 10.x, bf16) and the
    rows are 16 bytes apart; every other case takes the gathered form (on other GPUs the grouped GEMM copies its
    offsets to the host, which fails inside a CUDA graph capture)."""
    from torch_hybrid_moe.ops import expert_math

    slots = SimpleNamespace(  # what the gate reads of CUDA slots [S, 2I, H], on a machine without a GPU
        shape=(4, 2 * inter, hidden),
        dtype=dtype,
        device=torch.device("cuda", 0),
        dim=lambda: 3,
        element_size=lambda: dtype.itemsize,
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert expert_math.grouped_slots(slots) is grouped


def test_grouped_slot_form_on_the_cpu_needs_rows_16_bytes_apart():
    from torch_hybrid_moe.ops import expert_math

    assert expert_math.grouped_slots(torch.zeros(4, 2 * 8, 12))  # fp32: 8 and 12 columns are 32 and 48 bytes
    assert not expert_math.grouped_slots(torch.zeros(4, 2 * 6, 12))  # I = 6: 24 bytes
    assert not expert_math.grouped_slots(torch.zeros(4, 2 * 8, 12, dtype=torch.bfloat16))  # H = 12: 24 bytes
    assert not expert_math.grouped_slots(torch.zeros(4, 8, 12, dtype=torch.float64))  # a dtype it lacks
    assert not expert_math.grouped_slots(torch.zeros(1024, 2 * 8, 12))  # more slots than the CUDA kernel takes
    assert expert_math.grouped_slots(torch.zeros(1023, 2 * 8, 12))


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "gathered"])
@pytest.mark.parametrize("counted", [False, True], ids=["static", "counted"])
@pytest.mark.parametrize("tokens,k,slots", [(1, 2, 4), (3, 2, 4), (2, 2, 2), (4, 3, 8), (9, 2, 3)])
def test_slot_experts_matches_the_loop_in_float64(tokens, k, slots, grouped, counted, dtype, tolerance, monkeypatch):
    """Both forms (grouped GEMMs over the slots in place; the used slots' weights gathered) against a float64 loop,
    with pairs off the slots (-1) left out: relative error of the whole output, bf16 within its rounding. `counted`:
    told how many pairs are on slots, as an uncaptured step is (the grouped form then computes only those)."""
    from torch_hybrid_moe.ops import expert_math

    assert expert_math.grouped_slots(_experts(e=slots)[0].to(dtype))  # the CPU has both forms
    monkeypatch.setattr(expert_math, "grouped_slots", lambda w: grouped)
    gate_up, down = (w.to(dtype) for w in _experts(e=slots))
    hidden = torch.randn(tokens, 32).to(dtype)
    ids, weights = _routing(tokens, k, slots, drop=0.4)
    want = accumulate_experts_(
        torch.zeros(tokens, 32, dtype=torch.float64),
        hidden.double(),
        ids,
        weights.double(),
        gate_up.double(),
        down.double(),
    )
    out = torch.full((tokens, 32), 0.5)  # accumulated into, not overwritten
    on_slots = int((ids >= 0).sum()) if counted else None
    rounding = torch.finfo(out.dtype).eps * out.norm().item()  # of the sum into the 0.5s, however small the result
    got = slot_experts_(out, hidden, ids, weights, gate_up, down, on_slots=on_slots) - 0.5
    assert torch.isfinite(got).all()
    assert (got.double() - want).norm() <= tolerance * want.norm() + rounding  # every pair may be dropped: want 0


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "gathered"])
@pytest.mark.parametrize("tokens", [1, 4])
def test_slots_no_pair_uses_may_hold_anything(tokens, grouped, monkeypatch):
    """A slot never filled holds whatever its memory held (the store allocates them empty), and an fp16 expert
    given a token it was not routed may overflow: neither may reach the output. The gathered form runs unused slots
    on every token with weight 0, and 0 x NaN is NaN, so their rows must be left out, not multiplied by 0."""
    from torch_hybrid_moe.ops import expert_math

    monkeypatch.setattr(expert_math, "grouped_slots", lambda w: grouped)
    gate_up, down = _experts(e=6)
    hidden = torch.randn(tokens, 32)
    ids, weights = _routing(tokens, 2, 3)
    ids[0, 1] = -1  # one token: one used slot, padded with an unused one
    want = accumulate_experts_(torch.zeros(tokens, 32), hidden, ids, weights, gate_up, down)
    unused = sorted(set(range(6)) - set(ids.flatten().tolist()))
    gate_up[unused[0]], down[unused[1]], down[unused[2:]] = float("nan"), float("inf"), -float("inf")
    got = slot_experts_(torch.zeros(tokens, 32), hidden, ids, weights, gate_up, down)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_uncaptured_slot_share_from_quantised_masters_takes_the_grouped_form(fmt):
    """Slots holding dequantised int8 / int4 experts round their inputs, so the uncaptured step computes its slot share
    in the grouped form (the CPU stands in for the accelerator), told how many of the step's pairs are on slots;
    pairs marked -1 (another dispatch's) are left out. The whole step against the per-expert loop on the same
    masters."""
    from torch_hybrid_moe.ops import expert_math

    model = thm.patch_model(
        load_model("deepseek-tiny", dtype=torch.float32)[0],
        expert_budget=0.5,
        device="cpu",
        cpu_weight_dtype=fmt,
        cpu_weight_group_size=32,
    )
    layer = next(iter(model_layers(model).values()))
    store = layer.store
    assert store.rounds_inputs and expert_math.grouped_slots(store.slot_gate_up)
    torch.manual_seed(0)
    hidden = torch.randn(9, store.host_gate_up.shape[2])
    ids, weights = _routing(9, 3, store.num_experts, drop=0.3)
    got = layer.forward(hidden, ids, weights)
    stats = layer.stats
    assert stats.accelerator_experts > 0 and stats.cpu_experts > 0  # both shares ran
    want = accumulate_experts_(
        torch.zeros(9, hidden.shape[1], dtype=torch.float64), hidden, ids, weights, store.host_gate_up, store.host_down
    )
    assert (got.double() - want).norm() <= 1e-5 * want.norm()


def test_copy_rows_copies_only_rows_with_a_source():
    src, dst = torch.randn(5, 3, 4), torch.randn(4, 3, 4)
    before = dst.clone()
    copy_rows_(dst, torch.tensor([2, 0, 3]), src, torch.tensor([4, -1, 1]))
    want = before.clone()
    want[2], want[3] = src[4], src[1]
    assert torch.equal(dst, want)
    copy_rows_(dst, torch.tensor([1]), src.double(), torch.tensor([0]))  # another dtype: converted
    assert torch.equal(dst[1], src[0])
    with pytest.raises(ValueError, match="differ"):
        copy_rows_(dst, torch.tensor([0]), src[:, :2], torch.tensor([0]))


@pytest.mark.parametrize(
    "name, options", [(name, {}) for name in CACHE_POLICIES.graph_names()] + [("dali_window", {"decay": 0.5})]
)
def test_tensor_form_ranks_like_the_python_policy(name, options):
    rng = random.Random(0)
    info = LayerInfo(0, 8, 3, 1)
    costs = CostModel(HARDWARE["dali"], EXPERT_SHAPES["deepseek-v2-lite"])  # what a cost-aware one weighs by
    policy = CACHE_POLICIES.create(name, info=info, costs=costs, **options)
    ranking = CACHE_POLICIES.tensor_form(name)(policy, 8, torch.device("cpu"))
    for _ in range(20):
        counts = [rng.choice([0, 0, 1, 3]) for _ in range(8)]
        scores = [c * rng.random() for c in counts]
        may = ranking.update(torch.tensor(counts, dtype=torch.float32), torch.tensor(scores, dtype=torch.float32))
        if name == "lru":  # LRU records its clock while admitting
            policy.admit(counts, [False] * 8, scores)
            python_values, changes = policy.last_used, True
        else:
            changes = policy.observe(counts, scores)
            python_values = [policy.value(e) for e in range(8)]
        want = torch.tensor(python_values, dtype=torch.float64)
        torch.testing.assert_close(ranking.values.double(), want, rtol=1e-6 * (name != "cost_aware"), atol=0)
        if name == "dali_window":
            assert bool(may) == changes


@pytest.mark.parametrize("name", SCHEDULERS.graph_names())
def test_tensor_form_schedulers_place_like_the_python_ones(name):
    """Random steps from one token to a prefill's worth per expert, on two machines: the same experts on the
    accelerator (fetches included) as the Python scheduler; decisions hinge on exact float64 cost sums."""
    rng = random.Random(2)
    tried = set()
    for preset in ("dali", "rtx5090"):
        costs = CostModel(HARDWARE[preset], EXPERT_SHAPES["deepseek-v2-lite"])
        for _ in range(150):
            experts, slots = rng.randint(2, 12), rng.randint(0, 6)
            info = LayerInfo(0, experts, slots, 1)
            python = SCHEDULERS.create(name, info=info, costs=costs, timeline=IdleLink())
            counts = [rng.choice([0, 0, 1, 1, 2, 5, 20, 60, 200]) for _ in range(experts)]
            resident = [False] * experts
            for e in rng.sample(range(experts), min(slots, experts)):
                resident[e] = rng.random() < 0.8
            want = python.place(counts, resident)
            got = SCHEDULERS.tensor_form(name)(python).place(
                torch.tensor(counts, dtype=torch.float32), torch.tensor(resident), slots, sum(counts)
            )
            assert {e for e, on in enumerate(got.tolist()) if on} == set(want.accelerator), (counts, resident, slots)
            tried.add((bool(want.fetch), bool(want.cpu), any(resident[e] for e in want.cpu)))
    if name in ("on_demand", "fiddler", "dali_greedy", "hybrimoe", "queue_aware"):
        assert (True, True, False) in tried  # some steps both fetched and left experts on the CPU
    if name in ("dali_greedy", "hybrimoe", "queue_aware"):
        assert any(t[2] for t in tried)  # and some sent a cached expert to the CPU


def _queue_search_case(rng: random.Random, costs: CostModel) -> tuple:
    """A random step and three random start sets: the Python search's best start and end, and the tensor form's
    arguments."""
    experts, slots = rng.randint(1, 10), rng.randint(0, 6)
    counts = [rng.choice([0, 1, 2, 5, 20, 60]) for _ in range(experts)]
    resident = [rng.random() < 0.5 for _ in range(experts)]
    while sum(resident) > slots:
        resident[resident.index(True)] = False
    active = [e for e, n in enumerate(counts) if n]
    room = slots - sum(resident[e] for e in active)
    starts = [{e for e in active if rng.random() < 0.5} for _ in range(3)]
    starts = [s if sum(not resident[e] for e in s) <= room else {e for e in s if resident[e]} for s in starts]
    timer = StepTimer(counts, resident, costs, IdleLink())
    start = min(starts, key=timer)
    want = local_search(timer, start, room)[1]
    t = torch.tensor
    n = t(counts, dtype=torch.float32)
    args = (
        n > 0,
        t(resident),
        t([costs.t_cpu(c) for c in counts], dtype=torch.float64),
        t([costs.t_gpu(c) for c in counts], dtype=torch.float64),
        t([[e in s for e in range(experts)] for s in starts]),
        t(room),
        costs.t_transfer(),
    )
    return start, want, args


def test_queue_search_flips_as_the_python_local_search():
    """From random (often poor) start sets, so that the flips run: the tensor form's search ends on the Python
    search's GPU set; ties and the 1e-9 margin hinge on float64 sums in the same order."""
    rng = random.Random(5)
    flipped = 0
    for preset in ("dali", "rtx5090"):
        costs = CostModel(HARDWARE[preset], EXPERT_SHAPES["deepseek-v2-lite"])
        for _ in range(200):
            start, want, args = _queue_search_case(rng, costs)
            got = queue_search(*args)
            assert {e for e, on in enumerate(got.tolist()) if on} == want
            flipped += want != start
    assert flipped > 100


def test_tensor_form_of_an_offline_policy_is_refused():
    for name in ("belady", "oracle_window"):  # oracle_window: a window cache's subclass, with no form of its own
        with pytest.raises(ValueError, match=f"cache policy '{name}' has no tensor form"):
            CACHE_POLICIES.tensor_form(name)


def _best_swaps(values, active, expert_slot, slot_expert, fills):
    """Brute force: the admission set maximising the total value held after at most `fills` swaps, where each
    newcomer must be worth more than the occupant it replaces (free slots are worth -inf)."""
    missing = [e for e in range(len(values)) if active[e] and expert_slot[e] < 0]
    held = [values[e] if e >= 0 else float("-inf") for e in slot_expert]
    best = (0.0, 0)
    for n in range(1, fills + 1):
        for newcomers in itertools.combinations(missing, n):
            for slots in itertools.permutations(range(len(slot_expert)), n):
                if all(values[e] > held[s] for e, s in zip(newcomers, slots)):
                    gain = sum(values[e] - max(held[s], 0.0) for e, s in zip(newcomers, slots))
                    best = max(best, (gain, n))
    return best


def test_admissions_equal_brute_force_best_swaps():
    rng = random.Random(1)
    for _ in range(150):
        experts, slots, fills = 7, rng.randint(1, 4), rng.randint(1, 3)
        fills = min(fills, slots)
        occupants = rng.sample(range(experts), rng.randint(0, slots))
        slot_expert = occupants + [-1] * (slots - len(occupants))
        rng.shuffle(slot_expert)
        expert_slot = [-1] * experts
        for s, e in enumerate(slot_expert):
            if e >= 0:
                expert_slot[e] = s
        values = [float(rng.randint(0, 9)) + rng.random() for _ in range(experts)]
        active = [rng.random() < 0.5 for _ in range(experts)]
        expert, slot = admissions(
            torch.tensor(values),
            torch.tensor(True),
            torch.tensor(active),
            torch.tensor(expert_slot),
            torch.tensor(slot_expert),
            fills,
        )
        chosen = [(int(e), int(s)) for e, s in zip(expert, slot) if e >= 0]
        held = [values[e] if e >= 0 else float("-inf") for e in slot_expert]
        assert all(active[e] and expert_slot[e] < 0 and values[e] > held[s] for e, s in chosen)
        assert len({s for _, s in chosen}) == len(chosen)
        gain = sum(values[e] - max(held[s], 0.0) for e, s in chosen)
        best_gain, best_n = _best_swaps(values, active, expert_slot, slot_expert, fills)
        assert gain == pytest.approx(best_gain) and len(chosen) == best_n


@needs_kernel
@pytest.mark.parametrize("budget", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_replay_safe_path_matches_reference_model(reference_models, arch, budget):
    """The graph path run step by step (host functions called directly) against unpatched transformers."""
    ref = reference_models[arch]
    model = thm.patch_model(copy.deepcopy(ref), expert_budget=budget, device="cpu", fills_per_step=2)
    layers = model_layers(model).values()
    for layer in layers:
        layer.graph_mode = True
    with torch.no_grad():
        for _ in range(3):  # slots change between steps
            x = torch.randint(3, 96, (2, 6))
            want, got = ref(x).logits.double(), model(x).logits.double()
            assert ((got - want).abs().max() / want.abs().max()) < 1e-5
    stats = thm.stats(model)
    for layer in layers:
        assert sorted(e for e in layer.store.slot_experts if e >= 0) == sorted(
            e for e, s in enumerate(layer.store.expert_slot) if s >= 0
        )
        assert [layer.store.slot_experts[s] for s in layer.store.expert_slot if s >= 0] == [
            e for e, s in enumerate(layer.store.expert_slot) if s >= 0
        ]
    assert all(s.steps == 3 and s.hits + s.misses > 0 for s in stats.values())
    if budget == 0.0:
        assert all(s.hits == 0 for s in stats.values())
    if budget == 1.0:
        assert all(s.misses == 0 for s in stats.values())


@needs_kernel
@pytest.mark.parametrize("graph", [False, True])
def test_a_split_steps_halves_count_and_admit_the_whole_step(graph):
    """A step split in two dispatches is one step of the layer, as the simulator counts it: its hits are judged on the
    slots it found (a DAOP AHEAD half's on-demand fetch of expert 5 made the plain half count 5 a hit), and Expert
    Deferral's deferred pairs (the BEHIND half) are counted and admitted with the step's (expert 5, deferred at every
    step, was never counted nor admitted, and the hit rate read 100%)."""
    torch.manual_seed(0)
    gate_up, down = torch.randn(8, 16, 16), torch.randn(8, 16, 8)
    h = torch.randn(1, 16)

    def layer_over(scheduler: str, cache: str) -> HybridMoELayer:
        store = ExpertStore(gate_up, down, 2, torch.device("cpu"), torch.float32)  # experts 0 and 1 in slots
        config = thm.HybridMoEConfig(expert_budget=0.25, scheduler=scheduler, cache_policy=cache)
        layer = HybridMoELayer(f"split-{scheduler}-{graph}", 0, store, config)
        layer.graph_mode = graph
        return layer

    def half(layer: HybridMoELayer, ids: list[int], part: Part) -> None:
        if graph and part in (Part.AHEAD, Part.LEADING):
            layer.graph_path().begin_step()
        weights = torch.tensor([[0.5 if i >= 0 else 0.0 for i in ids]])
        layer.end(layer.begin(h, torch.tensor([ids]), weights, part), h, part)

    daop = layer_over("on_demand", "lru")
    half(daop, [5, -1], Part.AHEAD)  # fetched on demand
    half(daop, [-1, 1], Part.PLAIN)
    assert (daop.stats.hits, daop.stats.misses, daop.stats.steps) == (1, 1, 1)
    deferral = layer_over("cached_on_accelerator", "lfu")
    for _ in range(3):
        half(deferral, [1, -1], Part.LEADING)
        half(deferral, [-1, 5], Part.BEHIND)
    # step 1: 1 a hit, 5 a miss, then admitted over expert 0 (LFU: 1 use against none); steps 2-3: both hits
    assert (deferral.stats.hits, deferral.stats.misses, deferral.stats.steps) == (5, 1, 3)
    assert sorted(e for e in deferral.store.slot_experts if e >= 0) == [1, 5]


@needs_kernel
def test_another_models_replay_never_pulls_a_layers_stale_tables(reference_models):
    """A replay marks its own model's layers' device tables newer, not every layer's: when model A took in its tables
    after its replays and then moved experts in uncaptured steps, model B's replay made A pull its stale device tables
    back over them, so A's slot map named slots holding other experts and its logits went wrong (1.69 relative)."""
    ref = reference_models["mixtral"]
    a, b = (
        thm.patch_model(
            copy.deepcopy(ref), expert_budget=0.5, device="cpu", cache_policy="lru", scheduler="cached_on_accelerator"
        )
        for _ in range(2)
    )

    def check(x: torch.Tensor) -> None:
        with torch.no_grad():
            want, got = ref(x).logits.double(), a(x).logits.double()
        assert ((got - want).abs().max() / want.abs().max()) < 1e-5
        for layer in model_layers(a).values():
            layer.settle()  # as thm.stats and the next step do first
            store = layer.store
            assert all(
                torch.equal(store.slot_gate_up[s], store.host_gate_up[e])
                for s, e in enumerate(store.slot_experts)
                if e >= 0
            )

    layers = list(model_layers(a).values())
    for layer in layers:  # A's decode step on the replay-safe path, as its graph runs it, then its replay noted
        layer.graph_path().prepare_replay()
        layer.graph_mode = True
    check(torch.randint(3, 96, (1, 1)))
    for layer in layers:
        layer.graph_mode = False
        layer.graph_path().replayed()
    check(torch.randint(3, 96, (2, 9)))  # uncaptured: takes the tables in, then admits experts
    for layer in model_layers(b).values():
        layer.graph_path().replayed()  # B's replay
    check(torch.randint(3, 96, (2, 9)))


@needs_kernel
@pytest.mark.parametrize("captured", [True, False])
@pytest.mark.parametrize("scheduler", ["all_cpu", "queue_aware"])
def test_full_budget_step_runs_every_expert_from_its_slot(reference_models, scheduler, captured):
    """At a full budget a step computes every expert from its slot, whatever the scheduler would place (all_cpu:
    everything on the CPU; queue_aware: an idle CPU may take cached experts). The graph step launches no CPU task
    and queues no admission; the uncaptured step (prefill) computes no CPU share (on an H200 ours' did, and its
    prefill ran 4.6x slower than the default's at budget 1.0)."""
    ref = reference_models["deepseek_v2"]
    model = thm.patch_model(copy.deepcopy(ref), expert_budget=1.0, device="cpu", scheduler=scheduler, hardware="dali")
    layers = model_layers(model).values()
    launched = []
    for layer in layers:
        if captured:
            layer.graph_mode = True
            path = layer.graph_path()
            path._launch = lambda task, what: launched.append(what)  # a spy: every launch is recorded
            path._admit = lambda counts, scores: launched.append("admit")
        else:
            layer._cpu_share = lambda *args: launched.append("cpu share")
    x = torch.randint(3, 96, (2, 6))
    with torch.no_grad():
        want, got = ref(x).logits.double(), model(x).logits.double()
    assert ((got - want).abs().max() / want.abs().max()) < 1e-5
    stats = thm.stats(model).values()
    assert launched == [] and all(s.cpu_experts == 0 and s.accelerator_experts > 0 for s in stats)


@needs_kernel
def test_cpu_share_takes_only_its_rows_and_sums_as_over_all_rows(reference_models):
    """The uncaptured step hands the CPU share only the tokens with a pair on the CPU (in a prefill the others
    would cross to the host and back, and through the kernel, for nothing). The logits are bit for bit those of
    the share over every row, and the reference's."""
    ref = reference_models["deepseek_v2"]
    torch.manual_seed(0)
    x = torch.randint(3, 96, (2, 16))
    rows: dict[bool, list[int]] = {True: [], False: []}

    def logits(compact: bool) -> torch.Tensor:
        model = thm.patch_model(copy.deepcopy(ref), expert_budget=0.5, device="cpu")
        for layer in model_layers(model).values():
            if not compact:
                layer._cpu_rows = lambda hidden, ids, weights, cpu, layer=layer: (
                    hidden.cpu(),
                    layer._relabel(ids, {e: e for e in cpu}),
                    weights,
                    None,
                )
            share = layer._cpu_share
            layer._cpu_share = lambda hidden, *args, share=share: (
                rows[compact].append(len(hidden)) or share(hidden, *args)
            )
        with torch.no_grad():
            return model(x).logits.double()

    got, over_all = logits(True), logits(False)
    assert torch.equal(got, over_all)
    assert rows[False] and set(rows[False]) == {x.numel()} and min(rows[True]) < x.numel()
    want = ref(x).logits.double()
    assert ((got - want).abs().max() / want.abs().max()) < 1e-5


@needs_kernel
@pytest.mark.parametrize("prefetch_size, size", [(0, 2), (1, 1), (3, 3)])  # 0: the gate's default, 2 of top-4
def test_replay_safe_prefetch_makes_the_python_prefetchers_choice(prefetch_size, size):
    """The gate prefetch as tensors: the experts GatePrefetch.select names (as many as prefetch_size asks)
    become resident, each displacing the least valuable unwanted slot by the cache ranking, and the slot
    weights are the masters'."""
    model = thm.patch_model(
        load_model("deepseek-tiny", dtype=torch.float32)[0],
        expert_budget=0.25,
        device="cpu",
        prefetcher="gate",
        prefetch_size=prefetch_size,
        cache_policy="lfu",
        fills_per_step=1,
    )
    layer = list(model_layers(model).values())[1]
    layer.graph_mode = True
    path = layer.graph_path()
    torch.manual_seed(0)
    hidden = torch.randn(8, layer.store.host_gate_up.shape[2])
    for _ in range(3):  # give the ranking and the slots a history
        ids = torch.stack([torch.randperm(32)[:4] for _ in range(8)])
        layer.forward(hidden, ids, torch.rand(8, 4))
    path.pull()
    before = {e for e, s in enumerate(layer.store.expert_slot) if s >= 0}
    values = path.ranking.values.tolist()
    wanted = set(layer.prefetcher.select(hidden, None, layer.store.resident()))
    assert len(wanted) == layer.prefetcher.size == size and not wanted <= before  # something to copy
    path.prefetch(hidden, None)
    path.pull()
    after = {e for e, s in enumerate(layer.store.expert_slot) if s >= 0}
    evicted, kept = before - after, (before & after) - wanted
    assert wanted <= after and after - before == wanted - before and len(after) == len(before)
    assert not evicted & wanted and max(values[e] for e in evicted) <= min(values[e] for e in kept)
    for e in after:
        s = layer.store.expert_slot[e]
        assert torch.equal(layer.store.slot_gate_up[s], layer.store.host_gate_up[e])
        assert torch.equal(layer.store.slot_down[s], layer.store.host_down[e])
    assert layer.stats.prefetched_experts == len(wanted - before) and layer.stats.prefetch_calls == 1
    path.prefetch(hidden, None)  # everything wanted is resident now: nothing moves
    path.pull()
    assert {e for e, s in enumerate(layer.store.expert_slot) if s >= 0} == after
    assert layer.stats.prefetched_experts == len(wanted - before) and layer.stats.prefetch_calls == 2


def _compiled_steps_match_reference(ref: torch.nn.Module, model: torch.nn.Module, shape: tuple[int, int]) -> None:
    """Three compiled forwards of `model` with every layer on its replay-safe path equal the unpatched `ref`."""
    for layer in model_layers(model).values():
        layer.graph_mode = True
    compiled = torch.compile(model, backend="hybrid_moe", fullgraph=True, dynamic=False)
    torch.manual_seed(0)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randint(3, 2000, shape)
            want, got = ref(x).logits.double(), compiled(x).logits.double()
            assert ((got - want).abs().max() / want.abs().max()) < 1e-5


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("name", ["deepseek-tiny", "mixtral-tiny"])
def test_replay_safe_path_with_gate_prefetch_matches_reference_model(name):
    """Prefetching moves experts, never results: compiled steps with every layer on its replay-safe path."""
    ref = load_model(name, dtype=torch.float32)[0]
    ref.config.output_router_logits = False  # mixtral-tiny records them for its training loss; not compilable
    model = thm.patch_model(copy.deepcopy(ref), expert_budget=0.25, device="cpu", prefetcher="gate")
    _compiled_steps_match_reference(ref, model, (1, 4))
    stats = thm.stats(model)
    assert [stats[i].prefetch_calls for i in stats] == [0] + [3] * (len(stats) - 1)
    assert sum(s.prefetched_experts for s in stats.values()) > 0


def _skewed_routing(tokens: int, k: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing with a few heavy experts, as real routers have: step counts from 1 to every token."""
    popularity = (1 / torch.arange(1, experts + 1).float() ** 1.5)[torch.randperm(experts)]
    ids = torch.stack([torch.multinomial(popularity, k) for _ in range(tokens)])
    return ids, torch.rand(tokens, k)


@needs_kernel
@pytest.mark.parametrize("name", [s for s in SCHEDULERS.graph_names() if s != "cached_on_accelerator"])
def test_replay_safe_step_places_and_fetches_as_the_python_scheduler(name):
    """Layer steps of 1 to 64 tokens on the replay-safe path: the Python scheduler's plan from the same slot map
    says which experts ran where and which were fetched (no cache fills: fills_per_step=0); fetched slots hold
    the masters' weights; the sum is the float64 reference."""
    model = thm.patch_model(
        load_model("deepseek-tiny", dtype=torch.float32)[0],
        expert_budget=0.25,
        device="cpu",
        scheduler=name,
        hardware="rtx5090",
        expert_shape="deepseek-v2-lite",
        fills_per_step=0,
    )
    layer = list(model_layers(model).values())[1]
    layer.graph_mode = True
    path, store, stats = layer.graph_path(), layer.store, layer.stats
    torch.manual_seed(0)
    fetched = 0
    for tokens in (1, 8, 64, 64, 64):
        hidden = torch.randn(tokens, store.host_gate_up.shape[2])
        ids, weights = _skewed_routing(tokens, 4, store.num_experts)
        path.pull()
        resident = store.resident()
        plan = layer.scheduler.place(torch.bincount(ids.flatten(), minlength=store.num_experts).tolist(), resident)
        before = copy.copy(stats)
        out = layer.forward(hidden, ids, weights)
        path.pull()
        assert stats.accelerator_experts - before.accelerator_experts == len(plan.accelerator)
        assert stats.cpu_experts - before.cpu_experts == len(plan.cpu)
        assert stats.misses - before.misses == sum(not resident[e] for e in plan.accelerator + plan.cpu)
        assert stats.bytes_transferred - before.bytes_transferred == len(plan.fetch) * store.expert_bytes
        for e in plan.accelerator:
            s = store.expert_slot[e]
            assert s >= 0 and torch.equal(store.slot_gate_up[s], store.host_gate_up[e])
            assert torch.equal(store.slot_down[s], store.host_down[e])
        want = accumulate_experts_(
            torch.zeros(hidden.shape, dtype=torch.float64),
            hidden.double(),
            ids,
            weights.double(),
            store.host_gate_up.double(),
            store.host_down.double(),
        )
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
        fetched += len(plan.fetch)
    assert (fetched > 0) == (name != "all_cpu")
    if name == "all_cpu":
        assert stats.accelerator_experts == 0


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("name", ["on_demand", "dali_greedy"])  # the other forms: the test above
def test_replay_safe_schedulers_match_reference_model(name):
    """Where experts run never changes results: compiled steps on the replay-safe path against transformers."""
    ref = load_model("deepseek-tiny", dtype=torch.float32)[0]
    model = thm.patch_model(
        copy.deepcopy(ref),
        expert_budget=0.25,
        device="cpu",
        scheduler=name,
        hardware="rtx5090",
        expert_shape="deepseek-v2-lite",
    )
    _compiled_steps_match_reference(ref, model, (2, 24))
    stats = thm.stats(model).values()
    assert all(s.steps == 3 for s in stats)
    assert sum(s.accelerator_experts for s in stats) > 0


# aten ops that wait for the device on CUDA (data-dependent output shapes, or a value read on the host), which a
# graph capture refuses, or which would freeze a routing-dependent value into the graph.
# (`int(t)`, `bool(t)`, `.item()` all arrive as _local_scalar_dense.) On CPU the spy cannot tell a copy to the
# host (`.tolist()`, `.cpu()`) from any other copy, nor see syncs inside C++ kernels; the step has neither.
SYNCING = {
    "nonzero",
    "_local_scalar_dense",
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_consecutive",
    "unique_dim",
    "repeat_interleave",
    "bincount",
    "histc",
    "equal",
    "allclose",
    "masked_scatter",
    "argwhere",
}


class _SyncSpy(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every aten op, and which of them would synchronise on CUDA."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.overloadpacket.__name__)
        # indexing with a bool mask runs nonzero inside the kernel on CUDA, out of the dispatcher's sight
        if func.overloadpacket.__name__ in ("index", "index_put", "index_put_"):
            indices = args[1] if len(args) > 1 else []
            if any(t is not None and t.dtype == torch.bool for t in indices):
                self.ops.add("bool-mask indexing")
        return func(*args, **(kwargs or {}))


@needs_kernel
@pytest.mark.parametrize(
    "scheduler, cache_policy, prefetcher, cpu_weights",
    [
        ("cached_on_accelerator", "lru", "gate", "model"),
        ("on_demand", "mrs", "none", "int4"),
        ("fiddler", "lfu", "none", "model"),
        ("dali_greedy", "dali_window", "none", "int8"),
        ("hybrimoe", "lru", "none", "model"),
        ("all_cpu", "lfu", "none", "model"),
    ],
)
def test_replay_safe_step_runs_no_op_that_waits_for_the_device(
    scheduler, cache_policy, prefetcher, cpu_weights, monkeypatch
):
    """Every aten op a layer step issues on the replay-safe path, in each part a compiled mode uses (plain; an
    AHEAD half then its plain dispatch; LEADING then BEHIND), with the prefetch and the cache's admissions:
    none may read a device value on the host. The slot copies are exempt: their CPU stand-in indexes by mask,
    the CUDA kernel does not (tests/test_triton_kernels.py)."""
    from torch_hybrid_moe.runtime import graph_path

    model = thm.patch_model(
        load_model("deepseek-tiny", dtype=torch.float32)[0],
        expert_budget=0.25,
        device="cpu",
        scheduler=scheduler,
        cache_policy=cache_policy,
        prefetcher=prefetcher,
        hardware="rtx5090",
        expert_shape="deepseek-v2-lite",
        fills_per_step=2,
        cpu_weight_dtype=cpu_weights,
        cpu_weight_group_size=32,
    )
    layer = list(model_layers(model).values())[1]
    layer.graph_mode = True
    path = layer.graph_path()
    copy_rows = graph_path.copy_rows_

    def unseen_copy(*args: object) -> None:
        with torch.utils._python_dispatch._disable_current_modes():
            copy_rows(*args)

    monkeypatch.setattr(graph_path, "copy_rows_", unseen_copy)
    # The CPU share's prefill route is timed once per process and shape on random host weights quantised then (a
    # warm-up, before any capture): timed here first, so the spy sees the steps alone whatever test ran before.
    cpu_kernel.gemm_route(
        torch.zeros(64, layer.store.host_gate_up.shape[2]), *kernel_operands(layer.store.host_gate_up)
    )
    torch.manual_seed(0)
    spy = _SyncSpy()
    with spy:
        for tokens in (1, 8, 64):
            hidden = torch.randn(tokens, layer.store.host_gate_up.shape[2])
            (ids, w), (more, more_w) = _skewed_routing(tokens, 3, 32), _skewed_routing(tokens, 1, 32)
            path.begin_step()
            layer.prefetch(hidden, ids)
            for first, second in ((Part.PLAIN, None), (Part.AHEAD, Part.PLAIN), (Part.LEADING, Part.BEHIND)):
                layer.end(layer.begin(hidden, ids, w, first), hidden, first)
                if second is not None:
                    layer.end(layer.begin(hidden, more, more_w, second), hidden, second)
    assert {"scatter_add_", "sort"} <= spy.ops, spy.ops  # the spy saw the step
    assert not spy.ops & (SYNCING | {"bool-mask indexing"}), spy.ops & (SYNCING | {"bool-mask indexing"})
    path.pull()
    assert layer.stats.steps == 3 * 3 and layer.stats.accelerator_experts + layer.stats.cpu_experts > 0


@pytest.mark.slow
@needs_kernel
def test_leading_dispatch_leaves_its_slot_fills_to_its_behind_half():
    """Expert Deferral's immediate half (LEADING) counts the step but queues no copy: its deferred half (BEHIND)
    reads the slots first and then queues the fills. The two end as one plain dispatch of all the step's pairs does:
    the same slots, hits, misses and copies (the deferred pairs' experts were once left out of both)."""
    outcomes = []
    for split in (False, True):
        model = thm.patch_model(
            load_model("deepseek-tiny", dtype=torch.float32)[0],
            expert_budget=0.25,
            device="cpu",
            fills_per_step=2,
            cache_policy="lfu",
        )
        layer = list(model_layers(model).values())[1]
        layer.graph_mode = True
        path = layer.graph_path()
        torch.manual_seed(0)
        hidden = torch.randn(8, layer.store.host_gate_up.shape[2])
        (ids, weights), (later, later_w) = _skewed_routing(8, 3, 32), _skewed_routing(8, 1, 32)
        tables = path.expert_slot.clone()
        if split:
            layer.end(layer.begin(hidden, ids, weights, Part.LEADING), hidden, Part.LEADING)
            assert torch.equal(path.expert_slot, tables)  # nothing admitted yet
            layer.end(layer.begin(hidden, later, later_w, Part.BEHIND), hidden, Part.BEHIND)
        else:
            both, both_w = torch.cat((ids, later), 1), torch.cat((weights, later_w), 1)
            layer.end(layer.begin(hidden, both, both_w, Part.PLAIN), hidden, Part.PLAIN)
        path.pull()
        stats = layer.stats.as_dict()
        split_counts = stats.pop("accelerator_experts"), stats.pop("cpu_experts")  # per dispatch: may differ
        outcomes.append((layer.store.expert_slot[:], stats, split_counts))
    assert outcomes[0][:2] == outcomes[1][:2]
    assert outcomes[0][1]["steps"] == 1 and outcomes[0][1]["bytes_transferred"] > 0


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("fmt", ["int8", "int4", "bfloat16"])
def test_replay_safe_path_fills_slots_from_quantised_masters(fmt):
    """Host masters stored in another format than the fp32 slots: converted on the device after the copy."""
    ref = load_model("deepseek-tiny", dtype=torch.float32)[0]  # experts 32 wide
    results = []
    for graph in (True, False):
        model = thm.patch_model(
            copy.deepcopy(ref),
            expert_budget=0.5,
            device="cpu",
            cpu_weight_dtype=fmt,
            cpu_weight_group_size=32,
            fills_per_step=2,
            cache_policy="lfu",
        )
        for layer in model_layers(model).values():
            layer.graph_mode = graph
        torch.manual_seed(3)
        with torch.no_grad():
            results.append([model(torch.randint(3, 96, (2, 6))).logits for _ in range(4)])
        if graph:
            assert sum(s.bytes_transferred for s in thm.stats(model).values()) > 0  # slots were refilled
    # The two paths sum expert outputs in different orders (~4e-7 apart). int8 / int4 CPU experts round their inputs
    # to int8 per 32 columns, where such a difference can move a value to the neighbouring step: ~5e-4 of the
    # logits here. A slot filled from a master misread (scales, nibble order) moves them by far more.
    bound = 1e-5 if fmt == "bfloat16" else 2e-3
    for on, off in zip(*results):
        assert ((on - off).abs().max() / off.abs().max()) < bound


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_decode_graph_signature_covers_every_decode_call_of_generate(arch):
    """Each decode step generate() makes is capturable (masks may be a dict per layer type), steps at different
    positions share one graph, and another batch size or cache gets its own."""
    from torch_hybrid_moe.runtime.decode_graphs import DecodeGraphs

    model = thm.patch_model(tiny_model(arch), device="cpu")
    runner = DecodeGraphs(model)
    signatures = []

    def record(compile_config: object):
        def step(**kwargs: object) -> object:
            signatures.append(runner._signature(kwargs))
            return model(**kwargs)

        return step

    model.get_compiled_call = record
    with torch.no_grad():
        model.generate(torch.randint(3, 96, (2, 5)), max_new_tokens=4, do_sample=False)
        model.generate(torch.randint(3, 96, (1, 5)), max_new_tokens=3, do_sample=False)
    keys = [s[0] for s in signatures]
    assert None not in signatures and len(keys) == 5
    assert len(set(keys[:3])) == 1 and len(set(keys[3:])) == 1 and keys[0] != keys[3]
    assert all(any(isinstance(leaf, torch.Tensor) for leaf in s[1]) for s in signatures)


@pytest.mark.parametrize(("arch", "topk_method"), [(a, None) for a in TINY_ARCHITECTURES] + [("deepseek_v2", "greedy")])
def test_prefetch_routers_choose_the_experts_the_model_routes_to(arch, topk_method, tmp_path):
    """The router a live patch (the block's gate) and the simulator (the saved weights and config.json) replay for
    prefetching picks each token's experts as the model does: DeepSeek-V2's group_limited_greedy ranks a group by
    its best score, V3 by its two best, V2's greedy ignores groups (V3's rule on V2 missed a third of the tokens)."""
    from torch_hybrid_moe.model_patches import ARCHITECTURES
    from torch_hybrid_moe.model_patches.base import _router
    from torch_hybrid_moe.simulator.calibration import load_routers

    model = tiny_model(arch).float()
    cfg = model.config.get_text_config()
    idx, block = next((i, layer.mlp) for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
    if topk_method:
        cfg.topk_method = block.gate.topk_method = topk_method
    seen = []
    block.experts.register_forward_hook(lambda module, args, out: seen.append(args[1]))
    x = torch.randn(1, 512, cfg.hidden_size)
    with torch.no_grad():
        block(x)
    model.save_pretrained(tmp_path)
    for router in (_router(block, ARCHITECTURES[arch], cfg), load_routers(tmp_path, [idx])[idx]):
        ids, _ = router.route(x[0])
        assert torch.equal(ids.sort(-1).values, seen[0].sort(-1).values)


def test_decode_graphs_are_dropped_when_a_parameter_moved_before_a_generate_call():
    """A captured graph reads the parameters at the addresses it was captured with: after one is rebound
    (`p.data = t`) the next generate() call must not replay it (it would read freed memory); an in-place write,
    which the graph reads, keeps it."""
    from torch_hybrid_moe.runtime.decode_graphs import DecodeGraphs

    model = thm.patch_model(tiny_model("mixtral"), device="cpu")
    runner = DecodeGraphs(model)
    runner.graphs[("signature",)] = None  # stands for a captured graph
    runner.get_compiled_call(None)
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    runner.get_compiled_call(None)
    assert list(runner.graphs) == [("signature",)]
    model.lm_head.weight.data = model.lm_head.weight.data.clone()
    runner.get_compiled_call(None)
    assert not runner.graphs


@pytest.mark.parametrize("field, value", [("fills_per_step", -1), ("cpu_threads", 1.5), ("cuda_graph", 1)])
def test_graph_options_are_validated(field, value):
    with pytest.raises((ValueError, TypeError), match=field):
        thm.HybridMoEConfig(**{field: value})


def test_live_costs_price_slot_reads_at_the_slots_dtype_and_copies_at_the_host_copys():
    """int4 host experts are dequantised to bf16 on arrival: a cost-aware scheduler's model reads a slot's bf16
    weights on the accelerator and copies the int4 ones over the link (pricing both at int4 made slots look 3.6x
    cheaper to read)."""
    from .test_loading import _qwen3

    config = thm.HybridMoEConfig(
        cpu_weight_dtype="int4", cpu_weight_group_size=32, hardware="rtx4090", scheduler="dali_greedy"
    )
    model = thm.patch_model(_qwen3(64, 8, 64, 2).to(torch.bfloat16), config, device="cpu")
    weights = 3 * 64 * 64
    for layer in model_layers(model).values():
        costs = layer.scheduler.costs
        assert (layer.info.expert_bytes, layer.info.slot_bytes) == (weights // 2 + weights // 32 * 2, weights * 2)
        bf16 = CostModel(HARDWARE["rtx4090"], ExpertShape("bf16", 64, 64, 2.0))
        int4 = CostModel(HARDWARE["rtx4090"], ExpertShape("int4", 64, 64, layer.info.expert_bytes / weights))
        assert costs.t_gpu(1) == pytest.approx(bf16.t_gpu(1)) and costs.t_gpu(64) == pytest.approx(bf16.t_gpu(64))
        assert costs.t_transfer() == pytest.approx(int4.t_transfer()) and costs.t_cpu(1) == pytest.approx(int4.t_cpu(1))


def test_a_live_layer_offers_its_policies_the_links_copies_where_they_are_asynchronous():
    """On CUDA a layer's policies see the link's copies, timed by the cost model (`runtime/link_clock.py`), and its
    store reports each one; the CPU standing in for the accelerator copies synchronously, and without a cost model
    a copy has no duration: both offer an idle link."""
    from torch_hybrid_moe.policies import IdleLink
    from torch_hybrid_moe.runtime.costs import live_costs, policy_context
    from torch_hybrid_moe.runtime.link_clock import CopyTimeline, LinkClock, link_for

    assert link_for(torch.device("cpu")) is None
    info = LayerInfo(0, 8, 2, 24)
    config = thm.HybridMoEConfig(scheduler="queue_aware", hardware="dali").for_device(torch.device("cpu"))
    clock = LinkClock()
    timeline = policy_context(config, info, 2, 2, link=clock)["timeline"]
    assert isinstance(timeline, CopyTimeline) and timeline.clock is clock
    assert timeline.copy_s == live_costs(config, 2, 2, 24).t_transfer()
    policies = build_policies(config, policy_context(config, info, 2, 2, link=clock), capture=False)
    assert isinstance(policies.timeline, CopyTimeline) and policies.scheduler.timeline is policies.timeline
    plain = config.replace(scheduler="cached_on_accelerator", hardware="")
    for stack, context in (
        (config, policy_context(config, info, 2, 2)),
        (plain, policy_context(plain, info, 2, 2, link=clock)),
    ):
        assert isinstance(context["timeline"], IdleLink)
        assert build_policies(stack, context, capture=False).timeline is None


def test_the_stores_first_fills_still_crossing_are_on_the_layers_timeline():
    """A store fills its slots when built, before its layer gives it a timeline: the copies still crossing then must
    be booked, or the first step plans around an idle link and a slot that reads ready. (A CUDA store's events; here
    stand-ins, one still crossing, one landed, on a CPU store and a clock whose time stands still.)"""
    from torch_hybrid_moe.runtime.costs import policy_context
    from torch_hybrid_moe.runtime.link_clock import LinkClock

    store = ExpertStore(torch.randn(8, 4, 2), torch.randn(8, 2, 2), 2, torch.device("cpu"), torch.float32)
    crossing, landed = SimpleNamespace(query=lambda: False), SimpleNamespace(query=lambda: True)
    store._landed = [crossing, landed]  # experts 0 and 1 in slots 0 and 1
    config = thm.HybridMoEConfig(scheduler="queue_aware", hardware="dali").for_device(torch.device("cpu"))
    info = LayerInfo(0, 8, 2, store.expert_bytes)
    clock = LinkClock(now=lambda: 10.0)
    policies = build_policies(config, policy_context(config, info, 2, 2, link=clock), capture=False)
    layer = HybridMoELayer("first-fills", 0, store, config, policies=policies)
    timeline = layer.scheduler.timeline
    assert store.timeline is timeline
    assert timeline.ready_in(0) == pytest.approx(timeline.copy_s) and timeline.ready_in(1) == 0.0
    assert timeline.link_free_in() == pytest.approx(timeline.copy_s)


def test_a_scheduler_that_cannot_run_inside_a_graph_is_refused_before_patching():
    from torch_hybrid_moe.runtime.costs import policy_context

    router = Router(torch.randn(8, 2), 2)
    cpu = torch.device("cpu")  # the policies are built for a device (the patching step resolves "auto" for it)
    configs = (
        thm.HybridMoEConfig(scheduler="oracle", hardware="dali").for_device(cpu),
        thm.HybridMoEConfig(scheduler="optimal", hardware="dali").for_device(cpu),
        thm.HybridMoEConfig(prefetcher="impact", hardware="dali").for_device(cpu),
    )
    for config in configs:
        context = policy_context(config, LayerInfo(0, 8, 2, 24), hidden=2, inter=2, router=router)
        with pytest.raises(ValueError, match="CUDA graph"):
            build_policies(config, context, capture=True)
        build_policies(config, context, capture=False)  # fine uncaptured
    for name in SCHEDULERS.graph_names():
        config = thm.HybridMoEConfig(scheduler=name, hardware="dali").for_device(cpu)
        build_policies(config, policy_context(config, LayerInfo(0, 8, 2, 24), 2, 2, router), capture=True)

    own = Registry("scheduler")  # a policy registered under its own name gets no form, whatever class it extends
    own.register("own_greedy")(SCHEDULERS._factories["dali_greedy"])
    with pytest.raises(ValueError, match="scheduler 'own_greedy' has no tensor form"):
        own.tensor_form("own_greedy")
    config = thm.HybridMoEConfig(prefetcher="gate").for_device(cpu)
    build_policies(config, policy_context(config, LayerInfo(0, 8, 2, 24), 2, 2, router), capture=True)
