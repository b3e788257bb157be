"""The backend: found by name in a fresh interpreter, rewrites experts regions, inserts prefetches."""

import subprocess
import sys
import textwrap

import pytest
import torch

import torch_hybrid_moe as thm
from torch_hybrid_moe.compile_passes import find_experts_regions, insert_prefetch, rewrite_experts_regions
from torch_hybrid_moe.compile_passes.graph_utils import DISPATCH, PREFETCH, calls
from torch_hybrid_moe.config import HybridMoEConfig
from torch_hybrid_moe.runtime import model_layers

from .conftest import patched_copy


@pytest.mark.slow
def test_backend_name_works_without_importing_the_package():
    code = textwrap.dedent("""
        import sys, torch
        from transformers import AutoModelForCausalLM, MixtralConfig
        assert "torch_hybrid_moe" not in sys.modules
        cfg = MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).eval()
        x = torch.randint(0, 32, (1, 5))
        with torch.no_grad():
            want = model(x).logits
            got = torch.compile(model, backend="hybrid_moe", fullgraph=True)(x).logits
        assert "hybrid_moe" in torch._dynamo.list_backends()
        assert "torch_hybrid_moe" in sys.modules
        torch.testing.assert_close(got, want)
        print("OK")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("OK")


def capture_graph(model, x):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch.compile(model, backend=backend, fullgraph=True)(x)
    return graphs[0]


@pytest.mark.slow
def test_passes_rewrite_stock_regions_and_chain_prefetches(reference_models):
    import copy

    stock = copy.deepcopy(reference_models["deepseek_v3"])  # layers 1, 2 are MoE
    gm, example_inputs = capture_graph(stock, torch.randint(3, 96, (1, 4)))
    assert [r.path for r in find_experts_regions(gm.graph)] == [
        "L['self'].model.layers.1.mlp.experts",
        "L['self'].model.layers.2.mlp.experts",
    ]
    assert len(rewrite_experts_regions(gm, example_inputs, HybridMoEConfig()).sites) == 2
    assert insert_prefetch(gm) == 1
    assert insert_prefetch(gm) == 0  # idempotent
    dispatch = [n for n in gm.graph.nodes if calls(n, DISPATCH)]
    prefetch = [n for n in gm.graph.nodes if calls(n, PREFETCH)]
    assert len(dispatch) == 2 and len(prefetch) == 1
    order = list(gm.graph.nodes)
    # the prefetch for layer 2 sits after layer 1's routing and before layer 1's experts run
    assert prefetch[0].args[1] is dispatch[0].args[1]
    assert order.index(dispatch[0].args[1]) < order.index(prefetch[0]) < order.index(dispatch[0])
    assert dispatch[0].args[0] is prefetch[0]  # layer 1's experts read their input through it: pinned before
    assert prefetch[0].args[2] == dispatch[1].args[3]
    # no grouped_mm or fallback op is left behind
    assert not any("grouped_mm" in str(n.target) for n in gm.graph.nodes)


@pytest.mark.slow
def test_compiled_prefetch_runs_every_step(reference_models):
    model = patched_copy(reference_models["mixtral"])
    compiled = torch.compile(model, backend="hybrid_moe", fullgraph=True)
    with torch.no_grad():
        for _ in range(3):
            compiled(torch.randint(3, 96, (1, 3)))
    calls_per_layer = [layer.stats.prefetch_calls for layer in model_layers(model).values()]
    assert calls_per_layer == [0, 3, 3]  # layers 1 and 2 are prefetched for, after layers 0 and 1


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_layers_without_slots_get_no_prefetch(reference_models, compiled):
    """expert_budget 0: nothing can be prefetched, so the compiled step holds no prefetch op to call, and the eager
    step's calls count none either (the two runs' statistics agree)."""
    model = patched_copy(reference_models["mixtral"], expert_budget=0.0)
    run = torch.compile(model, backend="hybrid_moe", fullgraph=True) if compiled else model
    with torch.no_grad():
        run(torch.randint(3, 96, (1, 3)))
    assert [layer.stats.prefetch_calls for layer in model_layers(model).values()] == [0, 0, 0]
    assert sum(layer.stats.steps for layer in model_layers(model).values()) == 3


def test_backend_options_configure_stock_models(reference_models):
    import copy

    stock = copy.deepcopy(reference_models["mixtral"])
    compiled = torch.compile(stock, backend="hybrid_moe", options={"expert_budget": 1.0})
    with torch.no_grad():
        compiled(torch.randint(3, 96, (1, 3)))
    assert all(s.cpu_experts == 0 for s in thm.stats(stock).values())


@pytest.mark.parametrize("patched", [True, False])
def test_a_forward_with_grad_enabled_runs_without_autograd_and_says_so(reference_models, patched):
    """README's minimal example calls the compiled model outside torch.no_grad(): compiling for autograd failed at
    the first hybrid_moe op (no backward). The graph runs without autograd, with a warning, and gives the unpatched
    model's logits."""
    import copy

    ref = reference_models["qwen3_moe"]
    model = patched_copy(ref, expert_budget=0.25) if patched else copy.deepcopy(ref)
    compiled = torch.compile(
        model, backend="hybrid_moe", **({"options": {"expert_budget": 0.25}} if not patched else {})
    )
    x = torch.randint(3, 96, (2, 5))
    with pytest.warns(UserWarning, match="inference-only, so this graph runs without autograd"):
        got = compiled(x).logits
    with torch.no_grad():
        want = ref(x).logits
    assert not got.requires_grad and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert sum(s.tokens for s in thm.stats(model).values())  # the hybrid layers ran


def test_a_no_grad_region_inside_the_forward_does_not_turn_autograd_back_on(reference_models):
    """A `torch.no_grad()` block in a forward called with grad enabled is traced as two grad-mode switches, the
    second turning autograd back on for the layers after it (torch 2.11's Dynamo does so for transformers' rotary
    embedding): compiling then failed at the first hybrid_moe op. The graph runs without autograd, as above."""

    class WithNoGradBlock(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                ids = ids + 0
            return self.model(ids).logits

    ref = reference_models["qwen3_moe"]
    compiled = torch.compile(WithNoGradBlock(patched_copy(ref, expert_budget=0.25)), backend="hybrid_moe")
    x = torch.randint(3, 96, (2, 5))
    with pytest.warns(UserWarning, match="inference-only, so this graph runs without autograd"):
        got = compiled(x)
    with torch.no_grad():
        want = ref(x).logits
    assert not got.requires_grad and torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_backend_refuses_dense_weight_dtype_it_cannot_apply(reference_models):
    """Quantised dense layers are made when patching; passed to the backend, the option was accepted and the model ran
    exact under a lossy label. It is refused, and the model left as it was."""
    import copy

    stock = copy.deepcopy(reference_models["mixtral"])
    compiled = torch.compile(stock, backend="hybrid_moe", options={"dense_weight_dtype": "int8"})
    with pytest.raises(Exception, match=r"patch_model\(model, dense_weight_dtype=...\), then compile it"):
        with torch.no_grad():
            compiled(torch.randint(3, 96, (1, 3)))
    assert thm.stats(stock) == {}  # no expert store was made


def test_backend_refuses_what_a_graph_of_some_layers_cannot_apply(reference_models):
    """A byte budget is the model's MoE layers' together: compiled layer by layer, each layer took all of it (4x the
    budget on a GPU). An approximate mode reaches into the next MoE layer: compiled layer by layer, nothing was
    deferred and no one was told. Both refused, with no store made."""
    import copy

    x = torch.randint(3, 96, (1, 3))
    for options, said in (
        ({"expert_budget": "4KiB"}, "is a byte budget for all the model's MoE layers"),
        ({"mode": "expert_deferral", "deferred_experts": 1}, "this compiled graph holds one"),
    ):
        stock = copy.deepcopy(reference_models["qwen3_moe"])
        for layer in stock.model.layers:
            layer.compile(backend="hybrid_moe", options=options)  # regional compilation, as transformers suggests
        with pytest.raises(Exception, match=said), torch.no_grad():
            stock(x)
        assert thm.stats(stock) == {}


def test_backend_options_on_a_patched_model_say_they_do_nothing(reference_models):
    model = patched_copy(reference_models["mixtral"], expert_budget=0.25)
    compiled = torch.compile(model, backend="hybrid_moe", fullgraph=True, options={"expert_budget": 1.0})
    with pytest.warns(UserWarning, match=r"options \['expert_budget'\] configure stock models"), torch.no_grad():
        compiled(torch.randint(3, 96, (1, 3)))


def _perturbed(model, seed):
    """A copy of `model` with other weights: a second model of the same architecture."""
    import copy

    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return other


@pytest.mark.slow
def test_each_stock_model_computes_with_its_own_experts(reference_models):
    """Dynamo reuses one compiled graph for two models of one architecture: each must still run its own
    experts, keep its own counters, and outlive the model compiled first."""
    import gc

    first, second = (_perturbed(reference_models["mixtral"], seed) for seed in (1, 2))
    x = torch.randint(3, 96, (1, 5))
    with torch.no_grad():
        want = [m(x).logits for m in (first, second)]
        got_first = torch.compile(first, backend="hybrid_moe", fullgraph=True)(x).logits
        compiled_second = torch.compile(second, backend="hybrid_moe", fullgraph=True)
        got_second = compiled_second(x).logits
        torch.testing.assert_close(got_first, want[0])
        torch.testing.assert_close(got_second, want[1])
        assert all(s.steps == 1 for s in thm.stats(second).values()) and len(thm.stats(second)) == 3
        del first
        gc.collect()
        torch.testing.assert_close(compiled_second(x).logits, want[1])


def _flagged_experts_block(hidden: int, inter: int, **flags: bool) -> torch.nn.Module:
    """One MoE block whose experts class transformers' decorator builds with `flags`, weights laid out to match."""
    from types import SimpleNamespace

    from transformers.activations import ACT2FN
    from transformers.integrations.moe import use_experts_implementation

    transposed = flags.get("is_transposed", False)

    @use_experts_implementation(**flags)
    class Experts(torch.nn.Module):
        def __init__(self, config: object) -> None:
            super().__init__()
            self.num_experts = 8
            shapes = (
                ((8, hidden, 2 * inter), (8, inter, hidden))
                if transposed
                else ((8, 2 * inter, hidden), (8, hidden, inter))
            )
            self.gate_up_proj, self.down_proj = (torch.nn.Parameter(torch.randn(s) / s[-2] ** 0.5) for s in shapes)
            self.act_fn = ACT2FN["silu"]
            self.post_expert_norm = torch.nn.RMSNorm(hidden, elementwise_affine=False)  # no weight: no graph input

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = torch.nn.Linear(hidden, 8, bias=False)
            self.experts = Experts(SimpleNamespace(_experts_implementation="grouped_mm"))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            weights, ids = self.gate(x).softmax(-1).topk(2, -1)
            return x + self.experts(x, ids, weights)

    torch.manual_seed(0)
    return Block()


@pytest.mark.parametrize(
    "flags, said",
    [
        ({"has_post_expert_norm": True}, "is built with has_post_expert_norm=True"),  # dropped silently: 0.54 off
        ({"is_transposed": True}, "is built with is_transposed=True"),  # H = 2I: shapes alone passed, then it failed
    ],
)
def test_experts_built_with_other_layouts_are_left_as_they_are(flags, said, caplog):
    import inspect

    from transformers.integrations.moe import use_experts_implementation

    if not set(flags) <= set(inspect.signature(use_experts_implementation).parameters):
        pytest.skip(f"this transformers has no {', '.join(flags)}")
    net = _flagged_experts_block(32, 16, **flags).eval()
    x = torch.randn(6, 32)
    with torch.no_grad():
        want = net(x)
        got = torch.compile(net, backend="hybrid_moe", fullgraph=True)(x)
    torch.testing.assert_close(got, want)
    assert said in caplog.text


def test_float64_experts_are_left_as_they_are(reference_models, caplog):
    """dispatch computes fp32 / bf16 / fp16 experts; a float64 model was rewritten, then failed in the kernel."""
    import copy

    model = copy.deepcopy(reference_models["qwen3_moe"]).double()
    model.config._experts_implementation = "batched_mm"  # grouped_mm takes no float64
    _left_as_they_are(model, caplog, "its experts are torch.float64 / torch.float64")


def test_experts_in_transformers_eager_loop_are_left_as_they_are_with_a_word(reference_models, caplog):
    """The eager experts loop breaks Dynamo's graph, so no graph holds the experts module: they ran as they were
    without a word. The backend names them and says what puts them in the graph."""
    import copy

    model = copy.deepcopy(reference_models["mixtral"])
    model.set_experts_implementation("eager")
    x = torch.randint(3, 96, (1, 5))
    with torch.no_grad():
        want = model(x).logits
        got = torch.compile(model, backend="hybrid_moe")(x).logits
    torch.testing.assert_close(got, want)
    assert "left MixtralExperts as it is: its experts run transformers' eager per-expert loop" in caplog.text
    assert "set_experts_implementation('grouped_mm')" in caplog.text


def _left_as_they_are(model: torch.nn.Module, caplog: pytest.LogCaptureFixture, said: str) -> None:
    """The backend leaves the experts in the graph, saying why, and the compiled model computes what the eager one
    does."""
    x = torch.randint(3, 96, (1, 5))
    with torch.no_grad():
        want = model(x).logits
        got = torch.compile(model, backend="hybrid_moe", fullgraph=True)(x).logits
    torch.testing.assert_close(got, want)
    assert said in caplog.text


@pytest.mark.slow
def test_experts_with_their_own_gate_are_left_as_they_are(reference_models, caplog):
    """Experts whose class gates its own way (a clamped SwiGLU, as transformers' HY-V4, GLM-5 Next, Step-3.7 and
    DeepSeek-V4 experts do) compute something `dispatch` does not: their region is left in the graph, with a
    warning, and the compiled model computes what the eager one does."""
    import copy

    model = copy.deepcopy(reference_models["mixtral"])
    stock = type(model.model.layers[0].mlp.experts)

    class Clamped(stock):
        def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
            gate, up = gate_up.chunk(2, dim=-1)
            return self.act_fn(gate.clamp(max=0.01)) * up.clamp(-0.01, 0.01)

    for layer in model.model.layers:
        layer.mlp.experts.__class__ = Clamped
    _left_as_they_are(model, caplog, "Clamped gates its experts its own way")


@pytest.mark.slow
def test_compiled_stock_model_follows_weight_changes_and_new_options(reference_models):
    model = _perturbed(reference_models["mixtral"], 3)
    x = torch.randint(3, 96, (1, 5))
    with torch.no_grad():
        compiled = torch.compile(model, backend="hybrid_moe", fullgraph=True)
        compiled(x)
        # load_state_dict copies into the parameters in place
        model.load_state_dict(_perturbed(model, 4).state_dict())
        torch.testing.assert_close(compiled(x).logits, model(x).logits)
        # an in-place edit of one expert's weights
        model.model.layers[1].mlp.experts.down_proj[0].mul_(3.0)
        torch.testing.assert_close(compiled(x).logits, model(x).logits)
        # new memory under a parameter (no version bump): `.data = t`, as module.to() and weight loaders do
        experts = model.model.layers[0].mlp.experts
        experts.gate_up_proj.data = 2.0 * experts.gate_up_proj.data
        torch.testing.assert_close(compiled(x).logits, model(x).logits)
        # compiling again with other options: they take effect (all experts in slots, none on the CPU)
        recompiled = torch.compile(model, backend="hybrid_moe", fullgraph=True, options={"expert_budget": 1.0})
        thm.reset_stats(model)
        torch.testing.assert_close(recompiled(x).logits, model(x).logits)
        assert all(s.cpu_experts == 0 and s.accelerator_experts > 0 for s in thm.stats(model).values())
        # and the first compile still runs with its own (budget 0.25: some experts on the CPU)
        thm.reset_stats(model)
        torch.testing.assert_close(compiled(x).logits, model(x).logits)
        assert any(s.cpu_experts > 0 for s in thm.stats(model).values())
