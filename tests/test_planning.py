"""`hybrid-moe plan`: the shapes it reads from a config against the real model's tensors (parameters counted, a KV
cache filled), its memory arithmetic by hand, and every door with bad input."""

import inspect
import re
from dataclasses import replace

import pytest
import torch
from transformers import DynamicCache

from torch_hybrid_moe import planning
from torch_hybrid_moe.cli import main
from torch_hybrid_moe.cost_model import BANDWIDTH_EFFICIENCY, HARDWARE, CostModel
from torch_hybrid_moe.tiny_models import TINY_ARCHITECTURES, tiny_model

from .test_cli_errors import one_line_error


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_summary_matches_the_built_model(arch):
    """Weights split as the real model holds them, and KV bytes as a cache filled by a forward pass holds them."""
    model = tiny_model(arch)  # in its config's dtype, which the plan reads
    s = planning.summarise(model.config)
    experts = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
    expert_weights = sum(m.gate_up_proj.numel() + m.down_proj.numel() for m in experts)
    assert (s.expert_weights, s.moe_layers) == (expert_weights, len(experts))
    assert s.expert_weights + s.dense_weights == sum(p.numel() for p in model.parameters())
    assert s.expert_weights == s.moe_layers * s.num_experts * s.expert_weights_each
    lookup, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert s.lookup_weights == (0 if lookup.data_ptr() == head.data_ptr() else lookup.numel())
    cache, tokens = DynamicCache(config=model.config), 7
    with torch.no_grad():
        # transformers 5.17 (the GPU box's) calls it `past_key_values` and ignores `cache`
        name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
        model(torch.randint(3, 90, (1, tokens)), **{name: cache}, use_cache=True)
    held = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))
    assert held == s.kv_bytes_per_token * tokens


def _summary(**overrides):
    base = dict(
        model_type="qwen3_moe",
        layers=4,
        moe_layers=4,
        num_experts=8,
        top_k=2,
        hidden=64,
        inter=32,
        expert_weights=4 * 8 * 3 * 64 * 32,
        dense_weights=100_000,
        lookup_weights=20_000,
        model_bytes=2,
        kv_bytes_per_token=1024,
    )
    return planning.ModelSummary(**{**base, **overrides})


def test_budget_and_host_memory_by_hand():
    s = _summary()
    costs_for = lambda shape: CostModel(HARDWARE["rtx4090"], shape)  # noqa: E731
    slots, ring = s.expert_weights * 2, 2 * s.expert_weights_each * 2
    gpu = 200_000 + 1024 * 10 + 1000 + ring + slots // 2  # dense, KV of 10 tokens, reserve, ring, half the experts
    dense, kv, plans = planning.plan(s, gpu, 10**9, 10, costs_for, reserve_bytes=1000, prompt=32)
    assert (dense, kv) == (200_000, 10_240)
    assert all(p.expert_budget == pytest.approx(0.5, abs=1e-4) for p in plans)
    by_fmt = {p.fmt: p for p in plans}
    assert by_fmt["bfloat16"].host_bytes == s.expert_weights * 2
    # gate and up (two thirds of the weights, 64 columns) in groups of 64; down (32 columns) in groups of 32
    assert by_fmt["int8"].host_bytes == int(s.expert_weights * (2 * (1 + 2 / 64) + (1 + 2 / 32)) / 3)
    assert by_fmt["int4"].host_bytes == int(s.expert_weights * (2 * (0.5 + 2 / 64) + (0.5 + 2 / 32)) / 3)
    assert all(p.speeds and all(d > 0 and f > 0 for d, f in p.speeds.values()) for p in plans)
    # int4 reads fewer bytes than bf16 on every stack, so it decodes faster on each
    assert all(by_fmt["int4"].speeds[k][0] > by_fmt["bfloat16"].speeds[k][0] for k in by_fmt["int4"].speeds)

    _, _, tight = planning.plan(s, 0, by_fmt["int4"].host_bytes + dense + kv, 10, costs_for, prompt=32)
    fits = {p.fmt: p.fits_host for p in tight}  # no GPU: the dense weights and the KV cache live in host memory too
    assert fits == {"bfloat16": False, "int8": False, "int4": True}
    assert [p.host_bytes for p in tight] == [by_fmt[p.fmt].host_bytes + dense + kv for p in tight]
    assert all(p.expert_budget == 0 for p in tight)
    assert set(next(p for p in tight if p.fits_host).speeds) == {"ktransformers"}  # no slots: all-CPU stacks only


def test_budget_is_whole_slots_and_a_gpu_too_small_gets_no_speeds():
    """The budget is what the runtime gives: floor(budget x experts) slots a layer (a fraction of one slot is none),
    and a GPU that cannot hold the dense weights, KV cache, reserve and staging ring runs nothing: every format says
    why and none gets speeds."""
    s = _summary()
    costs_for = lambda shape: CostModel(HARDWARE["rtx4090"], shape)  # noqa: E731
    ring, slot = 2 * s.expert_weights_each * 2, s.expert_weights * 2 // 8  # one slot in every layer
    fixed = 200_000 + 1024 * 10 + 1000 + ring
    for room, slots in ((slot - 1, 0), (slot, 1), (3 * slot + slot // 2, 3)):
        _, _, plans = planning.plan(s, fixed + room, 10**9, 10, costs_for, reserve_bytes=1000, prompt=32)
        assert all(p.expert_budget == slots / 8 and not p.refused and p.speeds for p in plans)
    _, _, plans = planning.plan(s, fixed - 1, 10**9, 10, costs_for, reserve_bytes=1000, prompt=32)
    assert all(p.refused.startswith("the GPU's") and not p.speeds for p in plans)


def test_the_stacks_learn_from_other_routing_than_they_are_priced_on(monkeypatch):
    """`plan` priced Fiddler's pinned experts and MoE-Infinity's past requests learnt from the very sequence replayed
    (Fiddler 1.4x faster than calibrated on another): they now learn from a second sequence of the same routing
    statistics and experts' popularity."""
    from torch_hybrid_moe.simulator.calibration import Calibration

    seen = []

    def replay(trace, stack, costs, batch, ratio, calibration=None):
        seen.append((trace, calibration))
        return run(trace, stack, costs, batch, ratio, calibration)

    run = planning.simulate_runnable
    monkeypatch.setattr(planning, "simulate_runnable", replay)
    s = _summary()
    planning.plan(s, 10**12, 10**12, 10, lambda shape: CostModel(HARDWARE["rtx4090"], shape), prompt=16)
    assert seen
    for trace, calibration in seen:
        assert calibration is not None and len(set(trace.sequence.tolist())) == len(calibration.requests) == 1
        own = Calibration.learn(trace, {})
        assert not torch.equal(calibration.requests[0], own.requests[0]) and calibration.popularity != own.popularity


def test_dense_only_layers_are_priced():
    """A token reads every layer's dense weights, dense-only layers too: a model with one dense-only layer besides
    the same MoE layers and dense weights per layer costs its extra layer's bytes (they were spread over all layers
    and then counted for the MoE layers only)."""
    h = HARDWARE["rtx4090"]
    costs_for = lambda shape: CostModel(h, shape)  # noqa: E731
    per_layer = 1_000_000
    moe_only = cpu_only_seconds(costs_for, dense_weights=4 * per_layer + 20_000)
    one_more = cpu_only_seconds(costs_for, layers=5, dense_weights=5 * per_layer + 20_000)
    by_hand = per_layer * 2 / (h.cpu_bandwidth_gb_s * 1e9 * BANDWIDTH_EFFICIENCY)
    assert all(one_more[fmt] - moe_only[fmt] == pytest.approx(by_hand, rel=1e-6) for fmt in moe_only)


def cpu_only_seconds(costs_for, **weights: int) -> dict[str, float]:
    """Seconds a decode token of the all-CPU stack, per host format, of a plan without a GPU."""
    _, _, plans = planning.plan(_summary(**weights), 0, 10**12, 10, costs_for, prompt=32)
    return {p.fmt: 1 / p.speeds["ktransformers"][0] for p in plans}


def test_a_cpu_only_plan_reads_the_dense_layers_on_the_cpu_at_the_models_bytes():
    """Without a GPU a token's dense work runs on the CPU between its experts: 4 M more dense weights add their bf16
    bytes at the CPU's rate to every token, whatever the experts' format (the GPU's rate, or the experts' int4
    bytes, would add far less); the input embedding, of which a token reads one row, adds nothing."""
    h = HARDWARE["rtx4090"]
    costs_for = lambda shape: CostModel(h, shape)  # noqa: E731

    few, many = (cpu_only_seconds(costs_for, dense_weights=n) for n in (1_000_000, 5_000_000))
    by_hand = 4_000_000 * 2 / (h.cpu_bandwidth_gb_s * 1e9 * BANDWIDTH_EFFICIENCY)
    assert all(many[fmt] - few[fmt] == pytest.approx(by_hand, rel=1e-6) for fmt in few)
    embedding = cpu_only_seconds(costs_for, dense_weights=5_000_000, lookup_weights=4_020_000)
    assert embedding == pytest.approx(few, rel=1e-9)


def test_a_cpu_only_plan_reads_the_dense_layers_at_the_model_dtypes_rate_whatever_the_experts_rate():
    """A measured profile fits each format's experts (int4's carries its arithmetic): the dense layers, in the
    model's dtype, take the rate measured for that dtype, so more dense weights add the same time to every
    format's token (at int4's fitted rate, int4 plans came out slower than bf16 ones)."""
    fast = HARDWARE["rtx4090"]
    slow = replace(fast, cpu_bandwidth_gb_s=fast.cpu_bandwidth_gb_s / 4)
    costs_for = lambda shape: CostModel(fast if shape.bytes_per_weight == 2 else slow, shape)  # noqa: E731

    few, many = (cpu_only_seconds(costs_for, dense_weights=n) for n in (1_000_000, 5_000_000))
    by_hand = 4_000_000 * 2 / (fast.cpu_bandwidth_gb_s * 1e9 * BANDWIDTH_EFFICIENCY)
    assert all(many[fmt] - few[fmt] == pytest.approx(by_hand, rel=1e-6) for fmt in few)


def test_with_every_expert_in_a_slot_the_host_format_does_not_change_decode():
    """Slots hold experts dequantised to the model's dtype: with room for all of them the GPU reads bf16 weights
    whatever the host copy's format, so bf16, int8 and int4 plans decode alike (pricing the slots' reads at the
    host copy's bytes made int4 look faster)."""
    s = _summary()
    costs_for = lambda shape: CostModel(HARDWARE["rtx4090"], shape)  # noqa: E731
    _, _, plans = planning.plan(s, 10**12, 10**12, 10, costs_for, prompt=32)
    assert all(p.expert_budget == 1.0 for p in plans)
    decode = {p.fmt: p.speeds["lru-cache"][0] for p in plans}
    assert decode["int4"] == pytest.approx(decode["bfloat16"], rel=1e-9)
    assert decode["int8"] == pytest.approx(decode["bfloat16"], rel=1e-9)


def test_plan_command_prints_the_answer(tmp_path, capsys):
    tiny_model("deepseek_v2").config.save_pretrained(tmp_path)  # a config alone: plan reads no weights
    assert main(["plan", "--model", str(tmp_path), "--gpu-memory", "2GiB", "--host-memory", "8GiB"]) == 0
    out = capsys.readouterr().out
    assert "deepseek_v2" in out and "expert_budget=" in out and out.count("(fits)") == 1  # bf16
    # the tiny model's 16-wide experts cannot be quantised in groups of 32, as patching would say
    assert out.count("not possible: cannot quantise 16 columns") == 2
    assert "ktransformers" in out and "lru-cache" in out
    # sizes in the unit they fill: the tiny model's host memory printed 0.0 GiB
    units = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}
    sizes = re.findall(r"host memory ([\d.]+) (GiB|MiB|KiB|B) ", out)
    assert sizes and all(1 <= float(v) < 1024 for v, _ in sizes), out
    bf16 = float(sizes[0][0]) * units[sizes[0][1]]
    summary = planning.summarise(planning.load_config(str(tmp_path)))
    assert bf16 == pytest.approx(2 * summary.expert_weights, rel=0.01)  # the bf16 experts; dense layers on the GPU
    assert "GPU 2.00 GiB: " in out


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--gpu-memory", "24"], "not a size with a unit"),
        (["--host-memory", "lots"], "not a size with a unit"),
        (["--hardware", "h100-dream"], "invalid choice"),
        (["--context", "0"], "--context"),
    ],
)
def test_plan_refuses_bad_options(argv, match, tmp_path, capsys):
    tiny_model("mixtral").config.save_pretrained(tmp_path)
    one_line_error(capsys, ["plan", "--model", str(tmp_path), *argv], match)


def test_plan_refuses_bad_models(tmp_path, capsys, monkeypatch):
    one_line_error(capsys, ["plan", "--model", str(tmp_path)], "no config.json")
    tiny_model("mixtral").config.save_pretrained(tmp_path)
    text = (tmp_path / "config.json").read_text().replace('"mixtral"', '"llama"')
    (tmp_path / "config.json").write_text(text.replace('"MixtralForCausalLM"', '"LlamaForCausalLM"'))
    one_line_error(capsys, ["plan", "--model", str(tmp_path)], "model type 'llama' is not supported")
    (tmp_path / "config.json").write_text('{"model_type": "nonsense"}')
    one_line_error(capsys, ["plan", "--model", str(tmp_path)], "config.json is not a usable transformers config")
    (tmp_path / "config.json").write_text("{not json")
    one_line_error(capsys, ["plan", "--model", str(tmp_path)], "config.json is not a usable transformers config")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    one_line_error(
        capsys, ["plan", "--model", "nobody/no-such-model"], "cannot fetch 'nobody/no-such-model' from the hub"
    )


def test_plan_takes_a_top_k_above_half_the_experts_and_refuses_a_config_without_experts(tmp_path, capsys):
    """Mixtral with 4 experts, top-3: planned (its synthetic routing lists every expert); a Qwen3-MoE config whose
    layers are all dense: one line saying there is nothing to offload."""
    config = tiny_model("mixtral").config
    config.num_local_experts, config.num_experts_per_tok = 4, 3
    config.save_pretrained(tmp_path / "top3")
    assert main(["plan", "--model", str(tmp_path / "top3"), "--gpu-memory", "2GiB", "--host-memory", "8GiB"]) == 0
    assert "top-3" in capsys.readouterr().out
    dense = tiny_model("qwen3_moe").config
    dense.mlp_only_layers = list(range(dense.num_hidden_layers))
    dense.save_pretrained(tmp_path / "dense")
    one_line_error(capsys, ["plan", "--model", str(tmp_path / "dense")], "has no MoE layers")
    none = tiny_model("mixtral").config
    none.num_local_experts = 0  # a ZeroDivisionError's traceback before
    none.save_pretrained(tmp_path / "none")
    one_line_error(capsys, ["plan", "--model", str(tmp_path / "none")], "routes 2 of 0 experts a token")
