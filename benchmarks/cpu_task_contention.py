"""Does a thread spinning on one core slow a CPU expert task whose team wants every core?

While a CUDA graph runs, the Python thread waits for the GPU by spinning on a core (CUDA's default with one
context), and the layer's CPU task runs on the worker thread with `HybridMoEConfig.cpu_threads` threads. This
times one decode-sized task (6 DeepSeek-V2-Lite experts, bf16, one token, a 2 ms gap between tasks as between
layers) with all cores and with one fewer, with and without a spinning process: side by side, medians.

    python benchmarks/cpu_task_contention.py [--runs 80]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from torch_hybrid_moe.cli import bounded
from torch_hybrid_moe.ops import cpu_kernel

EXPERTS, HIDDEN, INTER, TOP_K = 8, 2048, 1408, 6


def task_ms(threads: int, runs: int) -> float:
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN) * 0.02).bfloat16()
    down = (torch.randn(EXPERTS, HIDDEN, INTER) * 0.02).bfloat16()
    task = cpu_kernel.extension().CpuTask(
        torch.randn(1, HIDDEN).bfloat16(),
        torch.arange(TOP_K).view(1, TOP_K),
        torch.rand(1, TOP_K),
        gate_up,
        None,
        down,
        None,
        torch.zeros(1, HIDDEN),
        threads,
    )
    times = []
    for i in range(runs + 3):  # 3 warm-up runs
        start = time.perf_counter()
        task.submit()
        task.wait()
        if i >= 3:
            times.append(time.perf_counter() - start)
        time.sleep(0.002)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=bounded(int, 1), default=80)
    args = p.parse_args()
    if cpu_kernel.extension() is None:
        raise SystemExit("needs the C++ CPU kernel")
    cores = torch.get_num_threads()
    print(f"{os.cpu_count()} CPUs, torch threads {cores}; median of {args.runs} tasks")
    for spin in (False, True):
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if spin else None
        time.sleep(0.5)
        try:
            full, fewer = task_ms(cores, args.runs), task_ms(max(1, cores - 1), args.runs)
        finally:
            if spinner:
                spinner.kill()
        print(
            f"spinner {'on ' if spin else 'off'}: {cores} threads {full:6.2f} ms, {max(1, cores - 1)} threads "
            f"{fewer:6.2f} ms (ratio {full / fewer:.2f})"
        )


if __name__ == "__main__":
    main()
