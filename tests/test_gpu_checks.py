"""benchmarks/gpu_checks.sh runs on a lent GPU machine whose minutes are few: an argument a benchmark refuses there
costs the lease a step (2026-11-28: a row name missing from gpu_decode.py's choices). Checked here, without a GPU."""

import functools
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def _script(name: str) -> ModuleType:
    """A benchmark script as a module (its main not run): parsed in this process, without a fresh torch import;
    once a process (policies.py registers a scheduler when imported)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_every_gpu_decode_step_of_gpu_checks_parses(tmp_path):
    every_step = dict.fromkeys(("TEST_S", "MAIN_S", "TUNED_S", "GRAPH_S", "PREFILL_S", "ISA_S", "PAPERS_S"), "1")
    env = {**os.environ, **every_step, "PARSE_ONLY": "1", "OUT": str(tmp_path)}
    done = subprocess.run(
        ["bash", "benchmarks/gpu_checks.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    lines = [shlex.split(line)[1:] for line in done.stderr.splitlines() if line.startswith("gpu_decode.py ")]
    said = done.stdout + done.stderr
    assert len(lines) == 4 and "error" not in said.lower(), said  # main, tuned, prefill, papers
    parse_args = _script("gpu_decode").parse_args
    for argv in lines:
        args = parse_args(argv)  # argparse's SystemExit fails the test on an argument gpu_decode.py refuses
        assert args.layers == 8 and args.graph == [True], argv
    assert [parse_args(argv).rows for argv in lines][1:] == [[], ["hybrid", "stream-8", "stream-16"], _PAPER_ROWS]
    with pytest.raises(SystemExit):  # the check refuses what gpu_decode.py refuses
        parse_args([*lines[0], "--rows", "nosuch"])


_PAPER_ROWS = ["dali", "hybrimoe", "all-cpu"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["end_to_end.py", "--tokens", "1"], "argument --tokens: must be >= 2, got 1"),
        (["policy_bound.py", "--ratios", "0.5", "2"], "argument --ratios: must be in [0, 1], got 2"),
        (["policies.py", "--models", "nosuch"], "argument --models: invalid choice: 'nosuch'"),
        # a row named twice was measured twice a round and pooled under "medians of R"
        (["end_to_end.py", "--rows", "ours,eager,ours"], "--rows names ['ours'] more than once"),
        (["end_to_end.py", "--rows", "llama-q8_0"], "no row left to run"),  # before a checkpoint is generated
        # no slots: every stack the same, so the targets could not fail
        (["policy_bound.py", "--ratios", "0", "0.5"], "a cache ratio of 0 leaves no slots"),
        (["policies.py", "--ratios", "0"], "a cache ratio of 0 leaves no slots"),
        (["policy_bound.py", "--traces", "deepseek-tiny", "--batches", "1", "17"], "--batches: at most 16"),
        (["policies.py", "--batches", "17"], "--batches: at most 16"),
        (["policy_bound.py", "--json", str(ROOT / "README.md")], "exists; remove it or give another name"),
        (["policies.py", "--json", str(ROOT / "no" / "dir" / "x.json")], "its directory does not exist"),
        (["end_to_end.py", "--json", str(ROOT)], "is a directory; give a file name"),
        (["decode_overhead.py", "--model", "nosuch"], "not an embedded model"),
    ],
)
def test_benchmarks_refuse_nonsense_counts_in_one_line(argv, message, monkeypatch, capsys):
    """A benchmark given a count it cannot use stops at once with argparse's one line (the shared `cli.bounded`
    type), not with a traceback after minutes of checkpoint generation, or a table of nothing. Run in this process:
    three fresh interpreters took ~8 s each to import torch and the package."""
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as stopped:
        _script(argv[0].removesuffix(".py")).main()
    said = capsys.readouterr()
    assert stopped.value.code == 2 and not said.out, said.out
    assert message in said.err and "Traceback" not in said.err, said.err


def test_a_failed_gguf_conversion_skips_its_row_and_says_why(monkeypatch, capsys, tmp_path):
    """llama.cpp's converter failing on one weight type drops that row, in one line with the converter's last
    words, and the others still run (a traceback ended the whole benchmark before)."""
    import subprocess

    script = _script("end_to_end")
    made = []

    def fake_gguf(path, kind, llama):
        if kind == "q4_0":
            raise subprocess.CalledProcessError(1, ["quantize"], stderr=b"loading\nllama_model_quantize: failed\n")
        made.append(kind)
        return path / f"model-{kind}.gguf"

    monkeypatch.setattr(script, "gguf_file", fake_gguf)
    rows = script.converted(["ours", "llama-q4_0", "llama-q8_0", "eager"], tmp_path, tmp_path)
    assert rows == ["ours", "llama-q8_0", "eager"] and made == ["q8_0"]
    assert capsys.readouterr().out == "llama-q4_0 skipped: its GGUF conversion failed: llama_model_quantize: failed\n"


def test_token_agreement_counts_the_common_prefix():
    """After the first difference two greedy runs continue different contexts: later matches are chance."""
    prefix = _script("end_to_end").common_prefix
    assert [prefix([1, 2, 3, 4], [1, 2, 3, 4]), prefix([1, 9, 3, 4], [1, 2, 3, 4]), prefix([5, 2, 3], [1, 2, 3])] == [
        4,
        1,
        0,
    ]


def test_spread_quartiles_lie_within_the_data():
    """Two rounds' exclusive quartiles extrapolated past the minimum and maximum."""
    assert _script("decode_profile").spread([1.0, 2.0], 1.0, 2) == "1.50 [1.25-1.75]"


@pytest.mark.parametrize("shape", ["deepseek-v2-lite", "mixtral-8x7b", "qwen3-30b-a3b"])
def test_a_decode_token_reads_every_weight_once_and_top_k_of_the_experts(shape, tmp_path):
    """end_to_end.py's floor: the bytes of a decode token of a checkpoint of each shape's architecture (tiny sizes),
    against its parameters counted one by one: the embedding table left out, routed experts top-k of E, bf16."""
    import torch
    import transformers

    script = _script("end_to_end")
    cls, kwargs = script.SHAPES[shape]
    small = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=2)
    small.update(
        {k: v for k, v in dict(moe_intermediate_size=32, kv_lora_rank=32, q_lora_rank=48).items() if k in kwargs}
    )
    small.update(
        dict(qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, head_dim=32) if "kv_lora_rank" in kwargs else {}
    )
    config = getattr(transformers, cls)(**{**kwargs, **small}, num_hidden_layers=2)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    experts = (
        getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or config.n_routed_experts
    )
    want = sum(
        p.numel() * 2 * (config.num_experts_per_tok / experts if ".experts." in name else 1)
        for name, p in model.named_parameters()
        if "embed_tokens" not in name
    )
    assert script.decode_bytes(tmp_path) == pytest.approx(want)
