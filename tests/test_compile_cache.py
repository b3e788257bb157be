"""The backend's graphs reach AOTAutograd's disk cache: the nodes its passes insert carry the `example_value` Dynamo's
own nodes carry (graph_utils.fill_example_values), so a second process reuses the compiled decode step instead of
tracing it again, and decodes what the step compiled afresh decodes; Dynamo's own nodes are never run to fill them."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from torch_hybrid_moe.compile_passes.graph_utils import fill_example_values

from .test_complex_products import captured


def test_inserted_nodes_get_the_values_their_ops_give():
    """A slice and a method call on it, as a pass inserts them, get fake values of the real results' shape, strides
    and dtype; a node reading one that has no value, one whose op fails on fake tensors and one whose result is no
    tensor stay without."""
    x = torch.randn(3, 8)
    gm, _ = captured(lambda t: (t * 2).float(), x)
    original = set(gm.graph.nodes)
    (product,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    with gm.graph.inserting_after(product):
        columns = gm.graph.call_function(torch.ops.aten.slice.Tensor, (product, -1, 2, 6))
    with gm.graph.inserting_after(columns):
        rows = gm.graph.call_method("reshape", (columns, 2, 6))
    gm.register_buffer("extra", torch.ones(1))
    with gm.graph.inserting_after(rows):
        extra = gm.graph.get_attr("extra")  # an input inserted without a value
    with gm.graph.inserting_after(extra):
        orphan = gm.graph.call_function(torch.add, (rows, extra))
    with gm.graph.inserting_after(orphan):
        bad = gm.graph.call_method("reshape", (columns, 5, 5))  # 12 values cannot be 5 x 5
    with gm.graph.inserting_after(bad):
        size = gm.graph.call_method("size", (columns,))  # no tensor: nothing a method call could need
    assert fill_example_values(gm, original) == 2
    want_columns = (x * 2)[:, 2:6]
    for node, want in ((columns, want_columns), (rows, want_columns.reshape(2, 6))):
        got = node.meta["example_value"]
        assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
    assert all("example_value" not in n.meta for n in (orphan, bad, size))


def test_the_graphs_own_global_state_switches_are_not_run_while_compiling():
    """A graph that turns grad mode off part-way (Dynamo's `_set_grad_enabled` node, which has no value) gives what
    eager gives: the first output still carries a gradient and grad mode is off afterwards. Filling values by running
    Dynamo's own nodes switched grad mode off while the backend compiled, losing both."""

    def f(x):
        y = x * 2
        torch.set_grad_enabled(False)
        return y, y + 1

    results = []
    for backend in ("eager", "hybrid_moe"):
        torch._dynamo.reset()
        with torch.enable_grad():
            y, z = torch.compile(f, backend=backend, fullgraph=True)(torch.randn(3, requires_grad=True))
            results.append((y.requires_grad, z.requires_grad, torch.is_grad_enabled()))
    assert results[1] == results[0] == (True, False, False)


DECODE = textwrap.dedent("""
    import json, sys, torch
    import torch_hybrid_moe as thm
    from torch._dynamo.utils import counters
    from torch_hybrid_moe import generation
    from torch_hybrid_moe.tiny_models import random_model, tiny_config

    config = tiny_config("deepseek_v2")
    config.kv_lora_rank = config.moe_intermediate_size = 32  # the dense int8 mode's groups need 32 columns
    model = thm.patch_model(random_model(config, seed=int(sys.argv[1])), expert_budget=0.0,
                            dense_weight_dtype="int8", dense_weight_group_size=32)
    prompt = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    tokens = thm.greedy_generate(model, prompt, 6)[0, 6:].tolist()
    aot, uncached = dict(counters["aot_autograd"]), None
    if sys.argv[2] == "check":  # the step compiled afresh, past both caches
        torch._functorch.config.enable_autograd_cache = torch._inductor.config.fx_graph_cache = False
        torch._dynamo.reset()
        generation._compiled_step.cache_clear()
        uncached = thm.greedy_generate(model, prompt, 6)[0, 6:].tolist()
    print(json.dumps(dict(tokens=tokens, uncached=uncached, aot=aot)))
""")


@pytest.mark.slow
def test_a_second_process_reuses_the_compiled_decode_step(tmp_path):
    """DeepSeek-V2 in dense int8 mode, whose decode step holds nodes two passes insert (the merged sibling matvecs'
    slices, the rotary products in real arithmetic): the first process compiles and stores it (no bypass of the
    cache); the second, on a model of other weights, loads it and decodes the tokens its step compiled afresh
    decodes (a cached step with the first model's weights baked in would not)."""
    caches = ("TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE", "TORCHINDUCTOR_FORCE_DISABLE_CACHES")
    env = {k: v for k, v in os.environ.items() if k not in caches}  # a caller's cache settings would override ours
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path)
    runs = []
    for seed, check in ((0, "-"), (1, "check")):
        done = subprocess.run(
            [sys.executable, "-c", DECODE, str(seed), check], capture_output=True, text=True, env=env, timeout=900
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = (r["aot"] for r in runs)
    assert first.get("autograd_cache_bypass", 0) == 0 and first.get("autograd_cache_saved", 0) >= 1, first
    assert second.get("autograd_cache_hit", 0) >= 1 and second.get("autograd_cache_miss", 0) == 0, second
    assert runs[1]["tokens"] == runs[1]["uncached"]
    assert runs[0]["tokens"] != runs[1]["tokens"]  # two models: the comparison above could tell them apart
