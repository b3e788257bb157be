"""DeepSeek-V2's rotary step at decode with and without the backend's complex-products pass
(compile_passes/complex_products.py), in one process, alternating rounds: DeepSeek-V2-Lite's 16 heads and rotary
width 64 with its yarn factors, --layers layers' query and key products on one step's factors, compiled by the
`hybrid_moe` backend with the C++ graph wrapper a CPU decode step uses. Both forms are checked against eager first.

    python benchmarks/rotary_products.py [--layers 27] [--rounds 12] [--calls 400] [--threads 2]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import DeepseekV2Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2RotaryEmbedding, apply_rotary_emb

import torch_hybrid_moe.compile_passes.backend as backend
from torch_hybrid_moe.cli import bounded

sys.path.insert(0, str(Path(__file__).parent))
from end_to_end import SHAPES

# DeepSeek-V2-Lite's shape as the end-to-end benchmark generates it, with the real checkpoint's rope scaling (its
# config.json), which the generated checkpoints leave out
LITE = {
    **SHAPES["deepseek-v2-lite"][1],
    "max_position_embeddings": 163840,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
}


def compiled_steps(layers: int) -> tuple[dict[str, Callable[..., object]], tuple[torch.Tensor, ...]]:
    """The step compiled with the pass ("on") and without ("off"), and its inputs."""
    config = DeepseekV2Config(**LITE)
    rotary = DeepseekV2RotaryEmbedding(config)
    g = torch.Generator().manual_seed(0)
    heads, rot = config.num_attention_heads, config.qk_rope_head_dim
    qs = [torch.randn(1, heads, 1, rot, generator=g).bfloat16() for _ in range(layers)]
    ks = [torch.randn(1, 1, 1, rot, generator=g).bfloat16() for _ in range(layers)]
    inputs = (torch.tensor([[200]]), *qs, *ks)

    def step(positions: torch.Tensor, *xs: torch.Tensor) -> list:
        freqs = rotary(xs[0], positions)
        return [apply_rotary_emb(q, k, freqs) for q, k in zip(xs[:layers], xs[layers:], strict=True)]

    want = step(*inputs)
    lower = backend.lower_complex_products
    steps = {}
    try:
        for arm in ("on", "off"):
            backend.lower_complex_products = lower if arm == "on" else (lambda gm: 0)
            code = step.__code__.replace(co_name=f"step_{arm}")  # its own code object: Dynamo caches per code
            fn = torch.compile(
                types.FunctionType(code, step.__globals__, code.co_name, None, step.__closure__),
                backend="hybrid_moe",
                options=dict(backend.CPU_DECODE_OPTIONS),
            )
            got = fn(*inputs)  # compiles now, with this arm's pass
            for pair, ref in zip(got, want, strict=True):
                for a, b in zip(pair, ref, strict=True):
                    torch.testing.assert_close(a, b)
            steps[arm] = fn
    finally:
        backend.lower_complex_products = lower
    return steps, inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=bounded(int, 1), default=27)
    parser.add_argument("--rounds", type=bounded(int, 2), default=12)
    parser.add_argument("--calls", type=bounded(int, 1), default=400)
    parser.add_argument("--threads", type=bounded(int, 1), default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with torch.no_grad():
        steps, inputs = compiled_steps(args.layers)
        times: dict[str, list[float]] = {"on": [], "off": []}
        for r in range(args.rounds):
            for arm in ("on", "off") if r % 2 == 0 else ("off", "on"):
                for _ in range(args.calls // 8):
                    steps[arm](*inputs)
                start = time.perf_counter()
                for _ in range(args.calls):
                    steps[arm](*inputs)
                times[arm].append((time.perf_counter() - start) / args.calls * 1e6)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
    print(
        f"{cpu or platform.machine()} ({torch.backends.cpu.get_cpu_capability()}), torch {torch.__version__}, "
        f"{args.threads} threads; "
        f"{args.layers} layers' rotary products a step, medians of {args.rounds} rounds of {args.calls} calls"
    )
    print(
        f"pass on {on:.1f} us [{min(times['on']):.1f}-{max(times['on']):.1f}], off {off:.1f} us "
        f"[{min(times['off']):.1f}-{max(times['off']):.1f}] a step: {(off - on) / args.layers:.2f} us a layer less"
    )


if __name__ == "__main__":
    main()
