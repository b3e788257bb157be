"""`from_pretrained`: experts streamed from safetensors into the store, against transformers' from_pretrained +
patch_model on the same checkpoint, for every architecture, checkpoint layout and host format; bad checkpoints
fail in one line before anything is built; peak host memory stays near the final footprint."""

import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import torch_hybrid_moe as thm
from torch_hybrid_moe.errors import InputError
from torch_hybrid_moe.tiny_models import TINY_ARCHITECTURES, tiny_model


def _logits(model: torch.nn.Module) -> torch.Tensor:
    x = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(x).logits


def _reference(path, **config) -> torch.Tensor:
    """transformers' load + patch_model, its weights moved off the file's mapping into fresh memory as ours are: on
    some CPUs (a Zen 5's MKL) a small GEMM's last bits depend on the weight's address, and transformers leaves a
    weight wherever the file put it (qwen2_moe's 1 x 32 shared-expert gate, 24 bytes past a 64-byte boundary, gave
    logits 1e-7 off the same model's with the weight in aligned memory)."""
    model = AutoModelForCausalLM.from_pretrained(path)
    for param in model.parameters():
        param.data = param.data.clone()
    return _logits(thm.patch_model(model, device="cpu", **config))


@pytest.mark.slow
@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_streamed_model_equals_transformers_load_and_patch(arch, tmp_path):
    tiny_model(arch).save_pretrained(tmp_path)  # per-expert tensors, Mixtral's under block_sparse_moe.*.w1/w3/w2
    model = thm.from_pretrained(tmp_path, expert_budget=0.5, device="cpu")
    assert thm.model_patches.is_patched(model)
    assert torch.equal(_logits(model), _reference(tmp_path, expert_budget=0.5))


def _qwen3(hidden: int, experts: int, inter: int, layers: int) -> torch.nn.Module:
    """A random Qwen3-MoE whose expert widths fit int8 / int4 groups (the tiny test models' do not)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            vocab_size=512,
            hidden_size=hidden,
            intermediate_size=2 * inter,
            moe_intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=hidden // 4,
            num_experts=experts,
            num_experts_per_tok=4,
            decoder_sparse_step=1,
        )
    )


@pytest.mark.slow
@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
@pytest.mark.parametrize("fmt", ["int8", "int4", "bfloat16"])
def test_streamed_host_formats_equal_patching_the_loaded_model(fmt, fused, tmp_path, monkeypatch):
    """Experts converted as read, a block of rows at a time (blocks of 24 rows here: they end inside a gate or up
    projection and at its last row), from per-expert tensors or the model's fused ones."""
    model = _qwen3(64, 8, 64, 2)
    if fused:
        model.config.save_pretrained(tmp_path)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "model.safetensors")
    else:
        model.save_pretrained(tmp_path)
    config = {"expert_budget": 0.0, "cpu_weight_dtype": fmt, "cpu_weight_group_size": 32}
    want = _reference(tmp_path, **config)
    monkeypatch.setattr("torch_hybrid_moe.ops.quantize.QUANTIZE_ELEMENTS", 24 * 64)
    assert torch.equal(_logits(thm.from_pretrained(tmp_path, device="cpu", **config)), want)


@pytest.mark.slow
def test_fused_and_sharded_checkpoints(tmp_path):
    model = tiny_model("deepseek_v3")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    fused = tmp_path / "fused"  # experts as the model holds them: experts.gate_up_proj / experts.down_proj
    model.config.save_pretrained(fused)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, fused / "model.safetensors")
    want = _reference(tmp_path / "sharded", expert_budget=0.25)
    for path in (tmp_path / "sharded", fused):
        assert torch.equal(_logits(thm.from_pretrained(path, expert_budget=0.25, device="cpu")), want)


@pytest.mark.slow
def test_dtype_auto_takes_the_checkpoints(tmp_path):
    tiny_model("mixtral", dtype=torch.bfloat16).save_pretrained(tmp_path)
    model = thm.from_pretrained(tmp_path, device="cpu")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert thm.from_pretrained(tmp_path, dtype=torch.float32, device="cpu").lm_head.weight.dtype == torch.float32


@pytest.mark.slow
def test_dtype_auto_without_a_config_dtype_takes_the_stored_weights(tmp_path):
    """A config.json that names no dtype: transformers' "auto" reads the stored weights' dtype; so does ours."""
    tiny_model("qwen3_moe", dtype=torch.bfloat16).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if "dtype" not in k}))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype="auto")
    assert reference.lm_head.weight.dtype == torch.bfloat16  # what the stored weights say
    model = thm.from_pretrained(tmp_path, device="cpu", expert_budget=0.0)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(_logits(model), _logits(thm.patch_model(reference, device="cpu", expert_budget=0.0)))


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, True])
def test_dtype_auto_on_mixed_weights_takes_what_transformers_takes(sharded, tmp_path):
    """A bf16 checkpoint holding one fp32 tensor (a router), no dtype in config.json: transformers' "auto" takes the
    first floating tensor by name (bf16), or a sharded index's metadata dtype; ours took the first in the file's
    header order, which lists wider dtypes first (fp32), and computed in another dtype than transformers."""
    tiny_model("qwen3_moe", dtype=torch.bfloat16).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if "dtype" not in k}))
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.0.mlp.gate.weight"] = weights["model.layers.0.mlp.gate.weight"].float()
    if sharded:  # the fp32 router first in the first file; the index names the dtype
        (tmp_path / "model.safetensors").unlink()
        first = {k: v for k, v in weights.items() if k.startswith("model.layers.0.")}
        parts = [first, {k: v for k, v in weights.items() if k not in first}]
        for i, part in enumerate(parts, 1):
            save_file(part, tmp_path / f"model-0000{i}-of-00002.safetensors", metadata={"format": "pt"})
        shards = {k: f"model-0000{i}-of-00002.safetensors" for i, part in enumerate(parts, 1) for k in part}
        index = {"metadata": {"dtype": "bfloat16"}, "weight_map": shards}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype="auto")
    model = thm.from_pretrained(tmp_path, device="cpu", expert_budget=0.0)
    assert model.lm_head.weight.dtype == reference.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(_logits(model), _logits(thm.patch_model(reference, device="cpu", expert_budget=0.0)))


@pytest.mark.slow
def test_a_header_not_padded_to_eight_bytes_loads_as_transformers_loads_it(tmp_path):
    """safetensors pads headers to 8 bytes, but a reader must not rely on it: mapping the embedding at an odd
    offset failed ("storage_offset must be divisible"); the table is read in instead."""
    tiny_model("qwen3_moe").save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    data = file.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.dumps(json.loads(data[8 : 8 + size])).encode()
    header += b" " * ((1 - 8 - len(header)) % 8)  # the data starts 1 byte past a multiple of 8
    file.write_bytes(len(header).to_bytes(8, "little") + header + data[8 + size :])
    model = thm.from_pretrained(tmp_path, device="cpu", expert_budget=0.0)
    assert torch.equal(_logits(model), _reference(tmp_path, expert_budget=0.0))


@pytest.mark.slow
def test_tensors_the_model_does_not_use_are_named_in_a_warning(tmp_path):
    """A checkpoint of 3 layers under a config of 2: transformers lists the unexpected keys; ours read none of them
    and said nothing. Now a warning names them; the model is still the one transformers loads."""
    tiny_model("qwen3_moe").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] - 1}))
    with pytest.warns(UserWarning, match="tensor\\(s\\) the model does not use \\(first: model.layers.2."):
        model = thm.from_pretrained(tmp_path, device="cpu", expert_budget=0.0)
    assert torch.equal(_logits(model), _reference(tmp_path, expert_budget=0.0))


@pytest.mark.slow
@pytest.mark.parametrize("same", [True, False])
def test_tied_embeddings_with_both_tensors_in_the_file_load_as_transformers_loads_them(same, tmp_path):
    """tie_word_embeddings with both tensors in the file: transformers ties them where they are equal, and
    leaves them untied, each with its own values, where they differ; ours too."""
    model = tiny_model("qwen3_moe")
    model.config.tie_word_embeddings = True
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    embedding = weights["model.embed_tokens.weight"]
    weights["lm_head.weight"] = embedding.clone() if same else torch.randn_like(embedding)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reference = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert (reference.lm_head.weight is reference.model.embed_tokens.weight) == same
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = thm.from_pretrained(tmp_path, device="cpu", expert_budget=0.0)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == same
    assert any("loaded untied" in str(w.message) for w in caught) != same
    assert torch.equal(ours.model.embed_tokens.weight, embedding)
    assert torch.equal(ours.lm_head.weight, weights["lm_head.weight"])
    assert torch.equal(_logits(ours), _logits(thm.patch_model(reference, device="cpu", expert_budget=0.0)))


def _rewrite_header(path, edit):
    """The safetensors file at `path` with its JSON header changed by `edit(header)`, the data bytes as they were."""
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    edit(header)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + size :])


def _break(path, edit):
    weights = load_file(path / "model.safetensors")
    edit(weights)
    save_file(weights, path / "model.safetensors")


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing_expert", "lacks 1 expert tensors of model.layers.1.mlp.experts"),
        ("missing_dense", "lacks 1 of the model's weights \\(first: model.norm.weight\\)"),
        ("wrong_shape", "config.json and the weights disagree"),
        ("no_weights", "has no \\*.safetensors files"),
        ("truncated", "the file is truncated"),
        ("unsupported", "model type 'llama' is not supported"),
        ("offline_hub", "cannot fetch 'nobody/no-such-model' from the hub"),
        ("broadcastable_shape", "tensor model.norm.weight is \\[1\\], the model wants \\[32\\]"),
        ("integer_weights", "holds torch.int8 values, the model wants torch.bfloat16 weights"),
        ("quantised", "is quantised \\(bitsandbytes\\), which this loader does not read"),
        ("corrupt_header", "the file is corrupt"),
        ("lfs_pointer", "is not a safetensors file .*a git-lfs pointer"),
        ("empty_file", "is not a safetensors file"),
        ("header_not_tensors", "tensor a's header entry is malformed"),
        ("index_names_missing_shard", "names 1 file\\(s\\) not in .*fetch every shard"),
        ("index_not_json", "is not a safetensors index"),
        ("index_names_nothing", "is not a safetensors index \\(ValueError: its weight_map names no file\\)"),
        ("config_not_json", "config.json cannot be read"),
        ("config_without_model_type", "config.json cannot be read"),
    ],
)
def test_bad_checkpoints_fail_in_one_line(case, message, tmp_path, monkeypatch):
    tiny_model("deepseek_v2").save_pretrained(tmp_path)
    name = str(tmp_path)
    if case == "missing_expert":
        _break(tmp_path, lambda w: w.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    if case == "missing_dense":
        _break(tmp_path, lambda w: w.pop("model.norm.weight"))
    if case == "wrong_shape":
        config = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 64}))
    if case == "no_weights":
        (tmp_path / "model.safetensors").unlink()
    if case == "truncated":
        data = (tmp_path / "model.safetensors").read_bytes()
        (tmp_path / "model.safetensors").write_bytes(data[:-100])
    if case == "unsupported":
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    if case == "offline_hub":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        name = "nobody/no-such-model"
    if case == "broadcastable_shape":  # loaded in another dtype: converted through a buffer, never broadcast
        _break(tmp_path, lambda w: w.update({"model.norm.weight": torch.tensor([0.5])}))
    if case == "integer_weights":  # integer codes (a quantised checkpoint's) are not weights
        _break(tmp_path, lambda w: w.update({"model.norm.weight": torch.ones(32, dtype=torch.int8)}))
    if case == "quantised":
        config = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(
            json.dumps({**config, "quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}})
        )
    if case == "corrupt_header":  # a shape that disagrees with the tensor's byte range
        _rewrite_header(tmp_path / "model.safetensors", lambda h: h["model.norm.weight"].update(shape=[16]))
    if case == "lfs_pointer":  # its first 8 bytes read as a header length of petabytes
        (tmp_path / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:00\n")
    if case == "empty_file":
        (tmp_path / "model.safetensors").write_bytes(b"")
    if case == "header_not_tensors":
        (tmp_path / "model.safetensors").write_bytes((8).to_bytes(8, "little") + b'{"a": 1}')
    if case in ("index_names_missing_shard", "index_not_json", "index_names_nothing"):
        shards = {} if case == "index_names_nothing" else {"model.norm.weight": "model-00002-of-00002.safetensors"}
        text = "{weight_map" if case == "index_not_json" else json.dumps({"weight_map": shards})
        (tmp_path / "model.safetensors.index.json").write_text(text)
    if case == "config_not_json":
        (tmp_path / "config.json").write_text("{'model_type': 'deepseek_v2'")
    if case == "config_without_model_type":
        config = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "model_type"}))
    with pytest.raises(InputError, match=message) as err:
        thm.from_pretrained(name, device="cpu", dtype=torch.bfloat16)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"cpu_weight_dtype": "int8", "cpu_weight_group_size": 96}, "cannot quantise"),
        ({"mode": "expert_deferral", "deferred_experts": 99}, "deferred_experts"),
        ({"mode": "daop_precalc", "precalc_from_layer": 99}, "approximates nothing"),
    ],
)
def test_a_config_the_model_cannot_take_fails_before_any_weight_is_read(config, message, tmp_path, monkeypatch):
    """What only the model's shapes decide (a group that does not divide the experts' columns, deferring as many
    experts as the router picks, a pre-calculation start past the last layer) is refused before the dense weights
    are read, not after minutes of loading."""
    from torch_hybrid_moe.loading import Checkpoint

    tiny_model("deepseek_v2").save_pretrained(tmp_path)
    monkeypatch.setattr(Checkpoint, "load_dense", lambda *a, **k: pytest.fail("the dense weights were read"))
    with pytest.raises(InputError, match=message):
        thm.from_pretrained(tmp_path, device="cpu", **config)


@pytest.mark.slow
def test_hub_id_loads_from_the_local_cache_offline(tmp_path, monkeypatch):
    """A hub id whose snapshot is in the local cache loads with HF_HUB_OFFLINE=1 (no network)."""
    snapshot = tmp_path / "hub" / "models--owner--tiny" / "snapshots" / ("0" * 40)
    tiny_model("qwen2_moe").save_pretrained(snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    assert torch.equal(_logits(thm.from_pretrained("owner/tiny", device="cpu")), _reference(snapshot))


@pytest.fixture(scope="module")
def footprint_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ~200 MB checkpoint (fp32 experts) and a small one, saved once for every format measured."""
    path = tmp_path_factory.mktemp("footprint")
    _qwen3(256, 64, 256, 4).save_pretrained(path / "big")
    _qwen3(64, 8, 64, 2).save_pretrained(path / "small")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["model", "int4"])
def test_peak_host_memory_stays_near_the_final_footprint(fmt, footprint_checkpoints):
    """In a fresh process: peak RSS while loading <= 1.15 x (host store + dense weights) + the RSS before it,
    where transformers' load + patch holds the checkpoint's mapping and its fused copies at once. Reading the
    shards with positioned reads, not a mapping, leaves nothing of the file resident."""
    tmp_path = footprint_checkpoints
    script = textwrap.dedent(f"""
        import torch, torch_hybrid_moe as thm
        # everything a load imports or builds once (modules, the C++ kernel) is in place before measuring
        thm.from_pretrained({str(tmp_path / "small")!r}, expert_budget=0.0, device="cpu", cpu_weight_dtype={fmt!r})
        def status(field):
            return int(open("/proc/self/status").read().split(field + ":")[1].split()[0]) * 1024
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak (VmHWM) to now: importing torch has its own, higher one
        before = status("VmRSS")
        model = thm.from_pretrained({str(tmp_path / "big")!r}, expert_budget=0.0, device="cpu",
                                    cpu_weight_dtype={fmt!r}, cpu_weight_group_size=64)
        peak = status("VmHWM")
        store = sum(t.nbytes for layer in thm.runtime.model_layers(model).values()
                    for w in (layer.store.host_gate_up, layer.store.host_down)
                    for t in ((w,) if isinstance(w, torch.Tensor) else (w.data, w.scale)))
        dense = sum(p.nbytes for p in model.parameters())
        print(before, peak, store, dense)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    before, peak, store, dense = map(int, out.split()[-4:])
    assert store > dense  # the experts dominate, as in real models
    assert peak - before <= 1.15 * (store + dense), (peak - before, store, dense)


@pytest.mark.slow
def test_embedded_model_with_tied_embeddings():
    """deepseek-tiny ties its LM head to the embedding (no lm_head.weight in the file): one tensor, loaded once."""
    from torch_hybrid_moe.embedded import load_model

    model = thm.from_pretrained("deepseek-tiny", dtype=torch.float32, device="cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    reference = thm.patch_model(load_model("deepseek-tiny", torch.float32)[0], device="cpu")
    assert torch.equal(_logits(model), _logits(reference))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["model", "int8"])
def test_dense_weights_quantised_on_load_equal_patching_the_loaded_model(fmt, tmp_path):
    """dense_weight_dtype: linears read and quantised a block of rows at a time (QUANTIZE_ELEMENTS shrunk so an LM
    head spans several blocks), and the embedding left mapped in the file, give the logits of load + patch."""
    _qwen3(64, 8, 64, 2).save_pretrained(tmp_path)
    config = {"expert_budget": 0.0, "cpu_weight_dtype": "int8", "dense_weight_dtype": fmt, "cpu_weight_group_size": 32}
    with pytest.MonkeyPatch.context() as m:
        m.setattr("torch_hybrid_moe.ops.quantize.QUANTIZE_ELEMENTS", 48 * 64)
        model = thm.from_pretrained(tmp_path, device="cpu", **config)
    assert model.model.embed_tokens.weight.untyped_storage().nbytes() > model.model.embed_tokens.weight.nbytes
    assert torch.equal(_logits(model), _reference(tmp_path, **config))


def test_a_quantised_linear_whose_shape_disagrees_fails_in_one_line(tmp_path):
    _qwen3(64, 8, 64, 2).save_pretrained(tmp_path)
    _break(tmp_path, lambda w: w.update({"lm_head.weight": w["lm_head.weight"][:-1].clone()}))
    with pytest.raises(
        InputError, match="lm_head.weight is \\[511, 64\\].*config.json and the weights disagree"
    ) as err:
        thm.from_pretrained(tmp_path, device="cpu", dense_weight_dtype="int8", cpu_weight_group_size=32)
    assert "\n" not in str(err.value)


def test_saving_into_the_checkpoints_own_directory_writes_the_mapped_embedding(tmp_path):
    """The embedding stays mapped from the checkpoint file; saving over that file must still write its values."""
    _qwen3(64, 8, 64, 2).save_pretrained(tmp_path)
    want = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    thm.from_pretrained(tmp_path, expert_budget=0.0, device="cpu").save_pretrained(tmp_path)
    got = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_the_embedding_table_stays_in_the_file(tmp_path):
    """In a fresh process: of a 64 MB embedding table only the rows of the tokens read become resident."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            vocab_size=65536,
            hidden_size=256,
            intermediate_size=128,
            moe_intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            num_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        )
    ).save_pretrained(tmp_path)
    script = textwrap.dedent(f"""
        import torch, torch_hybrid_moe as thm
        model = thm.from_pretrained({str(tmp_path)!r}, expert_budget=0.0, device="cpu", dense_weight_dtype="int8",
                                    cpu_weight_group_size=64)
        with torch.no_grad():
            model(torch.arange(8)[None])
        table = model.model.embed_tokens.weight
        address, resident = table.data_ptr(), None
        for line in open("/proc/self/smaps"):  # the resident part of the memory area holding the table
            head = line.split()[0]
            if "-" in head and ":" not in head:
                low, high = (int(v, 16) for v in head.split("-"))
                inside = low <= address < high
            elif inside and head == "Rss:":
                resident = int(line.split()[1]) * 1024
        print(table.nbytes, resident)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    table, resident = map(int, out.split()[-2:])
    assert resident < table / 4, (resident, table)
