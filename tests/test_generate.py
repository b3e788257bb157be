"""generate() runs its decode step through the hybrid_moe backend, as one graph, without per-token recompiles."""

import copy

import pytest
import torch
from transformers import CompileConfig

import torch_hybrid_moe as thm
from torch_hybrid_moe.tiny_models import TINY_ARCHITECTURES

from .conftest import DeepcopySafeCounter, patched_copy


def prompts(batch=2, length=6):
    return torch.randint(3, 96, (batch, length), generator=torch.Generator().manual_seed(batch * length))


@pytest.mark.slow
@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_plain_generate_after_patch_gives_reference_tokens(reference_models, arch):
    ref = reference_models[arch]
    x = prompts()
    want = ref.generate(x, max_new_tokens=10, do_sample=False)
    model = patched_copy(ref, expert_budget=0.25)
    got = model.generate(x, max_new_tokens=10, do_sample=False)
    assert torch.equal(got, want)
    # The decode step really was compiled, with our backend, over a static cache.
    assert model.generation_config.compile_config.backend == "hybrid_moe"
    assert model.generation_config.cache_implementation == "static"
    assert hasattr(model, "_compiled_call")
    assert all(s.steps >= 10 for s in thm.stats(model).values())


def test_the_decode_step_takes_the_cpp_wrapper_on_the_cpu_only():
    """generate()'s decode step compiles with Inductor's C++ wrapper on the CPU (its Python wrapper costs time every
    step) and with the default mode elsewhere (a CUDA step replays as one CUDA graph); torch.compile takes a mode
    or options, never both."""
    from torch_hybrid_moe.compile_passes.backend import CPU_DECODE_OPTIONS
    from torch_hybrid_moe.model_patches.base import _compile_decode_with_backend
    from torch_hybrid_moe.tiny_models import tiny_model

    for on_cpu, want in ((True, (None, CPU_DECODE_OPTIONS)), (False, ("default", None))):
        model = tiny_model("qwen3_moe")
        _compile_decode_with_backend(model, False, on_cpu)
        config = model.generation_config.compile_config
        assert (config.backend, config.mode, config.options) == ("hybrid_moe", *want)


def _counting_config(counter):
    config = CompileConfig(backend=counter, fullgraph=True, mode="default")
    config._compile_all_devices = True
    return config


@pytest.mark.slow
def test_decode_is_one_graph_and_never_recompiles_per_token(reference_models):
    ref = reference_models["deepseek_v3"]
    model = patched_copy(ref, expert_budget=0.25)
    counter = DeepcopySafeCounter()
    x = prompts(batch=1)
    want = ref.generate(x, max_new_tokens=24, do_sample=False)
    got = model.generate(x, max_new_tokens=24, do_sample=False, compile_config=_counting_config(counter))
    assert torch.equal(got, want)
    assert counter.frame_count == 1  # 23 decode steps, one graph
    other = prompts(batch=1) + 1
    again = model.generate(other, max_new_tokens=24, do_sample=False, compile_config=_counting_config(counter))
    assert torch.equal(again, ref.generate(other, max_new_tokens=24, do_sample=False))
    assert counter.frame_count == 1  # a second request with a fresh static cache of the same size reuses it


def test_stock_model_generate_through_backend(reference_models):
    ref = reference_models["qwen2_moe"]
    stock = copy.deepcopy(ref)
    counter = DeepcopySafeCounter()
    x = prompts()
    want = ref.generate(x, max_new_tokens=8, do_sample=False)
    got = stock.generate(
        x, max_new_tokens=8, do_sample=False, cache_implementation="static", compile_config=_counting_config(counter)
    )
    assert torch.equal(got, want)
    assert counter.frame_count == 1
    assert all(s.steps == 7 for s in thm.stats(stock).values())  # the 7 decode steps went through dispatch


@pytest.mark.slow
def test_issue_snippet_patch_compile_generate(reference_models):
    """The README's flow verbatim: patch, torch.compile with the backend, generate with a static cache."""
    ref = reference_models["mixtral"]
    x = prompts()
    want = ref.generate(x, max_new_tokens=8, do_sample=False)
    model = thm.patch_model(copy.deepcopy(ref), thm.HybridMoEConfig(expert_budget=0.25))
    model = torch.compile(model, backend="hybrid_moe")
    got = model.generate(x, max_new_tokens=8, do_sample=False, cache_implementation="static")
    assert torch.equal(got, want)
    assert hasattr(model._orig_mod, "_compiled_call")  # generate's decode step went through the backend


@pytest.mark.slow
def test_a_budget_sweep_of_10_patched_models_in_one_process(reference_models):
    """A notebook sweep: patch, generate, drop; 10 times (past Dynamo's recompile limit of 8), each budget with each
    CPU format. Every model gives the reference tokens, compiled graphs are reused, and freed models' layers do not
    pile up."""
    import gc

    from torch._dynamo.utils import counters

    from torch_hybrid_moe.runtime import registry

    ref = reference_models["mixtral"]
    x = prompts(batch=1)
    want = ref.generate(x, max_new_tokens=4, do_sample=False)
    budgets = [0.0, 0.25, 0.5, 1.0, "2KiB"]
    gc.collect()
    graphs_before, layers_before = counters["stats"]["unique_graphs"], len(registry._layers)
    live = []
    for i in range(10):
        model = patched_copy(
            ref, expert_budget=budgets[i % len(budgets)], cpu_weight_dtype=["model", "bfloat16"][i % 2]
        )
        got = model.generate(x, max_new_tokens=4, do_sample=False)
        if i % 2 == 0:  # fp32 experts are exact; bf16 host copies round the experts
            assert torch.equal(got, want), i
        live.append(len(registry._layers) - layers_before)
    # the live model's handles and the previous one's, alternating
    assert counters["stats"]["unique_graphs"] - graphs_before <= 2
    assert max(live) <= 2 * 3  # layers of at most two models (3 MoE layers each) alive at once
    del model
    gc.collect()
    assert len(registry._layers) == layers_before
