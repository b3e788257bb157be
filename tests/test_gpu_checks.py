"""benchmarks/gpu_checks.sh runs on a lent GPU machine whose minutes are few: an argument a benchmark refuses there
costs the lease a step (2026-11-28: a row name missing from gpu_decode.py's choices). Checked here, without a GPU."""

import os
import shutil
import subprocess
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
