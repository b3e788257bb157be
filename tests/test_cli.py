"""`hybrid-moe generate` end to end on a tiny model, against the unpatched model's own generate()."""

import pytest
import torch

from torch_hybrid_moe.cli import _prompt_ids, main
from torch_hybrid_moe.tiny_models import tiny_model


def test_generate_prints_reference_tokens_and_stats(capsys):
    assert main(["generate", "--model", "tiny:mixtral", "--max-new-tokens", "6", "--expert-budget", "0.5"]) == 0
    out = capsys.readouterr().out
    ref = tiny_model("mixtral")
    ids = _prompt_ids(None, "def fibonacci(n):", ref.config.vocab_size)
    want = ref.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1] :].tolist()
    assert f"output: {' '.join(map(str, want))}" in out
    assert "decode:" in out and "tok/s" in out
    table = out[out.index("layer") :].splitlines()
    assert len(table) == 1 + 3  # header + three MoE layers


def test_generate_that_ends_at_its_first_token_prints_no_decode_rate(capsys):
    """The prompt "2f" makes tiny:mixtral's first token an end token: no decode step ran, so no rate (it printed
    0.0 tok/s) and no decode compile."""
    assert main(["generate", "--model", "tiny:mixtral", "--prompt", "2f", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    ref = tiny_model("mixtral")
    ids = _prompt_ids(None, "2f", ref.config.vocab_size)
    assert ref.generate(ids, max_new_tokens=8, do_sample=False).shape[1] == ids.shape[1] + 1  # the premise
    assert "decode: none (an end token came first)" in out and "warm-up: " in out
    assert "decode: none" in out and "decode: 0.0" not in " ".join(out.split())


def test_eval_ppl_exact_mode_costs_nothing(capsys):
    assert main(["eval-ppl", "--max-tokens", "512", "--expert-budget", "0.5"]) == 0
    line = [l for l in capsys.readouterr().out.splitlines() if l.startswith("perplexity:")][0]
    unpatched, exact = float(line.split()[2]), float(line.split()[4])
    assert exact == pytest.approx(unpatched, rel=1e-5)
    assert 5 < unpatched < 100  # a trained model, far below the ~600 unigram perplexity


@pytest.mark.slow
def test_eval_ppl_labels_bf16_experts_of_a_bf16_checkpoint_exact(tmp_path, capsys):
    """With --dtype auto a bf16 checkpoint computes in bf16, so bf16 expert copies round nothing: the label says exact
    (it said approximate, comparing the option with "auto")."""
    from torch_hybrid_moe.embedded import load_model

    model, tokenizer = load_model("deepseek-tiny", torch.float32)
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    argv = ["eval-ppl", "--model", str(tmp_path), "--max-tokens", "256", "--cpu-weight-dtype", "bfloat16"]
    assert main(argv) == 0
    line = [l for l in capsys.readouterr().out.splitlines() if l.startswith("model ")][0]
    assert " mode exact " in line
    assert main([*argv[:-1], "int8"]) == 0
    assert "mode approximate (int8 experts)" in capsys.readouterr().out


@pytest.mark.slow
def test_generate_defaults_fit_the_checkpoint_and_the_machine(tmp_path, capsys):
    """A bf16 checkpoint stays bf16 (dtype auto) and continues the prompt as transformers does; the prompt is
    stretched with --prompt-tokens and its length printed beside the prefill figure; start-up phases are announced
    with their times; without CUDA a budget buys nothing, so a given one comes with a note saying why."""
    from torch_hybrid_moe.embedded import load_model

    model, tokenizer = load_model("deepseek-tiny", torch.float32)
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    argv = ["generate", "--model", str(tmp_path), "--max-new-tokens", "3", "--prompt-tokens", "40"]
    assert main([*argv, "--expert-budget", "0.25", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert "dtype torch.bfloat16" in captured.out and "(40-token prompt;" in captured.out
    assert f"loading {tmp_path}: " in captured.err and "warm-up generate (compiles the decode step): " in captured.err
    assert "without CUDA the CPU stands in for the accelerator" in captured.err
    # the tokens: the unpatched checkpoint's own greedy continuation of the same stretched prompt
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    ids = _prompt_ids(tokenizer, "def fibonacci(n):", ref.config.vocab_size)
    ids = ids.repeat(1, -(-40 // ids.shape[1]))[:, :40]
    want = ref.generate(ids, max_new_tokens=3, do_sample=False)[0, 40:]
    assert f"output: {tokenizer.decode(want, skip_special_tokens=True)}\n" in captured.out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only default")
def test_expert_budget_defaults_to_zero_without_cuda():
    import argparse

    from torch_hybrid_moe.cli import _config

    args = argparse.Namespace(
        expert_budget=None,
        device="auto",
        cpu_weight_dtype="model",
        cpu_weight_group_size=None,
        dense_weight_dtype="model",
        stack=None,
    )
    assert _config(args).expert_budget == 0.0
    assert _config(argparse.Namespace(**{**vars(args), "expert_budget": 0.5})).expert_budget == 0.5
    # the group reaches the config where something is quantised: the dense layers with model-dtype experts too
    for fields in ({"cpu_weight_dtype": "int4"}, {"dense_weight_dtype": "int8"}):
        grouped = argparse.Namespace(**{**vars(args), **fields, "cpu_weight_group_size": 32})
        assert _config(grouped).cpu_weight_group_size == 32


def test_build_command_reports_the_kernel(capsys):
    from torch_hybrid_moe.ops import cpu_kernel, kernel_build

    if cpu_kernel.best_isa() < 0:
        pytest.skip("no C++ compiler here")
    assert main(["build"]) == 0
    assert f"(ISA level {kernel_build.ISA_NAMES[cpu_kernel.best_isa()]})" in capsys.readouterr().out
