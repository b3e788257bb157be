"""`hybrid_moe::cpu_moe`: the C++ step of layers whose experts all run on the CPU, put in place of `dispatch` by the
backend. Checked against the same step compiled through `dispatch` (bit for bit, statistics too), and at its doors."""

import gc

import pytest
import torch

import torch_hybrid_moe as thm
from torch_hybrid_moe.compile_passes.backend import hybrid_moe_backend
from torch_hybrid_moe.runtime.stats import model_layers
from torch_hybrid_moe.tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("kernel")

CPU_MOE = torch.ops.hybrid_moe.cpu_moe.default


def compiled_logits(model, x, monkeypatch, direct: bool) -> tuple[torch.Tensor, list[str]]:
    """Logits of the model compiled with the backend (the cpu_moe pass on or off) and the MoE ops its graph calls."""
    from torch_hybrid_moe.compile_passes import cpu_dispatch

    seen: list[str] = []

    def rewrite(gm):
        done = cpu_dispatch.direct_cpu_dispatch(gm) if direct else 0
        seen.extend(str(n.target) for n in gm.graph.nodes if "hybrid_moe.cpu_moe" in str(n.target))
        seen.extend(str(n.target) for n in gm.graph.nodes if "hybrid_moe.dispatch" in str(n.target))
        return done

    monkeypatch.setattr("torch_hybrid_moe.compile_passes.backend.direct_cpu_dispatch", rewrite)
    torch._dynamo.reset()
    thm.reset_stats(model)
    with torch.no_grad():
        logits = torch.compile(model, backend=hybrid_moe_backend, fullgraph=True)(x).logits
    return logits, seen


def bf16_model(name: str) -> torch.nn.Module:
    """A tiny random model of an architecture, or an embedded trained one (its experts take int8 / int4 groups)."""
    if "-" in name:
        from torch_hybrid_moe.embedded import load_model

        return load_model(name, torch.bfloat16)[0]
    return tiny_model(name, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "architecture, weights, tokens",
    [("qwen3_moe", "model", 1), ("deepseek-tiny", "int8", 1), ("mixtral-tiny", "int4", 3)],
)
def test_cpu_moe_step_equals_the_dispatch_step(architecture, weights, tokens, monkeypatch):
    """Budget 0, decode-sized graphs: every MoE layer's dispatch becomes cpu_moe, and the logits and the layers'
    statistics equal those of the same graph through dispatch exactly."""
    model = thm.patch_model(
        bf16_model(architecture),
        expert_budget=0.0,
        device="cpu",
        cpu_weight_dtype=weights,
        cpu_weight_group_size=32,
    )
    x = torch.randint(3, 96, (2, tokens), generator=torch.Generator().manual_seed(1))
    runs = {}
    for direct in (False, True):
        logits, ops = compiled_logits(model, x, monkeypatch, direct)
        runs[direct] = logits, ops, {i: s.as_dict() for i, s in thm.stats(model).items()}
    layers = len(model_layers(model))
    assert runs[True][1] == [str(CPU_MOE)] * layers and len(runs[False][1]) == layers
    assert torch.equal(runs[True][0], runs[False][0])
    assert runs[True][2] == runs[False][2] and all(s["steps"] == 1 for s in runs[True][2].values())
    assert all(s["cpu_experts"] > 0 and s["tokens"] == x.numel() for s in runs[True][2].values())


@pytest.mark.parametrize("budget, tokens", [(0.5, 1), (0.0, 10)])
def test_layers_with_slots_and_prefill_graphs_keep_dispatch(budget, tokens, monkeypatch):
    """Slots leave placement to decide at run time; 2 x 10 tokens may reach a measured GEMM route: dispatch stays."""
    model = thm.patch_model(tiny_model("qwen3_moe", dtype=torch.bfloat16), expert_budget=budget, device="cpu")
    _, ops = compiled_logits(model, torch.randint(3, 96, (2, tokens)), monkeypatch, True)
    assert ops and all("dispatch" in op for op in ops)


def test_cpu_moe_refuses_a_freed_layer_and_bad_ids():
    model = thm.patch_model(tiny_model("mixtral", dtype=torch.bfloat16), expert_budget=0.0, device="cpu")
    layer = next(iter(model_layers(model).values()))
    handle, hidden = layer.handle, torch.randn(1, model.config.hidden_size, dtype=torch.bfloat16)
    weights = torch.tensor([[0.5, 0.5]])
    with pytest.raises(RuntimeError, match="expert id 99 outside"):
        CPU_MOE(hidden, torch.tensor([[0, 99]]), weights, handle)
    assert torch.equal(
        CPU_MOE(hidden, torch.tensor([[0, 1]]), weights, handle),
        torch.ops.hybrid_moe.dispatch(hidden, torch.tensor([[0, 1]]), weights, handle),
    )
    del model, layer
    gc.collect()
    with pytest.raises(RuntimeError, match=f"handle {handle} is not live: the patched model it belonged to was freed"):
        CPU_MOE(hidden, torch.tensor([[0, 1]]), weights, handle)


@pytest.mark.parametrize("hidden_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_cpu_moe_takes_any_float_dtypes_as_dispatch_does(hidden_dtype, weights_dtype):
    """cpu_moe converts the routing weights and rounds its sums in C++, without dtype-conversion ops: dispatch's
    result, in hidden's dtype, for every pairing of dtypes a graph may hand it."""
    model = thm.patch_model(tiny_model("mixtral", dtype=torch.bfloat16), expert_budget=0.0, device="cpu")
    handle = next(iter(model_layers(model).values())).handle
    hidden = torch.randn(3, model.config.hidden_size, dtype=hidden_dtype)
    ids, weights = torch.tensor([[0, 1], [2, 3], [1, 0]]), torch.rand(3, 2, dtype=weights_dtype)
    out = CPU_MOE(hidden, ids, weights, handle)
    assert out.dtype == hidden_dtype
    assert torch.equal(out, torch.ops.hybrid_moe.dispatch(hidden, ids, weights, handle))


def test_cpu_moe_refuses_misshapen_routing():
    model = thm.patch_model(tiny_model("mixtral", dtype=torch.bfloat16), expert_budget=0.0, device="cpu")
    handle = next(iter(model_layers(model).values())).handle
    hidden = torch.randn(1, model.config.hidden_size, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"topk_ids must be an integer tensor \[T, K\]"):
        CPU_MOE(hidden, torch.tensor([0, 1]), torch.tensor([0.5, 0.5]), handle)
    with pytest.raises(RuntimeError, match=r"topk_weights must be \[T, K\] like topk_ids"):
        CPU_MOE(hidden, torch.tensor([[0, 1]]), torch.tensor([[0.5, 0.25, 0.25]]), handle)
    with pytest.raises(RuntimeError, match=r"floating tensor \(fp32, fp64, bf16 or fp16\), got Long"):
        CPU_MOE(hidden, torch.tensor([[0, 1]]), torch.tensor([[1, 1]]), handle)
    with pytest.raises(RuntimeError, match=r"topk_ids and hidden disagree on the token count: topk_ids \[2, 2\]"):
        CPU_MOE(hidden, torch.tensor([[0, 1], [1, 0]]), torch.tensor([[0.5, 0.5], [0.5, 0.5]]), handle)


def test_a_bound_handle_computes_the_bound_layers_experts(monkeypatch):
    """Stock models share one compiled graph and bind its handles to the calling model's layers before each call:
    cpu_moe follows the binding (two models with other weights, one graph, each the logits and the counts of the same
    graph through dispatch, bit for bit)."""
    from torch_hybrid_moe.compile_passes import cpu_dispatch

    models = [tiny_model("qwen3_moe", seed=s, dtype=torch.bfloat16) for s in (0, 1)]
    x = torch.tensor([[5, 7]])
    runs = {}
    for direct in (False, True):
        graphs: list[list[str]] = []

        def rewrite(gm, direct=direct, graphs=graphs):
            done = cpu_dispatch.direct_cpu_dispatch(gm) if direct else 0
            graphs.append([str(n.target) for n in gm.graph.nodes if str(n.target).startswith("hybrid_moe.")])
            return done

        monkeypatch.setattr("torch_hybrid_moe.compile_passes.backend.direct_cpu_dispatch", rewrite)
        torch._dynamo.reset()
        compiled = [
            torch.compile(m, backend="hybrid_moe", fullgraph=True, options={"expert_budget": 0.0}) for m in models
        ]
        with torch.no_grad():
            logits = [c(x).logits for c in compiled] + [compiled[0](x).logits]  # a, b, and a again: rebinding back
        counts = [{i: (s.steps, s.tokens, s.cpu_experts) for i, s in thm.stats(m).items()} for m in models]
        runs[direct] = logits, counts, graphs
        for m in models:
            thm.reset_stats(m)
    (want, want_counts, _), (got, got_counts, graphs) = runs[False], runs[True]
    assert len(graphs) == 1 and graphs[0].count(str(CPU_MOE)) == 2 and "dispatch" not in str(graphs)
    assert all(torch.equal(g, w) for g, w in zip(got, want)) and torch.equal(got[0], got[2])
    assert not torch.equal(got[0], got[1])
    assert got_counts == want_counts and all(c[0] == 2 for c in got_counts[0].values())


def test_counts_of_every_graph_a_stock_layer_runs_in_are_kept(monkeypatch):
    """A stock layer runs under one handle per compiled graph (here prefill and decode): its statistics hold the
    steps of both."""
    model = tiny_model("qwen3_moe", dtype=torch.bfloat16)
    compiled = torch.compile(model, backend="hybrid_moe", fullgraph=True, options={"expert_budget": 0.0})
    with torch.no_grad():
        for tokens in (4, 1, 4, 1):  # two graphs, taking turns
            compiled(torch.randint(3, 96, (1, tokens)))
    assert all((s.steps, s.tokens) == (4, 10) for s in thm.stats(model).values())


def test_a_handle_gone_to_a_layer_with_slots_takes_dispatch():
    """A graph compiled for an all-CPU layer keeps calling cpu_moe with its handle; when the handle comes to name a
    layer with slots (a freed model's handle reused), the call is the slots layer's dispatch, counts included."""
    from torch_hybrid_moe.runtime import registry

    cpu_model = thm.patch_model(tiny_model("mixtral", dtype=torch.bfloat16), expert_budget=0.0, device="cpu")
    slots_model = thm.patch_model(tiny_model("mixtral", dtype=torch.bfloat16), expert_budget=0.5, device="cpu")
    cpu_layer, slots_layer = (next(iter(model_layers(m).values())) for m in (cpu_model, slots_model))
    registry.bind(cpu_layer.handle, slots_layer)
    hidden, ids, weights = torch.randn(1, 32, dtype=torch.bfloat16), torch.tensor([[0, 1]]), torch.tensor([[0.5, 0.5]])
    got = CPU_MOE(hidden, ids, weights, cpu_layer.handle)
    assert torch.equal(got, torch.ops.hybrid_moe.dispatch(hidden, ids, weights, slots_layer.handle))
    assert slots_layer.stats.steps == 2 and cpu_layer.stats.steps == 0


def test_threads_registering_layers_never_share_a_freed_handle():
    """Two threads taking freed handles of one key took the same one now and then (about 1 round in 100): one handle
    then named both layers, and a graph compiled for one computed with the other's experts. Registration is atomic."""
    import sys
    import threading

    from torch_hybrid_moe.runtime import registry

    class Layer:  # what register_layer needs of a layer: a weak reference and `publish`
        def publish(self, handle: int) -> None:
            pass

    key = ("threads-test", 0)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        for _ in range(1500):
            freed = [Layer() for _ in range(4)]
            for layer in freed:
                registry.register_layer(layer, key=key)
            del freed, layer  # freed at once (no cycles): their handles go back to the key
            got: dict[int, tuple[int, Layer]] = {}
            start = threading.Barrier(4)

            def register(i: int) -> None:
                layer = Layer()
                start.wait()
                got[i] = registry.register_layer(layer, key=key), layer

            threads = [threading.Thread(target=register, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert len({h for h, _ in got.values()}) == 4
            assert all(registry.get_layer(h) is layer for h, layer in got.values())
            got.clear()
    finally:
        sys.setswitchinterval(interval)
