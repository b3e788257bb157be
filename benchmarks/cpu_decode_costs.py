"""Fixed and per-byte costs of a CPU decode step, side by side in one run: dense linears through torch's GEMM and
through `hybrid_moe::matvecs` (the op a compiled decode step calls), one MoE layer step through the raw C++ kernel,
the `hybrid_moe::cpu_moe` op (what a compiled step calls for a layer with all experts on the CPU), the
`hybrid_moe::cpu_experts` op and the `hybrid_moe::dispatch` op (all experts on the CPU), and one token's attention
through torch's SDPA, the decode attention op's torch form compiled (its fallback where the kernel module cannot be
built: the same math in fp32) and the `hybrid_moe::decode_attention` op (model_patches/cpu_attention.py), in a static
cache filled or not. Medians,
interleaved; the CPU is printed.

Last, what one call of each costs cold, as a decode step makes it: after a pass over --flush-mb of other memory (the
weights the step streamed since that op's last call), which leaves the caches (code and operands alike) and, on 4 KB
pages, the TLBs holding other things; the pass is itself a threaded torch op, so the dispatcher's common path and
the OpenMP threads are warmer than in a step. Each round times a call cold, then again at once (hot). Back-to-back
timings (the sections above, and the route measurements at warm-up) do not see that cost; a token pays it at every
op boundary. Among those calls, greedy decoding's argmax over an LM head's row: torch's (as generate() takes it, on
an fp32 copy) and the `hybrid_moe::greedy_tokens` op (thm.greedy_generate's).

    python benchmarks/cpu_decode_costs.py [--threads 2] [--repeats 41] [--flush-mb 256]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import torch_hybrid_moe  # noqa: F401  (registers torch.ops.hybrid_moe)
from torch_hybrid_moe.cli import bounded
from torch_hybrid_moe.config import HybridMoEConfig
from torch_hybrid_moe.model_patches.cpu_attention import cpu_attention_forward
from torch_hybrid_moe.ops import cpu_kernel, host_memory, kernel_build
from torch_hybrid_moe.ops.decode_attention import decode_attention_math
from torch_hybrid_moe.runtime import ExpertStore, HybridMoELayer

# Qwen3-30B-A3B at decode: LM head, q / kv / o projections; its MoE layer: 128 experts of 2048 x 768, top-8
LINEARS = {"lm_head": (151936, 2048), "q_proj": (4096, 2048), "k_proj": (512, 2048), "o_proj": (2048, 4096)}
EXPERTS, HIDDEN, INTER, TOP_K = 128, 2048, 768, 8


def medians(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each run, taking turns (one warm-up round)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(repeats + 1):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            if round_:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _linear_times(n: int, k: int, repeats: int) -> tuple[dict[str, float], int]:
    """Medians of one token through an [n, k] bf16 linear: F.linear, the op, the op on 2 MB pages; and its bytes.
    Its weights are freed on return, before the next (an LM head is 0.6 GB)."""
    w = torch.empty(n, k, dtype=torch.bfloat16).normal_(0, 0.02)
    huge = host_memory.empty((n, k), torch.bfloat16).copy_(w)
    x = torch.randn(1, k, dtype=torch.bfloat16)
    runs = {
        "torch": lambda: F.linear(x, w),
        "op": lambda: torch.ops.hybrid_moe.matvecs(x, [w], [None], [None]),
        "huge": lambda: torch.ops.hybrid_moe.matvecs(x, [huge], [None], [None]),
    }
    return medians(runs, repeats), w.nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=bounded(int, 1), default=2)
    parser.add_argument("--repeats", type=bounded(int, 1), default=41)
    parser.add_argument("--flush-mb", type=bounded(int, 1), default=256, help="memory read between two cold calls")
    args = parser.parse_args()
    if args.flush_mb < 1 or args.repeats < 1 or args.threads < 1:
        parser.error("--threads, --repeats and --flush-mb must be positive")
    torch.set_num_threads(args.threads)
    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "unknown CPU")
    flags = sorted(
        {f for line in info if line.startswith("flags") for f in line.split() if f.startswith(("avx", "amx"))}
    )
    print(
        f"{cpu} ({' '.join(flags)}), {args.threads} threads, kernel ISA "
        f"{kernel_build.ISA_NAMES.get(cpu_kernel.best_isa(), 'none')}, {time.strftime('%Y-%m-%d')}"
    )

    # The op on the weight as torch allocates it (4 KB pages where THP is "madvise") and on 2 MB pages.
    print(
        f"\n{'bf16 linear, 1 token':<22} {'F.linear ms':>11} {'GB/s':>6} {'op ms':>8} {'GB/s':>6} "
        f"{'huge pages ms':>13} {'GB/s':>6}"
    )
    for name, (n, k) in LINEARS.items():
        t, nbytes = _linear_times(n, k, max(5, args.repeats // 8))
        print(
            f"{name + f' {n}x{k}':<22} "
            + " ".join(
                f"{t[r] * 1e3:>{width}.2f} {nbytes / t[r] / 1e9:>6.1f}"
                for r, width in (("torch", 11), ("op", 8), ("huge", 13))
            )
        )

    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, dtype=torch.bfloat16) * 0.02
    down = torch.randn(EXPERTS, HIDDEN, INTER, dtype=torch.bfloat16) * 0.02
    layer = HybridMoELayer(
        "bench",
        0,
        ExpertStore(gate_up, down, 0, torch.device("cpu"), torch.bfloat16),
        HybridMoEConfig(expert_budget=0.0),
    )
    hidden = torch.randn(1, HIDDEN, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    routing = [
        (torch.randperm(EXPERTS, generator=gen)[:TOP_K].view(1, TOP_K), torch.rand(1, TOP_K, generator=gen))
        for _ in range(16)
    ]  # other experts each call, so weights come from memory
    step = iter(range(10**9))

    def pick() -> tuple[torch.Tensor, torch.Tensor]:
        return routing[next(step) % len(routing)]

    t = medians(
        {
            "kernel": lambda: cpu_kernel.moe_experts(hidden, *pick(), gate_up, down, torch.zeros(1, HIDDEN)),
            "cpu_moe op": lambda: torch.ops.hybrid_moe.cpu_moe(hidden, *pick(), layer.handle),
            "cpu_experts op": lambda: torch.ops.hybrid_moe.cpu_experts(
                hidden, *pick(), gate_up, down, None, None, torch.zeros(1, HIDDEN)
            ),
            "dispatch op": lambda: torch.ops.hybrid_moe.dispatch(hidden, *pick(), layer.handle),
        },
        args.repeats,
    )
    print(f"\nMoE layer step, {EXPERTS} experts of {HIDDEN}x{INTER}, top-{TOP_K}, 1 token, all on the CPU:")
    for name, s in t.items():
        print(f"  {name:<15} {s * 1e3:7.3f} ms   +{(s - t['kernel']) * 1e3:.3f} ms over the kernel")

    small = (
        torch.randn(8, 64, 64),
        torch.randn(8, 64, 32),
        torch.randn(1, 64),
        torch.tensor([[1, 3]]),
        torch.rand(1, 2),
    )
    gu, dn, h, ids, wts = small
    t = medians(
        {
            "kernel": lambda: cpu_kernel.moe_experts(h, ids, wts, gu, dn, torch.zeros(1, 64)),
            "op": lambda: torch.ops.hybrid_moe.cpu_experts(h, ids, wts, gu, dn, None, None, torch.zeros(1, 64)),
        },
        args.repeats * 10,
    )
    print(
        f"\nop machinery on a tiny layer (8 experts of 64x32): kernel {t['kernel'] * 1e6:.0f} us, "
        f"op {t['op'] * 1e6:.0f} us"
    )

    # Attention of one decode token: 32 query heads over 4 key / value heads of 128 (bf16), in a static cache of
    # `length` positions whose first `filled` are written (generate() sizes the cache for the whole generation).
    module = torch.nn.Module()
    module.num_key_value_groups = 8
    compiled_math = torch.compile(decode_attention_math, fullgraph=True, dynamic=False)
    print("\nattention of one decode token (32 / 4 heads of 128), ms:")
    print(f"{'filled / cache':>16} {'SDPA':>7} {'torch form, compiled':>21} {'op':>7}")
    for filled, length in ((160, 160), (160, 1152), (1024, 1152)):
        q = torch.randn(1, 32, 1, 128, dtype=torch.bfloat16)
        k, v = (torch.randn(1, 4, length, 128, dtype=torch.bfloat16) for _ in range(2))
        mask = (torch.arange(length) < filled).view(1, 1, 1, length)
        t = medians(
            {
                "SDPA": lambda: sdpa_attention_forward(module, q, k, v, mask),
                "math": lambda: compiled_math(q, k, v, mask, 128**-0.5),
                "op": lambda: cpu_attention_forward(module, q, k, v, mask),
            },
            args.repeats,
        )
        print(f"{f'{filled} / {length}':>16} {t['SDPA'] * 1e3:7.3f} {t['math'] * 1e3:21.3f} {t['op'] * 1e3:7.3f}")

    # One call cold (after a pass over other memory), then hot (again at once), per op a decode step calls.
    router = torch.empty(EXPERTS, HIDDEN, dtype=torch.bfloat16).normal_(0, 0.02)
    x = torch.randn(1, HIDDEN, dtype=torch.bfloat16)
    no_tokens = x[:0]
    q = torch.randn(1, 32, 1, 128, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 4, 160, 128, dtype=torch.bfloat16) for _ in range(2))
    mask = torch.ones(1, 1, 1, 160, dtype=torch.bool)
    logits = torch.randn(1, LINEARS["lm_head"][0], dtype=torch.bfloat16)
    calls = {
        "torch.empty(2048)": lambda: torch.empty(HIDDEN),
        f"F.linear, router {EXPERTS}x{HIDDEN}": lambda: F.linear(x, router),
        "matvecs op, the same": lambda: torch.ops.hybrid_moe.matvecs(x, [router], [None], [None]),
        "matvecs op, 0 tokens": lambda: torch.ops.hybrid_moe.matvecs(no_tokens, [router], [None], [None]),
        "decode attention op, 160": lambda: torch.ops.hybrid_moe.decode_attention(q, k, v, mask, 128**-0.5),
        "argmax, LM head row (bf16)": lambda: logits.argmax(-1),
        "argmax of its fp32 copy": lambda: logits.float().argmax(-1),  # generate()'s greedy step
        "greedy_tokens op, the row": lambda: torch.ops.hybrid_moe.greedy_tokens(logits),
    }
    flush = torch.ones(args.flush_mb << 18)  # fp32: flush_mb MiB
    times: dict[str, dict[str, list[float]]] = {name: {"cold": [], "hot": []} for name in calls}
    flush_s = []
    for _ in range(args.repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            flush.sum()
            flush_s.append(time.perf_counter() - start)
            for kind in ("cold", "hot"):
                start = time.perf_counter()
                call()
                times[name][kind].append(time.perf_counter() - start)
    print(
        f"\none call, cold (after reading {args.flush_mb} MiB of other memory, at "
        f"{flush.nbytes / statistics.median(flush_s) / 1e9:.1f} GB/s) and hot (again at once), us:"
    )
    print(f"{'call':<30} {'hot':>7} {'cold':>7} {'cold - hot':>10}")
    for name, t in times.items():
        hot, cold = statistics.median(t["hot"]), statistics.median(t["cold"])
        print(f"{name:<30} {hot * 1e6:7.0f} {cold * 1e6:7.0f} {(cold - hot) * 1e6:10.0f}")


if __name__ == "__main__":
    main()
