"""CPU seconds of two simulator replays, for comparing checkouts: run it in each (`PYTHONPATH=CHECKOUT python
benchmarks/replay_time.py`), interleaved and repeated, and read the medians side by side. One thread, CPU time (the
box is shared). The replays: `hybrid-moe simulate` on the first 2 requests of the embedded Mixtral trace with fixed
ours settings (the foresight bound's stacks included), and every paper stack on `realistic_trace()` at batch 1,
ratio 0.5 on the rtx5090 preset. The last figure is the replays' summed tok/s: equal across checkouts whose replay
did not change."""

from __future__ import annotations

import contextlib
import io
import tempfile
import time
from pathlib import Path

import torch

import torch_hybrid_moe.embedded
from torch_hybrid_moe.cli import main
from torch_hybrid_moe.cost_model import EXPERT_SHAPES, HARDWARE, CostModel
from torch_hybrid_moe.simulator import STACKS
from torch_hybrid_moe.simulator.replay import simulate_runnable
from torch_hybrid_moe.simulator.synthetic import realistic_trace
from torch_hybrid_moe.traces import Trace


def cpu_seconds() -> tuple[float, float, float]:
    """(simulate CLI s, paper stacks s, their summed tok/s)."""
    trace = Trace.load(
        Path(torch_hybrid_moe.embedded.__file__).parent / "traces" / "mixtral-tiny-heldout-at0.safetensors"
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "two.safetensors"
        trace.select(trace.sequence < 2).save(path)
        start = time.process_time()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            main(["simulate", "--trace", str(path), "--ours", "2,1,0.5,0", "--json"])
        cli = time.process_time() - start
    realistic = realistic_trace()
    costs = CostModel(HARDWARE["rtx5090"], EXPERT_SHAPES["deepseek-v2-lite"])
    start = time.process_time()
    tok_s = sum(simulate_runnable(realistic, STACKS[name], costs, 1, 0.5)[1].decode_tok_s for name in STACKS)
    return cli, time.process_time() - start, tok_s


if __name__ == "__main__":
    torch.set_num_threads(1)
    cli, stacks, tok_s = cpu_seconds()
    print(f"simulate CLI {cli:.2f} s, paper stacks {stacks:.2f} s, summed tok/s {tok_s:.6f}")
