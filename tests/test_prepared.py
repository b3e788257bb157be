"""Prepared stores (`thm.prepare`, `hybrid-moe prepare`): loaded with no conversion, they give the logits of loading
the original checkpoint in the same host format; bad requests fail in one line with nothing written."""

import json

import pytest
import torch

import torch_hybrid_moe as thm
from torch_hybrid_moe.cli import main
from torch_hybrid_moe.errors import InputError
from torch_hybrid_moe.ops import quantize
from torch_hybrid_moe.runtime import model_layers

from .test_cli_errors import one_line_error
from .test_loading import _logits, _qwen3

GROUP = {"cpu_weight_group_size": 32}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("source")
    _qwen3(64, 8, 64, 2).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.mark.parametrize("fmt", ["int8", "int4", "bfloat16"])
def test_prepared_store_loads_as_the_original(fmt, source, tmp_path, monkeypatch):
    out = thm.prepare(source, tmp_path / "store", thm.HybridMoEConfig(cpu_weight_dtype=fmt, **GROUP))
    want = _logits(thm.from_pretrained(source, expert_budget=0.0, device="cpu", cpu_weight_dtype=fmt, **GROUP))
    monkeypatch.setattr(quantize, "quantize", lambda *a, **k: pytest.fail("loading the store quantised again"))
    model = thm.from_pretrained(out, expert_budget=0.0, device="cpu")  # the store's format, read from its marker
    assert torch.equal(_logits(model), want)
    hosts = [w for layer in model_layers(model).values() for w in (layer.store.host_gate_up, layer.store.host_down)]
    want_bits = quantize.BITS.get(fmt)
    assert all(
        (w.bits if isinstance(w, quantize.QuantizedWeight) else w.dtype) == (want_bits or torch.bfloat16) for w in hosts
    )
    assert json.loads((out / "hybrid_moe_store.json").read_text())["cpu_weight_dtype"] == fmt
    # plain transformers: a bf16 store is a checkpoint like any other; an int8 / int4 one it refuses (it loaded its
    # config with freshly initialised experts, a warning its only sign)
    from transformers import AutoModelForCausalLM

    if fmt == "bfloat16":
        torch.testing.assert_close(
            _logits(AutoModelForCausalLM.from_pretrained(out)), _logits(AutoModelForCausalLM.from_pretrained(source))
        )
    else:
        with pytest.raises(OSError):
            AutoModelForCausalLM.from_pretrained(out)


def test_a_store_prepared_from_laid_out_experts_holds_their_rows(source, tmp_path, monkeypatch):
    """Preparing patches on the CPU with no slots, where int4 experts may be laid out for the kernel's lanes: the store
    is written row by row all the same, the bytes of one prepared from experts kept in rows (a portable format)."""
    from safetensors.torch import load_file

    from torch_hybrid_moe.ops.cpu_kernel import best_isa
    from torch_hybrid_moe.runtime import expert_store

    if best_isa() < 2:
        pytest.skip("laid-out int4 rows need the AVX-512 VNNI kernels")
    stores = {}
    for laid in (False, True):
        monkeypatch.setattr(expert_store, "laid_out_wins", lambda data, scale, laid=laid: laid)
        out = thm.prepare(source, tmp_path / f"store-{laid}", thm.HybridMoEConfig(cpu_weight_dtype="int4", **GROUP))
        stores[laid] = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
        model = thm.from_pretrained(out, expert_budget=0.0, device="cpu")
        assert all(layer.store.host_gate_up.laid == laid for layer in model_layers(model).values())
    assert stores[True].keys() == stores[False].keys()
    assert all(torch.equal(stores[True][k], stores[False][k]) for k in stores[False])


def test_a_prepared_store_quantises_the_dense_layers_in_the_group_asked_for(source, tmp_path):
    """Loading takes the experts' group from the store (32) but the dense layers' from the config (64, the
    default): the same model as patching the original with those two groups, not dense layers silently in 32."""
    out = thm.prepare(source, tmp_path / "store", thm.HybridMoEConfig(cpu_weight_dtype="int4", **GROUP))
    model = thm.from_pretrained(out, expert_budget=0.0, device="cpu", dense_weight_dtype="int4")
    want = thm.from_pretrained(
        source,
        expert_budget=0.0,
        device="cpu",
        cpu_weight_dtype="int4",
        dense_weight_dtype="int4",
        **GROUP,
        dense_weight_group_size=64,
    )
    dense = [m for m in model.modules() if type(m).__name__ == "QuantizedLinear"]
    assert dense and all(m.in_features == 64 * m.scale.shape[1] for m in dense)  # groups: dim 1, laid out or not
    assert torch.equal(_logits(model), _logits(want))
    with pytest.raises(InputError, match="dense_weight_group_size must be a positive multiple of 32 \\(or 0\\)"):
        thm.HybridMoEConfig(dense_weight_group_size=48)
    with pytest.raises(InputError, match="set dense_weight_dtype='int8' or 'int4' too"):
        thm.HybridMoEConfig(dense_weight_group_size=64)  # groups nothing: the dense layers stay as loaded


def test_prepared_store_refuses_another_format(source, tmp_path):
    out = thm.prepare(source, tmp_path / "store", thm.HybridMoEConfig(cpu_weight_dtype="int4", **GROUP))
    with pytest.raises(InputError, match="prepared as int4 .* load it with cpu_weight_dtype='int4'"):
        thm.from_pretrained(out, device="cpu", cpu_weight_dtype="int8", **GROUP)
    bf16 = thm.prepare(source, tmp_path / "bf16", thm.HybridMoEConfig(cpu_weight_dtype="bfloat16", **GROUP))
    thm.from_pretrained(bf16, device="cpu", cpu_weight_dtype="bfloat16")  # another group: bf16 has none to differ
    with pytest.raises(InputError, match="already a prepared store"):
        thm.prepare(out, tmp_path / "again", thm.HybridMoEConfig(cpu_weight_dtype="int8", **GROUP))
    marker = out / "hybrid_moe_store.json"
    older = {**json.loads(marker.read_text()), "version": 1}  # as stores with fp32 scales were marked
    marker.write_text(json.dumps(older))
    with pytest.raises(InputError, match="not a prepared-store marker this version reads \\(version 1.*prepare again"):
        thm.from_pretrained(out, device="cpu")
    marker.write_text('{"version": 99}')
    with pytest.raises(InputError, match="not a prepared-store marker"):
        thm.from_pretrained(out, device="cpu")


def test_prepare_command_and_its_bad_input(source, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a path that does not exist is tried as a hub id
    out = tmp_path / "cli-store"
    argv = ["prepare", "--model", str(source), "--cpu-weight-dtype", "int8", "--cpu-weight-group-size", "32"]
    assert main([*argv, "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out and (out / "hybrid_moe_store.json").is_file()
    one_line_error(capsys, [*argv, "--out", str(out)], "exists and is not an empty directory")
    # transformers loads a store with freshly initialised experts: the commands that would, refuse it
    for command in (["eval-ppl", "--max-tokens", "256"], ["trace", "--out", str(tmp_path / "t.safetensors")]):
        one_line_error(capsys, [*command, "--model", str(out)], "is a prepared store")
    assert not (tmp_path / "t.safetensors").exists()
    one_line_error(capsys, ["prepare", "--model", str(source), "--cpu-weight-dtype", "model", "--out", "x"], "choice")
    one_line_error(capsys, [*argv, "--out", str(tmp_path / "bad"), "--model", str(tmp_path / "nowhere")], "nowhere")
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad.partial-*"))
    # a place no directory can be made in is refused before the conversion, not after it (a traceback)
    one_line_error(capsys, [*argv, "--out", "/proc/hybrid-moe-store"], "cannot make a directory in /proc")
    here = tmp_path / "here"  # "." names an empty directory: written there (it crashed on the empty name)
    here.mkdir()
    monkeypatch.chdir(here)
    assert main([*argv, "--out", "."]) == 0 and (here / "hybrid_moe_store.json").is_file()


def test_a_store_prepared_in_another_dtype_loads_in_that_dtype(source, tmp_path):
    """A bf16 checkpoint prepared in fp32: the store's config.json said bf16 (copied), so "auto" loaded fp32 weights
    into a bf16 model: neither the fp32 nor the bf16 load of the original. Its config now names the dtype it holds."""
    out = thm.prepare(source, tmp_path / "store", thm.HybridMoEConfig(cpu_weight_dtype="int8", **GROUP), torch.float32)
    want = thm.from_pretrained(
        source, expert_budget=0.0, device="cpu", dtype=torch.float32, cpu_weight_dtype="int8", **GROUP
    )
    model = thm.from_pretrained(out, expert_budget=0.0, device="cpu")
    assert model.lm_head.weight.dtype == torch.float32
    assert torch.equal(_logits(model), _logits(want))


@pytest.mark.parametrize(
    "edit, message",
    [
        ("config", "config.json is missing or changed since the store was prepared; prepare the original again"),
        ("shard", "hybrid-moe-store-00001-of-00001.safetensors is missing or changed since the store was prepared"),
        ("marker", "holds prepared experts \\(\\*.qdata\\) but no hybrid_moe_store.json"),
    ],
)
def test_a_store_changed_after_preparing_is_refused(edit, message, source, tmp_path):
    """A store's experts were fused, quantised and sized for the config.json it was prepared from: an edited
    config.json (top-k 4 -> 2) loaded silently with other logits, a store without its marker failed with a
    message about per-expert tensors. Both are one line now, and so is a shard of another size."""
    out = thm.prepare(source, tmp_path / "store", thm.HybridMoEConfig(cpu_weight_dtype="int8", **GROUP))
    if edit == "config":
        text = (out / "config.json").read_text()  # one digit changed: the same size, only its bytes differ
        assert text.count('"num_experts_per_tok": 4') == 1
        (out / "config.json").write_text(text.replace('"num_experts_per_tok": 4', '"num_experts_per_tok": 2'))
    if edit == "shard":
        shard = out / "hybrid-moe-store-00001-of-00001.safetensors"
        shard.write_bytes(shard.read_bytes() + b"\0" * 8)
    if edit == "marker":
        (out / "hybrid_moe_store.json").unlink()
    with pytest.raises(InputError, match=message) as err:
        thm.from_pretrained(out, device="cpu")
    assert "\n" not in str(err.value)
