"""Two memory layouts a CPU decode step reads its weights in, each against the layout it replaced, in one process,
alternating rounds, with weights cycled over --layers copies so that every read comes from DRAM:

- DeepSeek-V2-Lite's small dense int4 weights (attention projections and shared experts, 1-3 MB each) read by
  `hybrid_moe::matvecs` as separate tensors (4 KB pages: what the heap gives them) and after
  `host_memory.gather_on_huge_pages` (slabs on huge pages, what patching a CPU model does);
- the MLA absorbed attention (`model_patches/latent_attention.absorbed_attention`, compiled; 16 heads, latent 512,
  256 cached positions, bf16) with the up-projection's key rows as stored in kv_b_proj (a strided view) and as
  `absorb` holds them (transposed per head, contiguous).

    python benchmarks/decode_layouts.py [--layers 40] [--rounds 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
import types
from collections.abc import Callable

import torch

from torch_hybrid_moe.cli import bounded
from torch_hybrid_moe.model_patches import latent_attention
from torch_hybrid_moe.ops import cpu_kernel, host_memory
from torch_hybrid_moe.ops.quantize import quantize

SMALL = [(1536, 2048), (3072, 1536), (2048, 2048), (5632, 2048), (2048, 2816)]  # q_a, q_b, o, shared gate_up, down
HEADS, NOPE, ROT, V, LATENT, POSITIONS = 16, 128, 64, 128, 512, 256


def seconds(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def small_weights(layers: int) -> tuple[Callable[[], object], Callable[[], object], int]:
    """Both layouts' passes over `layers` copies of the small weights, and the bytes a pass reads."""
    g = torch.Generator().manual_seed(0)
    weights = []
    for _ in range(layers):
        for n, k in SMALL:
            q = quantize(torch.randn(1, n, k, generator=g), 4, 64)
            weights.append((q.data[0].clone(), q.scale[0].clone()))  # fresh heap tensors, as a load leaves them
    gathered = [(d.clone(), s.clone()) for d, s in weights]
    host_memory.gather_on_huge_pages([t for pair in gathered for t in pair])
    x = {k: torch.randn(1, 1, k, dtype=torch.bfloat16) for _, k in SMALL}

    def reads(ws: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], object]:
        # packed int4: two columns a byte
        return lambda: [torch.ops.hybrid_moe.matvecs(x[d.shape[1] * 2], [d], [s], [None]) for d, s in ws]

    return reads(weights), reads(gathered), sum(d.nbytes + s.nbytes for d, s in weights)


def absorbed(layers: int) -> tuple[Callable[[], object], Callable[[], object]]:
    """Both layouts' passes of the compiled absorbed attention over `layers` modules."""
    g = torch.Generator().manual_seed(1)
    as_stored, transposed = [], []
    for _ in range(layers):
        up = (torch.randn(HEADS, NOPE + V, LATENT, generator=g) * 0.05).bfloat16()
        stored = up[:, :NOPE].transpose(1, 2)  # a strided view: the rows as kv_b_proj stores them
        for keys, kept in ((stored, as_stored), (stored.contiguous(), transposed)):
            module = types.SimpleNamespace(qk_nope_head_dim=NOPE)
            setattr(module, latent_attention.UP_K, keys)
            setattr(module, latent_attention.UP_V, up[:, NOPE:])
            kept.append(module)
    query = torch.randn(1, HEADS, 1, NOPE + ROT, generator=g).bfloat16()
    latent = torch.randn(1, 1, POSITIONS, LATENT, generator=g).bfloat16()
    k_rot = torch.randn(1, 1, POSITIONS, ROT, generator=g).bfloat16()
    mask = torch.ones(1, 1, 1, POSITIONS, dtype=torch.bool)
    step = torch.compile(lambda m: latent_attention.absorbed_attention(m, query, latent, k_rot, mask, None)[0])
    if not torch.equal(step(as_stored[0]), step(transposed[0])):
        raise SystemExit("decode_layouts: the two layouts gave different attention outputs")
    return (lambda: [step(m) for m in as_stored]), (lambda: [step(m) for m in transposed])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=bounded(int, 1), default=40, help="weight copies cycled through")
    parser.add_argument("--rounds", type=bounded(int, 1), default=4)
    parser.add_argument("--threads", type=bounded(int, 1), default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu_kernel.extension()  # the matvecs op's C++ kernel
    scattered, gathered, nbytes = small_weights(args.layers)
    stored, contiguous = absorbed(args.layers)
    print(f"{args.threads} threads, {args.layers} layers' weights cycled, {time.strftime('%Y-%m-%d')}")
    print(f"{'round':>5} {'4 KB pages GB/s':>15} {'slabs GB/s':>10} {'MLA keys as stored ms':>21} {'transposed':>10}")
    for r in range(args.rounds):
        a, b = nbytes / seconds(scattered) / 1e9, nbytes / seconds(gathered) / 1e9
        c, d = (seconds(f) / args.layers * 1e3 for f in (stored, contiguous))
        print(f"{r:>5} {a:>15.1f} {b:>10.1f} {c:>21.3f} {d:>10.3f}")


if __name__ == "__main__":
    main()
