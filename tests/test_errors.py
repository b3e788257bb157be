"""Bad input gets a clear error and leaves the model exactly as it was."""

import copy
import re

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import torch_hybrid_moe as thm
from torch_hybrid_moe.config import OURS_WINDOW
from torch_hybrid_moe.errors import InputError
from torch_hybrid_moe.model_patches import is_patched, patch_mixtral
from torch_hybrid_moe.tiny_models import tiny_model

from .conftest import stack_file


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_untouched(model, before):
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert not is_patched(model)
    assert all(not hasattr(m, "_hybrid_moe_layer") for m in model.modules())
    assert model.config._experts_implementation != "hybrid_moe"


def test_unsupported_model_type_lists_supported():
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    with pytest.raises(
        ValueError,
        match=r"unsupported model type 'llama'; supported: deepseek_v2, deepseek_v3, "
        r"mixtral, qwen2_moe, qwen3_moe",
    ):
        thm.patch_model(model)


@pytest.mark.parametrize("budget", [-0.1, 1.5, float("nan"), "lots", True, "0.5", 2, "12", [0.5]])
def test_budget_out_of_range(budget):
    model = tiny_model("mixtral")
    before = snapshot(model)
    with pytest.raises((ValueError, TypeError), match="expert_budget"):
        thm.patch_model(model, expert_budget=budget)
    assert_untouched(model, before)


def test_a_deepseek_group_count_that_does_not_divide_the_experts_names_n_group():
    from torch_hybrid_moe.tiny_models import random_model, tiny_config

    config = tiny_config("deepseek_v2")
    config.topk_method, config.n_group, config.topk_group = "group_limited_greedy", 3, 1
    assert config.n_routed_experts % 3
    with pytest.raises(ValueError, match="n_group = 3 groups: n_group must divide"):
        thm.patch_model(random_model(config), expert_budget=0.5)


def test_byte_budget_sets_slot_count():
    model = tiny_model("mixtral")
    experts = model.model.layers[0].mlp.experts
    per_expert = experts.gate_up_proj[0].nbytes + experts.down_proj[0].nbytes
    thm.patch_model(model, expert_budget=f"{per_expert * 3 * 2}B")  # 3 layers x 2 slots
    assert {layer.store.num_slots for layer in thm.runtime.model_layers(model).values()} == {2}


def test_patched_twice():
    model = thm.patch_model(tiny_model("mixtral"))
    with pytest.raises(RuntimeError, match="already patched"):
        thm.patch_model(model)


def test_unknown_policy_and_field():
    model = tiny_model("mixtral")
    before = snapshot(model)
    with pytest.raises(ValueError, match="unknown cache policy 'clairvoyant'; registered: .*lru"):
        thm.patch_model(model, cache_policy="clairvoyant")
    with pytest.raises(ValueError, match="simulator only"):  # registered, but needs the future routing
        thm.patch_model(model, cache_policy="belady")
    with pytest.raises(TypeError, match="unknown HybridMoEConfig field"):
        thm.patch_model(model, expert_budgt=0.5)
    assert_untouched(model, before)


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"window": 4}, ValueError, r"takes no option\(s\) \['window'\]; its options: decay, u_size, w_size"),
        ({"alpha": 0.3}, ValueError, r"takes no option\(s\) \['alpha'\]"),  # MRS's, not the window's
        ((("decay", 0.5), ("decay", 0.8)), ValueError, "names an option twice"),
        (7, TypeError, "must be a dict"),
        ({"decay": 1.5}, ValueError, "0 <= decay < 1"),  # a name it takes, a value it refuses: when patching
    ],
)
def test_bad_cache_options(options, error, match):
    model = tiny_model("mixtral")
    before = snapshot(model)
    with pytest.raises(error, match=match):
        thm.patch_model(model, cache_policy="dali_window", cache_options=options)
    assert_untouched(model, before)


@pytest.mark.parametrize("alpha", [0.0, 1.5, -1.0, float("nan")])
def test_mrs_refuses_an_alpha_outside_0_1(alpha):
    """0 scores nothing, above 1 or below 0 inverts the ranking, NaN ranks nothing: refused, nothing changed."""
    model = tiny_model("mixtral")
    before = snapshot(model)
    with pytest.raises(ValueError, match="mrs needs 0 < alpha <= 1"):
        thm.patch_model(model, cache_policy="mrs", cache_options={"alpha": alpha})
    assert_untouched(model, before)


def test_policy_sizes_below_one_are_refused():
    """MoE-Infinity's collection keeps `capacity` past requests (0 kept them all, -1 dropped the oldest); the
    oracle prefetcher's size (-1 dropped the lightest expert)."""
    from torch_hybrid_moe.policies import CACHE_POLICIES, PREFETCHERS, LayerInfo
    from torch_hybrid_moe.policies.requests import RequestActivations

    info = LayerInfo(0, 4, 2, 1)
    request = RequestActivations([0], 4)
    for capacity in (0, -1):
        with pytest.raises(ValueError, match="needs capacity >= 1"):
            CACHE_POLICIES.create("eam", info=info, request=request, capacity=capacity)
        with pytest.raises(ValueError, match="needs capacity >= 1"):
            PREFETCHERS.create("eam", info=info, request=request, capacity=capacity)
    with pytest.raises(ValueError, match="prefetch size must be at least 1"):
        PREFETCHERS.create("oracle", info=info, future=[[1, 1, 0, 0]], size=-1)


def test_cache_options_need_a_named_cache_policy():
    model = tiny_model("mixtral")
    before = snapshot(model)
    with pytest.raises(ValueError, match="need a named cache_policy"):  # "auto" picks the policy and its settings
        thm.patch_model(model, cache_options={"w_size": 8})
    assert_untouched(model, before)


@pytest.mark.parametrize(
    "fields, device, want",
    [
        ({}, "cuda", ("queue_aware", "dali_window", OURS_WINDOW, "local")),  # ours, costed by this machine's profile
        ({"cuda_graph": False}, "cuda", ("cached_on_accelerator", "lru", (), "")),  # ours measured captured only
        ({}, "cpu", ("cached_on_accelerator", "lru", (), "")),  # slots in host memory: the plain LRU stack
        ({"hardware": "rtx4090"}, "cuda", ("queue_aware", "dali_window", OURS_WINDOW, "rtx4090")),
        ({"scheduler": "queue_aware", "hardware": "dali"}, "cpu", ("queue_aware", "dali_window", OURS_WINDOW, "dali")),
        ({"scheduler": "dali_greedy", "hardware": "dali"}, "cuda", ("dali_greedy", "lru", (), "dali")),
        ({"cache_policy": "mrs"}, "cuda", ("queue_aware", "mrs", (), "local")),
        ({"cache_policy": "mrs"}, "cpu", ("cached_on_accelerator", "mrs", (), "")),
    ],
)
def test_auto_stack_is_ours_in_cuda_graphs_and_lru_elsewhere(fields, device, want):
    config = thm.HybridMoEConfig(**fields).for_device(torch.device(device))
    assert (config.scheduler, config.cache_policy, config.cache_options, config.hardware) == want
    assert config.for_device(torch.device(device)) is config  # concrete: nothing left to choose


def test_policies_are_built_from_a_concrete_stack_only():
    from torch_hybrid_moe.runtime.layer_policies import build_policies

    with pytest.raises(ValueError, match="for_device"):
        build_policies(thm.HybridMoEConfig(), {}, capture=False)


def test_stack_file_gives_its_stack_and_the_callers_other_fields(tmp_path):
    config = thm.HybridMoEConfig.from_stack_file(stack_file(tmp_path), expert_budget=0.5, device="cpu")
    assert (config.scheduler, config.cache_policy, dict(config.cache_options)) == (
        "queue_aware",
        "dali_window",
        {"w_size": 4, "u_size": 2, "decay": 0.5},
    )
    assert (config.expert_budget, config.device, config.hardware) == (0.5, "cpu", "local")  # costed by this machine
    assert config.for_device(torch.device("cuda")) is config  # named: no device choice left
    assert thm.HybridMoEConfig.from_stack_file(stack_file(tmp_path), hardware="dali").hardware == "dali"


@pytest.mark.parametrize(
    "edits, match",
    [
        ({"format": 2}, "not a stack file of format 1"),
        ({"cache_policy": None}, "missing ['cache_policy']"),
        ({"window": 3}, "unknown ['window']"),
        ({"cache_options": [["w_size", 4]]}, "cache_options must be an object"),
        ({"cache_policy": "belady2"}, "belady2"),
        ({"cache_options": {"w_size": 4, "alpha": 1}}, "alpha"),
        ({"scheduler": "fastest"}, "fastest"),
        ({"format": True}, "not a stack file of format 1"),
        ({"cache_options": {"w_size": 4, "u_size": 1, "decay": 1.0}}, "decay"),  # a value the policy refuses
        ({"cache_policy": "belady", "cache_options": {}}, "simulator only"),  # a policy the runtime cannot build
    ],
)
def test_stack_file_refuses_what_it_cannot_run(tmp_path, edits, match):
    path = stack_file(tmp_path, **edits)
    with pytest.raises(thm.errors.InputError, match=f"^stack file {re.escape(str(path))}: .*{re.escape(match)}"):
        thm.HybridMoEConfig.from_stack_file(path)


def test_stack_file_doors(tmp_path):
    missing = tmp_path / "none.json"
    with pytest.raises(thm.errors.InputError, match="cannot read it .*hybrid-moe simulate --save-ours"):
        thm.HybridMoEConfig.from_stack_file(missing)
    garbled = tmp_path / "garbled.json"
    garbled.write_text("{not json")
    with pytest.raises(thm.errors.InputError, match=f"^stack file {garbled}: cannot read it"):
        thm.HybridMoEConfig.from_stack_file(garbled)
    with pytest.raises(thm.errors.InputError, match="sets cache_policy, scheduler: leave them out"):
        thm.HybridMoEConfig.from_stack_file(stack_file(tmp_path), scheduler="lru", cache_policy="lru")
    with pytest.raises(ValueError, match="device must be"):  # the caller's own fields, before the file is read
        thm.HybridMoEConfig.from_stack_file(missing, device="tpu")
    for zero in (0.0, "0GiB"):  # no slots: the stack's placement and cache would do nothing
        with pytest.raises(thm.errors.InputError, match="gives none; give a budget above 0"):
            thm.HybridMoEConfig.from_stack_file(stack_file(tmp_path), expert_budget=zero)


def test_patched_layers_hold_the_stack_chosen_for_their_device():
    assert thm.HybridMoEConfig(device="cpu").for_device().scheduler == "cached_on_accelerator"  # its own device
    model = thm.patch_model(tiny_model("mixtral"), expert_budget=0.25, device="cpu")
    layers = thm.runtime.model_layers(model).values()
    assert layers and all(
        (layer.config.scheduler, type(layer.cache_policy).__name__) == ("cached_on_accelerator", "LRU")
        for layer in layers
    )


def test_cache_options_reach_the_layers_cache_policy():
    options = {"w_size": 8, "decay": 0.5}
    model = thm.patch_model(tiny_model("mixtral"), cache_policy="dali_window", cache_options=options)
    caches = [layer.cache_policy for layer in thm.runtime.model_layers(model).values()]
    assert caches and all((c.w_size, c.u_size, c.decay) == (8, 1, 0.5) for c in caches)  # u_size: its default


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(prefetch_size=2), "needs a prefetcher"),  # the default prefetcher, 'none', would ignore it
        (dict(prefetcher="gate", prefetch_size=-1), "non-negative int"),
        (dict(prefetcher="gate", prefetch_size=True), "non-negative int"),
        (dict(prefetcher="gate", prefetch_size=7), r"prefetch size must be in \[1, 6\]"),  # tiny mixtral: 6 experts
    ],
)
def test_bad_prefetch_size(overrides, match):
    model = tiny_model("mixtral")
    before = snapshot(model)
    with pytest.raises(ValueError, match=match):
        thm.patch_model(model, **overrides)
    assert_untouched(model, before)


def test_unsupported_dtype():
    model = tiny_model("qwen3_moe").double()
    before = snapshot(model)
    with pytest.raises(TypeError, match="dtype torch.float64; supported"):
        thm.patch_model(model)
    assert_untouched(model, before)


def test_shapes_disagree_with_config():
    model = tiny_model("deepseek_v3")
    experts = model.model.layers[2].mlp.experts
    experts.down_proj = torch.nn.Parameter(experts.down_proj[:, :, :-1].clone())
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"layer 2: experts.down_proj has shape \(8, 32, 15\) but the config implies"):
        thm.patch_model(model)
    assert_untouched(model, before)
    # and the valid layer 1 was not patched either (validation runs before any change)
    assert hasattr(model.model.layers[1].mlp.experts, "gate_up_proj")


def test_dense_layer_where_config_says_moe():
    model = tiny_model("qwen2_moe")
    model.config.mlp_only_layers = []
    before = snapshot(model)
    with pytest.raises(ValueError, match="layer 1 is a dense layer"):
        thm.patch_model(model)
    assert_untouched(model, before)


def test_wrong_architecture_patch_function():
    model = tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match="patch for 'mixtral' models called on a 'qwen3_moe' model"):
        patch_mixtral(model)


def test_cuda_device_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    model = tiny_model("mixtral")
    before = snapshot(model)
    with pytest.raises(InputError, match="no CUDA device"):
        thm.patch_model(model, device="cuda")
    assert_untouched(model, before)


@pytest.mark.parametrize("layer, name", [(0, "down_proj"), (2, "gate_up_proj")])
def test_experts_of_mixed_dtypes_are_refused_before_any_change(layer, name):
    model = tiny_model("mixtral")
    experts = model.model.layers[layer].mlp.experts
    setattr(experts, name, torch.nn.Parameter(getattr(experts, name).detach().to(torch.bfloat16)))
    before = snapshot(model)
    with pytest.raises(TypeError, match=f"layer {layer}: experts.{name} is torch.bfloat16 .* share one dtype"):
        thm.patch_model(model)
    assert_untouched(model, before)
    model.to(torch.bfloat16)  # what the message says to do
    thm.patch_model(model)
    assert is_patched(model)


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3", "qwen2_moe"])
def test_save_pretrained_of_a_patched_model_writes_its_experts(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    ref = tiny_model(arch)
    x = torch.randint(3, 96, (1, 5))
    thm.patch_model(copy.deepcopy(ref), expert_budget=0.5).save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    want, got = ref.state_dict(), back.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    with torch.no_grad():
        assert torch.equal(back(x).logits, ref(x).logits)


def test_save_pretrained_refuses_when_the_host_copy_lost_the_weights(tmp_path):
    patched = thm.patch_model(tiny_model("mixtral"), cpu_weight_dtype="bfloat16")  # fp32 model, bf16 host copy
    with pytest.raises(RuntimeError, match="host copy is bfloat16, not the model's torch.float32"):
        patched.save_pretrained(tmp_path)
    assert not list(tmp_path.iterdir())  # nothing written: transformers wrote config.json before the state dict


@pytest.mark.parametrize(
    "budget, slots",
    [
        (np.float32(0.5), 3),
        (torch.tensor(0.5), 3),
        (np.float64(1 / 6), 1),
        (1, 6),
        (0, 0),
        ("1TiB", 6),
        ("1 TB", 6),
    ],
)
def test_any_real_fraction_and_every_size_unit(budget, slots):
    model = thm.patch_model(tiny_model("mixtral"), expert_budget=budget)  # 6 experts per layer
    assert {layer.store.num_slots for layer in thm.runtime.model_layers(model).values()} == {slots}


def test_precalc_from_layer_beyond_the_model_is_refused():
    model = tiny_model("deepseek_v3")  # MoE layers 1 and 2
    before = snapshot(model)
    with pytest.raises(ValueError, match="precalc_from_layer=3 approximates nothing"):
        thm.patch_model(model, mode="daop_precalc", precalc_from_layer=3)
    assert_untouched(model, before)


def test_deepcopy_of_a_patched_model_is_refused():
    model = thm.patch_model(tiny_model("mixtral"))
    with pytest.raises(TypeError, match="deepcopy of a patched model"):
        copy.deepcopy(model)
