"""`from_pretrained` of llama.cpp GGUF files, written here by the `gguf` package the way convert_hf_to_gguf.py writes
them (its tensor-name map, fused expert tensors, Llama's rotary permutation, DeepSeek's k_b / v_b split), against
transformers models holding the values the file holds; with llama.cpp's own converter where a checkout is given."""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import torch_hybrid_moe as thm
from torch_hybrid_moe.errors import InputError
from torch_hybrid_moe.ops.quantize import dequantize
from torch_hybrid_moe.tiny_models import TINY_ARCHITECTURES, random_model, tiny_config

Q = gguf.GGMLQuantizationType
GGUF_ARCH = {
    "mixtral": gguf.MODEL_ARCH.LLAMA,
    "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE,
    "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
    "deepseek_v2": gguf.MODEL_ARCH.DEEPSEEK2,
    "deepseek_v3": gguf.MODEL_ARCH.DEEPSEEK2,
}


def _model(arch: str, vocab: int = 96, width: int = 32) -> torch.nn.Module:
    """A tiny model whose expert widths are a whole number of GGUF blocks (32; 256 for the K-quants: `width`)."""
    config = tiny_config(arch)
    config.vocab_size = vocab
    config.intermediate_size = 64
    if width != 32:
        config.hidden_size = width
    if hasattr(config, "moe_intermediate_size"):
        config.moe_intermediate_size = width
    if hasattr(config, "mlp_only_layers"):  # llama.cpp's Qwen MoE architectures have no dense layers
        config.mlp_only_layers = []
    return random_model(config)


def _stored(value: torch.Tensor, qtype: Q) -> tuple[np.ndarray, torch.Tensor]:
    """(what the file stores, the values it holds) for a tensor quantised along its last dimension."""
    data = value.detach().float().numpy()
    if qtype == Q.F32:
        return data, value.detach().float()
    if qtype == Q.Q4_K:  # the gguf package does not quantise to K-quants: random blocks with sane super-block scales
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.random.default_rng(0).integers(0, 256, (*data.shape[:-1], data.shape[-1] // block, size), np.uint8)
        raw[..., :4] = np.array([0.02, 0.01], np.float16).view(np.uint8)  # d, dmin
        raw = raw.reshape(*data.shape[:-1], -1)
    else:
        raw = gguf.quants.quantize(data, qtype)
    return raw, torch.from_numpy(gguf.quants.dequantize(raw, qtype)).reshape(value.shape)


def write_gguf(
    model: torch.nn.Module,
    path: Path,
    experts: Q | dict[str, Q] = Q.Q8_0,
    dense: Q = Q.Q8_0,
    parts: int = 1,
    rope_factor: float = 0,
) -> dict:
    """Write `model` as convert_hf_to_gguf.py lays it out (experts in `experts`, or per kind: {"gate": .., "up": ..,
    "down": ..}, as llama.cpp's mixes write them; dense 2-D weights in `dense` where their rows are whole
    blocks, the rest F32); the state dict of the values the file holds, in the model's layout. `rope_factor`: a
    yarn scaling factor in the file's metadata (0: none, as for these models)."""
    cfg = model.config
    arch = GGUF_ARCH[cfg.model_type]
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    held, tensors = {}, []
    for name, value in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            bid = name.split(".")[2]
            halves = value.chunk(2, dim=1) if name.endswith("gate_up_proj") else (value,)
            kinds = ("gate", "up") if len(halves) == 2 else ("down",)
            kept = []
            for kind, half in zip(kinds, halves):
                qtype = experts[kind] if isinstance(experts, dict) else experts
                raw, values = _stored(half, qtype)
                tensors.append((f"blk.{bid}.ffn_{kind}_exps.weight", raw, qtype))
                kept.append(values)
            held[name] = torch.cat(kept, dim=1)
            continue
        suffix = ".bias" if name.endswith(("bias", "_bias")) else ".weight"
        base = name.removesuffix("_bias").removesuffix(".bias").removesuffix(".weight")
        key = names.get_name(base) + suffix
        qtype = dense if value.dim() == 2 and value.shape[-1] % 32 == 0 else Q.F32
        raw, held[name] = _stored(value, qtype)
        if cfg.model_type == "mixtral" and key.endswith((".attn_q.weight", ".attn_k.weight")):  # LlamaModel.permute
            heads = cfg.num_attention_heads if ".attn_q." in key else cfg.num_key_value_heads
            raw = raw.reshape(heads, 2, raw.shape[0] // heads // 2, raw.shape[-1]).swapaxes(1, 2).reshape(raw.shape)
        if key.endswith("attn_kv_b.weight"):  # DeepseekV2Model: split into k_b (transposed per head) and v_b
            kv_b = value.view(cfg.num_key_value_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
            k_b, v_b = kv_b.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)
            tensors.append((key.replace("kv_b", "k_b"), k_b.transpose(1, 2).contiguous().numpy(), Q.F32))
            tensors.append((key.replace("kv_b", "v_b"), v_b.contiguous().numpy(), Q.F32))
            held[name] = value.detach().clone()
            continue
        tensors.append((key, raw, qtype))
    files = (
        [path]
        if parts == 1
        else [path.with_name(f"{path.stem}-{i:05d}-of-{parts:05d}.gguf") for i in range(1, 1 + parts)]
    )
    for i, file in enumerate(files):
        writer = gguf.GGUFWriter(str(file), gguf.MODEL_ARCH_NAMES[arch] if i == 0 else None)
        if i == 0:  # the settings convert_hf_to_gguf.py writes that the loader checks against config.json
            writer.add_block_count(cfg.num_hidden_layers)
            writer.add_head_count(cfg.num_attention_heads)
            writer.add_expert_used_count(cfg.num_experts_per_tok)
            writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
            if rope_factor:
                writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
                writer.add_rope_scaling_factor(rope_factor)
            if cfg.model_type in ("deepseek_v2", "deepseek_v3"):  # as convert_hf_to_gguf.py's DeepSeek models
                sigmoid = cfg.model_type == "deepseek_v3"
                writer.add_expert_gating_func(gguf.ExpertGatingFuncType(2 if sigmoid else 1))
                if cfg.norm_topk_prob:
                    writer.add_expert_weights_norm(True)
        for key, raw, qtype in tensors[i::parts]:
            writer.add_tensor(key, raw, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    cfg.save_pretrained(path.parent)
    return held


def _logits(model: torch.nn.Module) -> torch.Tensor:
    x = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(x).logits


def _holding(model: torch.nn.Module, held: dict, **config) -> torch.Tensor:
    """Logits of `model` holding the file's values, patched with `config` by patch_model."""
    model.load_state_dict(held)
    return _logits(thm.patch_model(model, device="cpu", **config))


@pytest.mark.slow
@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_q8_0_file_loads_as_its_values_patched_in_int8(arch, tmp_path):
    """Q8_0 experts go into int8 at group 32 with no float round trip; patching a model that holds the file's values
    re-derives exactly those integers and scales (Q8_0's scale is max|w| / 127, the int8 format's), so the two agree
    bit for bit, which also checks every dense tensor's name and llama.cpp's reshapes."""
    held = write_gguf(_model(arch), tmp_path / "model-q8_0.gguf")
    model = thm.from_pretrained(tmp_path / "model-q8_0.gguf", expert_budget=0.5, device="cpu")
    want = _holding(_model(arch), held, expert_budget=0.5, cpu_weight_dtype="int8", cpu_weight_group_size=32)
    assert torch.equal(_logits(model), want)


def _store(model: torch.nn.Module):
    return next(m for m in model.modules() if hasattr(m, "_hybrid_moe_layer"))._hybrid_moe_layer.store


@pytest.mark.parametrize("qtype,bits", [(Q.Q8_0, 8), (Q.Q4_0, 4)])
def test_q8_0_and_q4_0_experts_keep_the_files_weights_bit_for_bit(qtype, bits, tmp_path):
    """The store holds the file's integers and scales as they are, with no float round trip. What the model computes
    from them: test_q8_0_file_loads_as_its_values_patched_in_int8 (int8, exactly) and the kernel's float64 checks
    (int4). A logits bound against the float model was dropped: one routing flip moves logits by 10-30%."""
    held = write_gguf(_model("qwen3_moe"), tmp_path / "model.gguf", experts=qtype, dense=Q.F32)
    model = thm.from_pretrained(tmp_path / "model.gguf", expert_budget=0.0, device="cpu")
    store = _store(model)
    name = next(n for n in held if n.endswith("experts.gate_up_proj"))
    for host, key in ((store.host_gate_up, name), (store.host_down, name.replace("gate_up_proj", "down_proj"))):
        assert (host.bits, host.group_size) == (bits, 32)
        assert torch.equal(dequantize(host.data, host.scale, bits, 32), held[key])


@pytest.mark.parametrize(
    "experts,asked,want",
    [
        (Q.F16, {}, {"cpu_weight_dtype": "model"}),  # a float file keeps the model's dtype
        (Q.Q5_0, {}, {"cpu_weight_dtype": "int8", "cpu_weight_group_size": 32}),  # nearest: through the dequantiser
        (Q.Q8_0, {"cpu_weight_dtype": "int4", "cpu_weight_group_size": 32}, None),  # asked for: converted
        (Q.Q8_0, {"cpu_weight_dtype": "int8", "cpu_weight_group_size": 64}, None),  # another group: converted
    ],
)
def test_other_types_and_asked_formats_convert_the_files_values(experts, asked, want, tmp_path):
    held = write_gguf(_model("deepseek_v3"), tmp_path / "model.gguf", experts=experts, dense=Q.F32)
    regrouped = asked.get("cpu_weight_group_size", 32) != 32
    with pytest.warns(UserWarning, match="re-quantised at group 64") if regrouped else contextlib.nullcontext():
        model = thm.from_pretrained(tmp_path / "model.gguf", expert_budget=0.25, device="cpu", **asked)
    assert torch.equal(_logits(model), _holding(_model("deepseek_v3"), held, expert_budget=0.25, **(want or asked)))


def test_k_quant_experts_go_to_the_nearest_format_through_the_dequantiser(tmp_path):
    """Q4_K (256-weight super-blocks) has no store layout: dequantised by `gguf`, then quantised to int4 at group 32,
    as patch_model quantises a model holding the file's values."""
    held = write_gguf(_model("qwen3_moe", width=256), tmp_path / "model.gguf", experts=Q.Q4_K, dense=Q.F32)
    model = thm.from_pretrained(tmp_path / "model.gguf", expert_budget=0.0, device="cpu")
    want = {"cpu_weight_dtype": "int4", "cpu_weight_group_size": 32}
    assert torch.equal(_logits(model), _holding(_model("qwen3_moe", width=256), held, expert_budget=0.0, **want))


@pytest.mark.parametrize(
    "experts,want",
    [  # llama.cpp's mixes (Q4_K_M: gate and up at 4 bits, down at 6) store each kind in its own type
        ({"gate": Q.Q4_0, "up": Q.Q4_0, "down": Q.Q8_0}, {"cpu_weight_dtype": "int8", "cpu_weight_group_size": 32}),
        ({"gate": Q.Q8_0, "up": Q.Q4_0, "down": Q.F16}, {"cpu_weight_dtype": "model"}),
    ],
)
def test_experts_of_mixed_types_go_to_the_widest_format_keeping_each_tensors_values(experts, want, tmp_path):
    """The store takes the widest format any expert tensor needs (nothing is read into fewer bits than the file
    holds); each tensor arrives there as patch_model would put the file's values, whether read as it is (Q8_0 into
    int8) or through the dequantiser (Q4_0 into int8, anything into the model's dtype)."""
    held = write_gguf(_model("qwen3_moe"), tmp_path / "model.gguf", experts=experts, dense=Q.F32)
    model = thm.from_pretrained(tmp_path / "model.gguf", expert_budget=0.25, device="cpu")
    host = _store(model).host_gate_up
    assert getattr(host, "bits", None) == (8 if want["cpu_weight_dtype"] == "int8" else None)
    assert torch.equal(_logits(model), _holding(_model("qwen3_moe"), held, expert_budget=0.25, **want))


def test_each_gguf_type_goes_to_the_host_format_keeping_its_precision():
    """5- to 8-bit types to int8, fewer bits to int4, floats as they are: Q8_1 and Q8_K went to int4."""
    from torch_hybrid_moe.gguf_checkpoint import nearest_format

    want = {Q.F32: "model", Q.F16: "model", Q.BF16: "model", Q.Q2_K: "int4", Q.Q3_K: "int4", Q.Q4_0: "int4"}
    want |= {Q.Q4_1: "int4", Q.Q4_K: "int4", Q.IQ4_NL: "int4", Q.Q5_0: "int8", Q.Q5_1: "int8", Q.Q5_K: "int8"}
    want |= {Q.Q6_K: "int8", Q.Q8_0: "int8", Q.Q8_1: "int8", Q.Q8_K: "int8"}
    assert {t: nearest_format(t) for t in want} == want


def test_split_files_load_from_their_first_part(tmp_path):
    held = write_gguf(_model("mixtral"), tmp_path / "model.gguf", dense=Q.F32, parts=3)
    first = tmp_path / "model-00001-of-00003.gguf"
    model = thm.from_pretrained(first, expert_budget=0.0, device="cpu")
    want = _holding(_model("mixtral"), held, expert_budget=0.0, cpu_weight_dtype="int8", cpu_weight_group_size=32)
    assert torch.equal(_logits(model), want)
    (tmp_path / "model-00003-of-00003.gguf").unlink()
    with pytest.raises(InputError, match=r"model-00003-of-00003.gguf is missing: .* one of 3 parts"):
        thm.from_pretrained(first, device="cpu")


def _bad(tmp_path: Path, mutate) -> str:
    tmp_path.mkdir()
    path = tmp_path / "model.gguf"
    write_gguf(_model("qwen3_moe"), path)
    mutate(path)
    with pytest.raises(InputError) as err:
        thm.from_pretrained(path, device="cpu")
    assert "\n" not in str(err.value)
    return str(err.value)


def test_bad_files_fail_in_one_line_naming_what_to_do(tmp_path):
    def truncate(path: Path) -> None:
        path.write_bytes(path.read_bytes()[:-100])

    assert "ends inside tensor output.weight: the file is truncated" in _bad(tmp_path / "a", truncate)

    def garbage(path: Path) -> None:
        path.write_bytes(b"GGUF" + os.urandom(64))

    assert "not a GGUF file this loader reads" in _bad(tmp_path / "b", garbage)
    assert "put the original model's config.json" in _bad(tmp_path / "c", lambda p: (p.parent / "config.json").unlink())

    def other_config(path: Path) -> None:
        _model("mixtral").config.save_pretrained(path.parent)

    assert "holds a 'qwen3moe' model, config.json a 'mixtral' one" in _bad(tmp_path / "d", other_config)

    def wider_config(path: Path) -> None:
        config = _model("qwen3_moe").config
        config.moe_intermediate_size = 64
        config.save_pretrained(path.parent)

    assert "blk.0.ffn_gate_exps.weight is [8, 32, 32], the model's config wants [8, 64, 32]" in _bad(
        tmp_path / "e", wider_config
    )

    def integer_experts(path: Path) -> None:  # a type the gguf package has no dequantiser for, in the tensor's header
        data = bytearray(path.read_bytes())
        at = data.index(b"blk.0.ffn_up_exps.weight") + len("blk.0.ffn_up_exps.weight")
        at += 4 + 8 * int.from_bytes(data[at : at + 4], "little")  # past the dimension count and dimensions
        data[at : at + 4] = int(Q.I8).to_bytes(4, "little")
        path.write_bytes(bytes(data))

    assert "blk.0.ffn_up_exps.weight is GGML type I8, which the gguf package cannot dequantise" in _bad(
        tmp_path / "f", integer_experts
    )

    def other_top_k(path: Path) -> None:  # every tensor keeps its shape: only the file's metadata can tell
        config = _model("qwen3_moe").config
        config.num_experts_per_tok = 2
        config.save_pretrained(path.parent)

    assert "qwen3moe.expert_used_count = 3, config.json num_experts_per_tok = 2" in _bad(tmp_path / "g", other_top_k)

    def fewer_layers(path: Path) -> None:
        config = _model("qwen3_moe").config
        config.num_hidden_layers = 2
        config.save_pretrained(path.parent)

    assert "qwen3moe.block_count = 3, config.json num_hidden_layers = 2" in _bad(tmp_path / "h", fewer_layers)
    assert "is 0 bytes, not a GGUF file" in _bad(tmp_path / "i", lambda p: p.write_bytes(b""))

    def tied_config(path: Path) -> None:  # the file's own LM head would be dropped for the embedding
        config = _model("qwen3_moe").config
        config.tie_word_embeddings = True
        config.save_pretrained(path.parent)

    assert "holds an LM head of its own (output.weight), but config.json ties it" in _bad(tmp_path / "j", tied_config)

    (tmp_path / "k").mkdir()  # a long-context (yarn) file beside its base model's config: positions rotate otherwise
    write_gguf(_model("qwen3_moe"), tmp_path / "k" / "model.gguf", rope_factor=4.0)
    with pytest.raises(InputError, match="qwen3moe.rope.scaling.factor = 4.0, config.json rope factor = 1.0"):
        thm.from_pretrained(tmp_path / "k" / "model.gguf", device="cpu")


@pytest.mark.parametrize(
    ("config_of", "change", "match"),
    [
        ("deepseek_v2", {}, "deepseek2.expert_gating_func = 2, config.json model_type's gating"),  # V3 file as V2
        ("deepseek_v3", {"norm_topk_prob": False}, "deepseek2.expert_weights_norm = True, config.json norm_topk_prob"),
    ],
)
def test_a_deepseek_file_under_another_variants_config_is_refused(config_of, change, match, tmp_path):
    """DeepSeek-V2 and V3 share llama.cpp's architecture and, at these sizes, every tensor's shape: only the file's
    gating function (sigmoid) and top-k renormalisation tell a V3 file from a V2 config (softmax routing, the
    bias dropped) or from a config that does not renormalise."""
    path = tmp_path / "model.gguf"
    write_gguf(_model("deepseek_v3"), path)
    config = _model(config_of).config
    for key, value in change.items():
        setattr(config, key, value)
    config.save_pretrained(tmp_path)
    with pytest.raises(InputError, match=match):
        thm.from_pretrained(path, device="cpu")
    with pytest.raises(InputError, match="does not exist"):
        thm.from_pretrained(tmp_path / "none.gguf")
    with pytest.raises(InputError, match="loads without preparing"):
        thm.prepare(tmp_path / "e" / "model.gguf", tmp_path / "out", thm.HybridMoEConfig(cpu_weight_dtype="int8"))


def _llama_cpp() -> Path | None:
    directory = os.environ.get("HYBRID_MOE_LLAMA_CPP")
    return Path(directory) if directory and (Path(directory) / "convert_hf_to_gguf.py").is_file() else None


@pytest.mark.slow
@pytest.mark.skipif(_llama_cpp() is None, reason="set HYBRID_MOE_LLAMA_CPP to a llama.cpp checkout")
@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_llama_cpp_converted_file_equals_the_original(arch, tmp_path):
    """llama.cpp's own converter, f32: the loaded model gives the original model's logits exactly."""
    from torch_hybrid_moe.embedded import load_tokenizer

    _model(arch, vocab=2048).save_pretrained(tmp_path)
    load_tokenizer("mixtral-tiny").save_pretrained(tmp_path)
    llama, out = _llama_cpp(), tmp_path / "model-f32.gguf"
    # the embedded tokenizer's pre-tokenizer is unknown to the converter: it is byte-level BPE, as GPT-2's
    script = (
        "import sys, runpy; sys.path[:0] = [sys.argv[1] + '/gguf-py', sys.argv[1]]\n"
        "import conversion.base as b\n"
        "b.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'\n"
        "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    command = [sys.executable, "-c", script, str(llama), f"{llama}/convert_hf_to_gguf.py", str(tmp_path)]
    subprocess.run([*command, "--outtype", "f32", "--outfile", str(out)], check=True, capture_output=True)
    loaded = thm.from_pretrained(out, expert_budget=0.25, device="cpu")
    want = thm.patch_model(_model(arch, vocab=2048), expert_budget=0.25, device="cpu")
    assert torch.equal(_logits(loaded), _logits(want))


def test_generate_reads_a_gguf_file_with_the_tokenizer_beside_it(tmp_path, capsys):
    from torch_hybrid_moe.cli import main
    from torch_hybrid_moe.embedded import load_tokenizer

    held = write_gguf(_model("qwen3_moe", vocab=2048), tmp_path / "model-q8_0.gguf")
    tokenizer = load_tokenizer("mixtral-tiny")
    tokenizer.save_pretrained(tmp_path)
    argv = ["generate", "--model", str(tmp_path / "model-q8_0.gguf"), "--max-new-tokens", "4", "--device", "cpu"]
    assert main([*argv, "--prompt", "def fibonacci(n):"]) == 0
    reference = _model("qwen3_moe", vocab=2048)
    reference.load_state_dict(held)
    thm.patch_model(reference, device="cpu", cpu_weight_dtype="int8", cpu_weight_group_size=32)
    ids = tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
    want = reference.generate(ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1] :]
    assert f"output: {tokenizer.decode(want, skip_special_tokens=True)}\n" in capsys.readouterr().out


def test_a_tokenizer_transformers_cannot_read_from_the_file_is_one_line(tmp_path):
    from torch_hybrid_moe.embedded import load_tokenizer

    write_gguf(_model("deepseek_v3"), tmp_path / "model.gguf")  # no tokenizer files beside it, none in it
    with pytest.raises(InputError, match="put the model's tokenizer.json and tokenizer_config.json beside it") as err:
        load_tokenizer(str(tmp_path / "model.gguf"))
    assert "\n" not in str(err.value)
