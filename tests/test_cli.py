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
    want = ref.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
    assert f"output: {' '.join(map(str, want))}" in out
    assert "decode:" in out and "tok/s" in out
    table = out[out.index("layer"):].splitlines()
    assert len(table) == 1 + 3  # header + three MoE layers


def test_eval_ppl_exact_mode_costs_nothing(capsys):
    assert main(["eval-ppl", "--max-tokens", "512", "--expert-budget", "0.5"]) == 0
    line = [l for l in capsys.readouterr().out.splitlines() if l.startswith("perplexity:")][0]
    unpatched, exact = float(line.split()[2]), float(line.split()[4])
    assert exact == pytest.approx(unpatched, rel=1e-5)
    assert 5 < unpatched < 100  # a trained model, far below the ~600 unigram perplexity
