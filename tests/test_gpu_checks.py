"""benchmarks/gpu_checks.sh runs on a lent GPU machine whose minutes are few: an argument a benchmark refuses there
costs the lease a step (2026-11-28: a row name missing from gpu_decode.py's choices). Checked here, without a GPU."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_every_gpu_decode_step_of_gpu_checks_parses(tmp_path):
    every_step = dict.fromkeys(("TEST_S", "MAIN_S", "TUNED_S", "GRAPH_S", "PREFILL_S", "ISA_S", "PAPERS_S"), "1")
    env = {**os.environ, **every_step, "PARSE_ONLY": "1", "OUT": str(tmp_path)}
    done = subprocess.run(
        ["bash", "benchmarks/gpu_checks.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    said = done.stdout + done.stderr
    assert "usage:" not in said and "error:" not in said, said[-3000:]
    assert said.count("gpu_decode.py: arguments taken") == 4, said[-3000:]  # the main, tuned, prefill, papers steps


@pytest.mark.parametrize(
    "argv, message",
    [
        (["end_to_end.py", "--tokens", "1"], "argument --tokens: must be >= 2, got 1"),
        (["policy_bound.py", "--ratios", "0.5", "2"], "argument --ratios: must be in [0, 1], got 2"),
        (["policies.py", "--models", "nosuch"], "argument --models: invalid choice: 'nosuch'"),
    ],
)
def test_benchmarks_refuse_nonsense_counts_in_one_line(argv, message):
    """A benchmark given a count it cannot use stops at once with argparse's one line (the shared `cli.bounded`
    type), not with a traceback after minutes of checkpoint generation, or a table of nothing."""
    done = subprocess.run(
        [sys.executable, f"benchmarks/{argv[0]}", *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and not done.stdout, done.stdout
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr
