"""Loading a real-size checkpoint into the hybrid runtime, side by side: transformers' `from_pretrained` followed by
`patch_model`, against our streaming loader (`torch_hybrid_moe.from_pretrained`) in each host format, and against
loading a prepared store (`thm.prepare`: experts already in the host format, written once beside the checkpoint
before the runs, not timed) and llama.cpp's GGUF files of the same weights (Q8_0 / Q4_0 experts read as int8 /
int4; converted once with --llama-cpp, not timed). Load time, the bytes the row reads over it (GB/s), peak RSS,
and the issue's memory bound: peak RSS <= 1.15 x (host store + dense weights) + the RSS before loading.

Checkpoints are generated once (random bf16 weights at a real model's layer shape, `save_pretrained`: the
per-expert key layout of the hub's files) by end_to_end.py's `checkpoint`, under --cache. Each row runs in a fresh
process (its peak RSS is its own), rows take turns over --repeats rounds, and the medians are printed. The page
cache is warm after the first round (a process cannot drop it here), so the rates are those of reading from memory:
what conversion and copying cost, not the disk.

    python benchmarks/loading.py --shape qwen3-30b-a3b --layers 4 [--rows transformers,ours,ours-int8,ours-int4]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from end_to_end import SHAPES, checkpoint, gguf_file, own_kib

from torch_hybrid_moe.cli import bounded

ROWS = ("transformers", "ours", "ours-int8", "ours-int4", "prepared-int8", "prepared-int4", "gguf-q8_0", "gguf-q4_0")
BOUND = 1.15  # peak RSS over (final host store + dense weights) + the RSS before loading


def held_bytes(model: object) -> int:
    """Host bytes the loaded model holds: its parameters and buffers plus every layer's expert store, each tensor
    once and by its own size (a memory-mapped embedding's storage is the whole checkpoint file)."""
    import torch

    from torch_hybrid_moe.ops.quantize import QuantizedWeight
    from torch_hybrid_moe.runtime import model_layers

    seen: dict[int, int] = {}
    tensors = [*model.parameters(), *model.buffers()]
    for layer in model_layers(model).values():
        for weight in (layer.store.host_gate_up, layer.store.host_down):
            tensors += [weight.data, weight.scale] if isinstance(weight, QuantizedWeight) else [weight]
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.nbytes)
    return sum(seen.values())


def child(row: str, path: Path, threads: int) -> None:
    """One load in this process; prints one JSON line."""
    import torch

    import torch_hybrid_moe as thm

    torch.set_num_threads(threads)
    before = own_kib("VmRSS")
    start = time.perf_counter()
    fmt = row.rsplit("-", 1)[1] if row.startswith(("ours-", "prepared-")) else "model"  # GGUF: the file's own
    config = thm.HybridMoEConfig(expert_budget=0.0, device="cpu", cpu_weight_dtype=fmt)
    if row == "transformers":
        from transformers import AutoModelForCausalLM

        model = thm.patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), config)
    elif row.startswith(("prepared", "gguf")):
        model = thm.from_pretrained(source(path, row), config, dtype=torch.bfloat16)
    else:
        model = thm.from_pretrained(path, config, dtype=torch.bfloat16)
    seconds = time.perf_counter() - start
    peak = own_kib("VmHWM")  # this process's own peak (ru_maxrss would carry the parent's across fork and exec)
    held = held_bytes(model)
    print(
        json.dumps(
            {"seconds": seconds, "peak_gb": peak * 1024 / 1e9, "before_gb": before * 1024 / 1e9, "held_gb": held / 1e9}
        )
    )


def source(path: Path, row: str) -> Path:
    """What row `row` loads: the checkpoint, its prepared store beside it, or its GGUF file in it."""
    if row.startswith("prepared"):
        return path.with_name(f"{path.name}-{row}")
    return path / f"model-{row.removeprefix('gguf-')}.gguf" if row.startswith("gguf") else path


def source_bytes(path: Path) -> int:
    files = [path] if path.is_file() else path.glob("*.safetensors")
    return sum(f.stat().st_size for f in files)


def measure(row: str, path: Path, threads: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", row, "--path", str(path), "--threads", str(threads)],
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise RuntimeError(f"{row}: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=bounded(int, 1), default=4)
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--repeats", type=bounded(int, 1), default=3)
    p.add_argument("--threads", type=bounded(int, 1), default=2)
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "torch_hybrid_moe" / "checkpoints")
    p.add_argument("--llama-cpp", type=Path, help="a llama.cpp tree built with CMake: converts the GGUF rows' files")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.path, args.threads)
        return
    rows = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown or not rows:
        p.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    if args.repeats < 1 or args.layers < 1:
        p.error("--repeats and --layers must be at least 1")
    path = checkpoint(args.shape, args.layers, args.cache)
    size = source_bytes(path)
    for row in list(rows):  # prepared or converted once, untimed: what a user does before the first start
        if row.startswith("prepared") and not source(path, row).is_dir():
            import torch_hybrid_moe as thm

            config = thm.HybridMoEConfig(cpu_weight_dtype=row.removeprefix("prepared-"))
            thm.prepare(path, source(path, row), config, dtype="bfloat16")
        if row.startswith("gguf") and not source(path, row).is_file():
            if args.llama_cpp is None:
                print(f"{row}: skipped: no {source(path, row).name} yet; pass --llama-cpp to convert it")
                rows.remove(row)
                continue
            gguf_file(path, row.removeprefix("gguf-"), args.llama_cpp)
    runs: dict[str, list[dict]] = {r: [] for r in rows}
    for _ in range(args.repeats):
        for row in rows:
            try:
                runs[row].append(measure(row, path, args.threads))
            except RuntimeError as err:
                print(f"{row}: failed: {err}", flush=True)
    print(
        f"{args.shape}, {args.layers} layers: {size / 1e9:.2f} GB of safetensors; {platform.processor() or ''} "
        f"{args.threads} threads; medians of {args.repeats}, {time.strftime('%Y-%m-%d')}"
    )
    print(
        f"{'row':14s} {'load s':>8s} {'(spread)':>14s} {'GB/s':>6s} {'peak RSS GB':>12s} {'held GB':>8s} "
        f"{'before GB':>10s} {'peak/bound':>10s}"
    )
    results = {}
    for row, rs in runs.items():
        if not rs:
            continue
        s, read = [r["seconds"] for r in rs], source_bytes(source(path, row))
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        bound = BOUND * med["held_gb"] + med["before_gb"]
        results[row] = {
            **med,
            "spread_s": [min(s), max(s)],
            "gb_s": read / 1e9 / med["seconds"],
            "peak_over_bound": med["peak_gb"] / bound,
        }
        r = results[row]
        print(
            f"{row:14s} {r['seconds']:8.2f} {f'{min(s):.2f}-{max(s):.2f}':>14s} {r['gb_s']:6.2f} "
            f"{r['peak_gb']:12.2f} {r['held_gb']:8.2f} {r['before_gb']:10.2f} {r['peak_over_bound']:10.2f}"
        )
    if args.json:
        print(json.dumps({"shape": args.shape, "layers": args.layers, "checkpoint_gb": size / 1e9, "rows": results}))


if __name__ == "__main__":
    main()
