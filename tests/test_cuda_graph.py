"""The decode step as one CUDA graph: replay against the unpatched model, host functions, endurance, launches."""

import copy
import threading
from collections.abc import Callable

import pytest
import torch

import torch_hybrid_moe as thm
from torch_hybrid_moe.compile_passes.daop_precalc import precalc_stats
from torch_hybrid_moe.embedded import load_model
from torch_hybrid_moe.ops import expert_math
from torch_hybrid_moe.runtime import layer as layer_module
from torch_hybrid_moe.runtime import model_layers, staging_ring
from torch_hybrid_moe.runtime.decode_replay import DecodeReplay
from torch_hybrid_moe.runtime.graph_path import GraphPath, Part
from torch_hybrid_moe.tiny_models import TINY_ARCHITECTURES, tiny_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU; none on this machine"),
]


def _spy(model: torch.nn.Module) -> tuple[object, list[dict]]:
    """The model's DecodeGraphs and a record of the decode-step arguments generate() hands it."""
    runner = model.get_compiled_call.__self__
    calls: list[dict] = []

    def recording(compile_config: object):
        runner.get_compiled_call(compile_config)

        def step(**kwargs: object) -> object:
            calls.append(kwargs)
            return runner(**kwargs)

        return step

    model.get_compiled_call = recording
    return runner, calls


def _generate(model: torch.nn.Module, x: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    out = model.generate(x, max_new_tokens=steps, do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits).double()


def _routed(model: torch.nn.Module, x: torch.Tensor, steps: int) -> list[tuple]:
    """Each decode step's expert ids in every MoE layer of the reference."""
    seen: dict[int, list[tuple]] = {}

    def hook(i: int) -> Callable:
        return lambda module, args: seen.setdefault(i, []).append(tuple(args[1].flatten().tolist()))

    layers = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    handles = [experts.register_forward_pre_hook(hook(i)) for i, experts in enumerate(layers)]
    model.generate(x, max_new_tokens=steps, do_sample=False)
    for handle in handles:
        handle.remove()
    return list(zip(*seen.values()))[1:]


@pytest.mark.parametrize("budget", [0.0, 0.25, 1.0])
@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_graph_replay_matches_reference_for_32_steps(arch, budget):
    ref = tiny_model(arch).cuda()
    model = thm.patch_model(copy.deepcopy(ref).cpu(), expert_budget=budget, device="cuda", fills_per_step=2)
    runner, calls = _spy(model)
    x = torch.randint(3, 96, (2, 5), device="cuda")
    with torch.no_grad():
        want_tokens, want_logits = _generate(ref, x, 32)
        got_tokens, got_logits = _generate(model, x, 32)
    assert runner.captures == 1 and runner.replays == 31 == len(calls)
    assert torch.equal(got_tokens, want_tokens)
    assert ((got_logits - want_logits).abs().max() / want_logits.abs().max()) < 1e-4
    routing = _routed(ref, x, 32)
    # most replays route differently from the captured step: nothing routing-dependent was frozen at capture
    assert sum(r != routing[0] for r in routing[1:]) > len(routing) // 2
    stats = thm.stats(model)
    assert sum(s.steps for s in stats.values()) > 0
    if 0 < budget < 1:
        assert sum(s.hits for s in stats.values()) > 0 and sum(s.misses for s in stats.values()) > 0
    for layer in model_layers(model).values():
        assert layer.store.resident().count(True) == layer.store.num_slots  # tables pulled back intact
        for buf in layer.graph_path()._buffers.values():
            # every replay and the warm-up fired both host functions, and the worker ran each submission
            assert buf.task.submits == buf.task.syncs == buf.task.runs == runner.replays + runner.captures


def test_graph_replays_hand_generate_each_steps_own_hidden_states():
    """generate() keeps each step's hidden states as they come: every replay's must be its own, not the graph's
    output buffers, which the next replay overwrites."""
    ref = tiny_model("mixtral").cuda()
    model = thm.patch_model(copy.deepcopy(ref).cpu(), expert_budget=0.25, device="cuda")
    runner, _ = _spy(model)
    x = torch.randint(3, 96, (1, 5), device="cuda")
    settings = dict(max_new_tokens=6, do_sample=False, output_hidden_states=True, return_dict_in_generate=True)
    with torch.no_grad():
        want, got = (m.generate(x, **settings).hidden_states for m in (ref, model))
    assert runner.replays > 0
    for step_want, step_got in zip(want[1:], got[1:]):  # the decode steps (the first entry is the prompt's)
        for a, b in zip(step_want, step_got):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("gathered", [False, True], ids=["native", "gathered"])
@pytest.mark.parametrize("fmt, tolerance", [("model", 1.5e-2), ("int8", 2e-2)])
def test_bf16_graph_replay_matches_reference(fmt, tolerance, gathered, monkeypatch):
    """bf16 slots in the captured decode step: the grouped slot share on GPUs of compute capability 9.x / 10.x (the
    gathered one elsewhere, as on consumer cards; `gathered` forces it on any GPU, its slots never filled holding
    whatever their memory held), with int8 CPU masters the slots' inputs rounded as the kernel rounds them. Each step's
    logits are held, position by position, to the same bf16 weights computed in fp32 on the same tokens, beside the
    unpatched bf16 model's own error there: bf16 rounding alone moves positions by a few 1e-2 (routing flips on the
    CPU, 2026-11-27; on an H200 the first decode steps of both formats were 3-6e-2 off), whatever computes them. So
    what ours adds to the bf16 model's own error is held: its median to half the bound, all but an eighth of the
    positions to the bound, every one to 0.1. A wrong slot share moves most positions (one off by half, planted on
    the CPU, put the median at 7e-2)."""
    if gathered:
        for module in (expert_math, layer_module, staging_ring):
            monkeypatch.setattr(module, "grouped_slots", lambda slots: False)
    ref = load_model("deepseek-tiny", dtype=torch.bfloat16)[0].cuda()  # experts 32 wide: int8 groups of 32
    model = thm.patch_model(
        copy.deepcopy(ref).cpu(),
        expert_budget=0.25,
        device="cuda",
        fills_per_step=2,
        cpu_weight_dtype=fmt,
        cpu_weight_group_size=32,
    )
    runner, _ = _spy(model)
    torch.manual_seed(0)
    x = torch.randint(3, 96, (2, 5), device="cuda")
    decoded = slice(x.shape[1] - 1, -1)  # the positions each new token was chosen from
    with torch.no_grad():
        tokens, logits = _generate(model, x, 16)
        own = ref(tokens).logits[:, decoded].double()
        want = ref.float()(tokens).logits[:, decoded].double()
    assert runner.captures == 1 and runner.replays == 15
    grouped = torch.cuda.get_device_capability()[0] in (9, 10) and not gathered
    assert all(expert_math.grouped_slots(layer.store.slot_gate_up) is grouped for layer in model_layers(model).values())

    def error(got: torch.Tensor) -> torch.Tensor:
        return ((got - want).abs().amax(-1) / want.abs().max()).flatten()

    ours, bf16 = error(logits.transpose(0, 1)), error(own)
    added = ours - bf16
    for name, err in (("ours", ours), ("bf16 model", bf16)):
        print(f"{fmt}, {name}: median {err.median():.4f}, max {err.max():.4f} of the fp32 logits' largest")
    bounded = added.median() < tolerance / 2 and added.max() < 0.1
    assert bounded and (added > tolerance).sum() <= len(added) // 8, f"ours {ours}, bf16 model {bf16}"


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_graph_on_equals_graph_off_with_quantised_cpu_weights(fmt):
    ref = load_model("deepseek-tiny", dtype=torch.float32)[0]  # experts 32 wide
    x = torch.randint(3, 96, (2, 5), device="cuda")
    results = []
    for graph in (True, False):
        model = thm.patch_model(
            copy.deepcopy(ref),
            expert_budget=0.25,
            device="cuda",
            cuda_graph=graph,
            cpu_weight_dtype=fmt,
            cpu_weight_group_size=32,
            fills_per_step=2,
        )
        with torch.no_grad():
            results.append(_generate(model, x, 16))
    (tokens_on, logits_on), (tokens_off, logits_off) = results
    assert torch.equal(tokens_on, tokens_off)
    assert ((logits_on - logits_off).abs().max() / logits_off.abs().max()) < 1e-4


def _replays_match_reference(**patch: object) -> torch.nn.Module:
    """deepseek-tiny patched with `patch` at budget 0.25: 32 greedy steps (one capture, 31 replays) give the
    unpatched model's tokens and logits; returns the patched model."""
    ref = load_model("deepseek-tiny", dtype=torch.float32)[0].cuda()
    model = thm.patch_model(copy.deepcopy(ref).cpu(), expert_budget=0.25, device="cuda", **patch)
    runner, _ = _spy(model)
    x = torch.randint(3, 2000, (2, 5), device="cuda")
    with torch.no_grad():
        want_tokens, want_logits = _generate(ref, x, 32)
        got_tokens, got_logits = _generate(model, x, 32)
    assert runner.captures == 1 and runner.replays == 31
    assert torch.equal(got_tokens, want_tokens)
    assert ((got_logits - want_logits).abs().max() / want_logits.abs().max()) < 1e-4
    return model


def test_graph_replay_with_gate_prefetch_matches_reference():
    """The prefetch is decided on the device at every replay (this layer's router on the previous layer's input)."""
    model = _replays_match_reference(prefetcher="gate")
    # the replays' own copies, on the device counters before stats() folds them in (prefill prefetches too)
    paths = [layer.graph_path() for layer in model_layers(model).values()]
    index = GraphPath.COUNTERS.index
    assert [int(p.counters[index("prefetch_calls")]) for p in paths] == [0] + [31] * (len(paths) - 1)
    assert sum(int(p.counters[index("prefetched_experts")]) for p in paths) > 0
    stats = list(thm.stats(model).values())
    assert stats[0].prefetch_calls == 0 and all(s.prefetch_calls == 32 for s in stats[1:])  # + prefill's


@pytest.mark.parametrize(
    "policies",
    [
        dict(scheduler="on_demand"),
        dict(scheduler="dali_greedy"),
        dict(scheduler="hybrimoe", cache_policy="mrs"),
        dict(scheduler="queue_aware", cache_policy="dali_window", cache_options=dict(w_size=4, u_size=1, decay=0.5)),
    ],
    ids=["on_demand", "dali_greedy", "hybrimoe", "ours"],
)
def test_graph_replay_with_fetching_schedulers_matches_reference(policies):
    """Placement and on-demand copies are decided on the device at every replay (policies/device_scheduling.py);
    ours is queue-aware placement over the window cache, both in tensor form."""
    model = _replays_match_reference(**policies, hardware="rtx5090", expert_shape="deepseek-v2-lite")
    # the replays' own on-demand copies, on the device counters before stats() folds them in
    paths = [layer.graph_path() for layer in model_layers(model).values()]
    assert sum(int(p.counters[GraphPath.COUNTERS.index("fetched")]) for p in paths) > 0
    stats = thm.stats(model).values()
    on_gpu, hits = sum(s.accelerator_experts for s in stats), sum(s.hits for s in stats)
    cpu, misses = sum(s.cpu_experts for s in stats), sum(s.misses for s in stats)
    streamed = sum(s.streamed_experts for s in stats)  # prefill's, through the staging ring
    assert on_gpu + cpu + streamed == hits + misses


@pytest.mark.parametrize(
    "budget, mode",
    [(0.25, dict(mode="expert_deferral", deferred_experts=2)), (0.0, dict(mode="daop_precalc", precalc_from_layer=1))],
)
def test_approximate_modes_in_the_graph_equal_uncaptured_and_overlap_on_their_own_buffers(budget, mode):
    """Expert Deferral and DAOP's pre-calculation start CPU work in one block and finish it in the next. DAOP's
    routing depends on what the slots hold, which graph and eager caches fill differently, so it is compared
    with no slots (every predicted pair on the CPU, on the earlier input); tests/test_daop_precalc.py checks
    its degradation against a hand reference on the replay-safe path."""
    ref = load_model("deepseek-tiny", dtype=torch.float32)[0]
    x = torch.randint(3, 2000, (2, 5), device="cuda")
    results, runners, models = [], [], []
    for graph in (True, False):
        model = thm.patch_model(copy.deepcopy(ref), expert_budget=budget, device="cuda", cuda_graph=graph, **mode)
        models.append(model)
        if graph:
            runner, _ = _spy(model)
            runners.append((runner, model))
        with torch.no_grad():
            results.append(_generate(model, x, 16))
    (tokens_on, logits_on), (tokens_off, logits_off) = results
    assert torch.equal(tokens_on, tokens_off)
    assert ((logits_on - logits_off).abs().max() / logits_off.abs().max()) < 1e-4
    if mode["mode"] == "daop_precalc":  # device counters, warm-up left out: the same decode steps either way
        on, off = (precalc_stats(model_layers(m)) for m in models)
        assert [c.pairs for c in on.values()] == [c.pairs for c in off.values()] == [0, 15 * 2 * 4, 15 * 2 * 4]
        assert on == off
    runner, model = runners[0]
    layers = list(model_layers(model).values())
    for i, layer in enumerate(layers):
        parts = {key[-1]: buf.task for key, buf in layer.graph_path()._buffers.items()}
        # deferral: every MoE layer but the last; DAOP: every one but the first
        if mode["mode"] == "expert_deferral":
            assert set(parts) == ({Part.LEADING, Part.BEHIND} if i < len(layers) - 1 else {Part.PLAIN})
        else:
            assert set(parts) == ({Part.PLAIN, Part.AHEAD} if i > 0 else {Part.PLAIN})
        for task in parts.values():
            assert task.submits == task.syncs == task.runs == runner.replays + runner.captures


def _captured_model() -> tuple[torch.nn.Module, object, dict]:
    model = thm.patch_model(tiny_model("mixtral"), expert_budget=0.25, device="cuda")
    runner, calls = _spy(model)
    with torch.no_grad():
        model.generate(torch.randint(3, 96, (1, 5), device="cuda"), max_new_tokens=4, do_sample=False)
    return model, runner, calls[-1]


def _rewinder(kwargs: dict) -> Callable[[], None]:
    """Puts the cache length back to where the last decode step of a generate() started (so positions stay in
    range however often that step is replayed); its targets are computed here, outside any profiled region."""
    cache = kwargs["cache" if "cache" in kwargs else "past_key_values"]  # the name from transformers 5.24, and before
    pairs = [(layer.cumulative_length, layer.cumulative_length.clone() - 1) for layer in cache.layers]

    def rewind() -> None:
        for length, start in pairs:
            length.copy_(start)  # a device-to-device copy: no kernel launch

    return rewind


def _replay_at_fixed_position(runner: object, kwargs: dict, n: int, rewind: Callable[[], None] | None = None) -> None:
    """Replay the last decode step of a generate() n more times."""
    rewind = rewind or _rewinder(kwargs)
    for _ in range(n):
        rewind()
        runner(**kwargs)


def test_thousand_replays_no_deadlock_no_leak_with_a_busy_python_thread():
    model, runner, kwargs = _captured_model()
    tasks = [b.task for layer in model_layers(model).values() for b in layer.graph_path()._buffers.values()]
    before_runs = [t.runs for t in tasks]
    _replay_at_fixed_position(runner, kwargs, 10)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    stop = threading.Event()

    def spin() -> None:  # holds the GIL as much as Python lets it
        x = 0
        while not stop.is_set():
            x += 1

    busy = threading.Thread(target=spin, daemon=True)
    busy.start()
    done = threading.Event()

    def replays() -> None:
        with torch.no_grad():
            _replay_at_fixed_position(runner, kwargs, 1000)
        torch.cuda.synchronize()
        done.set()

    worker = threading.Thread(target=replays, daemon=True)
    worker.start()
    worker.join(timeout=300)
    stop.set()
    busy.join()
    assert done.is_set(), "1000 replays did not finish in 300 s: deadlock"
    assert torch.cuda.memory_allocated() == allocated
    assert [t.runs - b for t, b in zip(tasks, before_runs)] == [1010] * len(tasks)


def test_profiler_shows_one_graph_launch_per_token_and_no_kernel_launches():
    model, runner, kwargs = _captured_model()
    rewind = _rewinder(kwargs)
    _replay_at_fixed_position(runner, kwargs, 3, rewind)
    torch.cuda.synchronize()
    with (
        torch.no_grad(),
        torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof,
    ):
        _replay_at_fixed_position(runner, kwargs, 5, rewind)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    launches = [n for n in names if n.startswith(("cudaGraphLaunch", "cuGraphLaunch"))]  # CUPTI may add _vNNNN
    kernels = [n for n in names if n.startswith(("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))]
    assert len(launches) == 5, sorted({n for n in names if n.startswith(("cuda", "cu"))})
    assert not kernels, kernels


def test_graph_off_runs_uncaptured():
    """cuda_graph=False: generate()'s decode steps call the compiled forward (past Dynamo once two steps agree,
    runtime/decode_replay.py), never a captured graph."""
    model = thm.patch_model(tiny_model("mixtral"), expert_budget=0.25, device="cuda", cuda_graph=False)
    assert isinstance(model.get_compiled_call(model.generation_config.compile_config), DecodeReplay)
