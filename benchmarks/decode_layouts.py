"""Two ways a CPU decode step reads its weights, each against the way it replaced, in one process, alternating
rounds, with weights cycled over --layers copies so that every read comes from DRAM:

- DeepSeek-V2-Lite's small dense int4 weights (attention projections and shared experts, 1-3 MB each) read by
  `hybrid_moe::matvecs` as separate tensors (4 KB pages: what the heap gives them) and after
  `host_memory.gather_on_huge_pages` (slabs on huge pages, what patching a CPU model does); on AVX-512 machines also
  laid out for the kernel's lanes (`quantize.lay_out`, on slabs), as a QuantizedLinear holds them where measured
  faster;
- the MLA absorbed attention of one decode step (16 heads, latent 512, 256 cached positions, bf16): in torch, compiled
  by Inductor (its products over the bf16 up-projection, the key rows transposed per head, as the step ran before the
  op), against the `hybrid_moe::latent_attention` op (ops/latent_attention.py) with the up-projection in bf16, and as
  `absorb` holds it in the int8 / int4 dense modes (key rows int8, value rows int8 / int4; on AVX-512 machines also
  with the key rows laid out for the kernel's lanes, as absorb holds them there);
- on AVX-512 machines, a decode token's routed int4 experts (6 of DeepSeek-V2-Lite's 64 a call, routing drawn anew each
  call, so they come from DRAM) row by row and laid out for the lanes (`quantize.lay_out_experts_`), as a CPU-only store
  holds them where measured faster.

    python benchmarks/decode_layouts.py [--layers 40] [--rounds 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from torch_hybrid_moe.cli import bounded
from torch_hybrid_moe.ops import cpu_kernel, host_memory
from torch_hybrid_moe.ops.latent_attention import lay_out_key_rows
from torch_hybrid_moe.ops.quantize import QuantizedWeight, lay_out, lay_out_experts_, quantize

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


def small_weights(layers: int) -> tuple[dict[str, Callable[[], object]], int]:
    """Each layout's pass over `layers` copies of the small weights, and the bytes a pass reads."""
    g = torch.Generator().manual_seed(0)
    weights = []
    for _ in range(layers):
        for n, k in SMALL:
            q = quantize(torch.randn(1, n, k, generator=g), 4, 64)
            weights.append((q.data[0].clone(), q.scale[0].clone()))  # fresh heap tensors, as a load leaves them
    layouts = {"4 KB pages": weights, "slabs": [(d.clone(), s.clone()) for d, s in weights]}
    if cpu_kernel.best_isa() == 2:
        layouts["laid out"] = [lay_out(d, s) for d, s in weights]
    for name in ("slabs", "laid out"):
        host_memory.gather_on_huge_pages([t for pair in layouts.get(name, []) for t in pair])
    x = {k: torch.randn(1, 1, k, dtype=torch.bfloat16) for _, k in SMALL}

    def reads(ws: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], object]:
        # packed int4 two columns a byte; laid out, 8 columns a 4-byte element of a panel's vector
        return lambda: [
            torch.ops.hybrid_moe.matvecs(x[d.shape[1] * (8 if d.dim() == 3 else 2)], [d], [s], [None]) for d, s in ws
        ]

    return {name: reads(ws) for name, ws in layouts.items()}, sum(d.nbytes + s.nbytes for d, s in weights)


def torch_form(
    query: torch.Tensor, latent: torch.Tensor, k_rot: torch.Tensor, up_k: torch.Tensor, up_v: torch.Tensor
) -> torch.Tensor:
    """The absorbed attention as torch products (the decode step's form before the op), for Inductor to compile."""
    q_nope, q_rot = query[:, :, 0].split([NOPE, ROT], dim=-1)
    q_latent = torch.bmm(up_k, q_nope.permute(1, 2, 0)).permute(2, 0, 1)  # [B, H, r]
    c, rot = latent[:, 0], k_rot[:, 0]
    scores = torch.baddbmm(torch.bmm(q_latent, c.transpose(1, 2)), q_rot, rot.transpose(1, 2)).float()
    probs = torch.softmax(scores * (NOPE + ROT) ** -0.5, dim=-1).to(c.dtype)
    return torch.bmm(up_v, torch.bmm(probs, c).permute(1, 2, 0)).permute(2, 0, 1)


def absorbed(layers: int) -> dict[str, Callable[[], object]]:
    """Passes of one decode step's absorbed attention over `layers` layers' up-projections, each way."""
    g = torch.Generator().manual_seed(1)
    query = torch.randn(1, HEADS, 1, NOPE + ROT, generator=g).bfloat16()
    latent = torch.randn(1, 1, POSITIONS, LATENT, generator=g).bfloat16()
    k_rot = torch.randn(1, 1, POSITIONS, ROT, generator=g).bfloat16()
    ups = [(torch.randn(HEADS, NOPE + V, LATENT, generator=g) * 0.05).bfloat16() for _ in range(layers)]
    compiled = torch.compile(torch_form)
    op = torch.ops.hybrid_moe.latent_attention
    scale = (NOPE + ROT) ** -0.5
    ways: dict[str, Callable[[], object]] = {}
    bf16 = [(up[:, :NOPE].transpose(1, 2).contiguous(), up[:, NOPE:]) for up in ups]
    ways["torch + Inductor"] = lambda: [compiled(query, latent, k_rot, k, v) for k, v in bf16]
    ways["op bf16"] = lambda: [op(query, latent, k_rot, k, None, v, None, None, scale) for k, v in bf16]
    for bits in (8, 4):
        held = []
        for keys, values in bf16:
            k = quantize(keys.flatten(0, 1).unsqueeze(0), 8, 64)
            v = quantize(values.flatten(0, 1).unsqueeze(0), bits, 64)
            held.append(tuple(t[0].unflatten(0, (HEADS, -1)) for t in (k.data, k.scale, v.data, v.scale)))
        ways[f"op int{bits}"] = lambda held=held: [op(query, latent, k_rot, *w, None, scale) for w in held]
        if lay_out_key_rows(*held[0][:2]) is not None:  # AVX-512: key rows laid out for the lanes, as absorb has them
            laid = [(*lay_out_key_rows(k, ks), v, vs) for k, ks, v, vs in held]
            ways[f"op int{bits} laid out"] = lambda laid=laid: [op(query, latent, k_rot, *w, None, scale) for w in laid]
    reference = compiled(query, latent, k_rot, *bf16[0]).float()
    got = op(query, latent, k_rot, bf16[0][0], None, bf16[0][1], None, None, scale)[:, 0].float()
    if not torch.allclose(got, reference, rtol=0.02, atol=0.02 * reference.abs().max().item()):
        raise SystemExit("decode_layouts: the op and the torch form gave different attention outputs")
    return ways


def routed_experts(calls: int) -> dict[str, Callable[[], object]]:
    """`calls` decode tokens' routed experts (DeepSeek-V2-Lite's layer, int4 in groups of 32), each layout; empty
    where the kernel has no lanes."""
    if cpu_kernel.best_isa() < 2:
        return {}
    g = torch.Generator().manual_seed(2)
    experts, hidden, inter, top_k = 64, 2048, 1408, 6
    rows = [
        quantize(torch.randn(experts, n, k, generator=g) * 0.02, 4, 32)
        for n, k in ((2 * inter, hidden), (hidden, inter))
    ]
    copies = [  # on huge pages where granted, as the rows
        QuantizedWeight(*(host_memory.empty(t.shape, t.dtype).copy_(t) for t in (w.data, w.scale)), 4, 32) for w in rows
    ]
    laid = [lay_out_experts_(w) for w in copies]
    x = torch.randn(1, hidden, generator=g).bfloat16()
    routing = [
        (torch.randperm(experts, generator=g)[:top_k].view(1, top_k), torch.rand(1, top_k, generator=g))
        for _ in range(calls)
    ]

    def tokens(gate_up: QuantizedWeight, down: QuantizedWeight) -> Callable[[], object]:
        def run() -> torch.Tensor:
            out = torch.zeros(1, hidden)
            for ids, weights in routing:
                torch.ops.hybrid_moe.cpu_experts(
                    x, ids, weights, gate_up.data, down.data, gate_up.scale, down.scale, out
                )
            return out

        return run

    ways = {"experts rows": tokens(*rows), "experts laid out": tokens(*laid)}
    reference = ways["experts rows"]()
    if not torch.allclose(ways["experts laid out"](), reference, rtol=1e-4, atol=1e-4 * reference.abs().max().item()):
        raise SystemExit("decode_layouts: the laid-out experts gave other products than their rows")
    return ways


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=bounded(int, 1), default=40, help="weight copies cycled through")
    parser.add_argument("--rounds", type=bounded(int, 1), default=4)
    parser.add_argument("--threads", type=bounded(int, 1), default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu_kernel.extension()  # the matvecs op's C++ kernel
    small, nbytes = small_weights(args.layers)
    ways = absorbed(args.layers)
    experts = routed_experts(args.layers)
    print(f"{args.threads} threads, {args.layers} layers' weights cycled, {time.strftime('%Y-%m-%d')}")
    print(
        f"{'round':>5} "
        + " ".join(f"{w + ' GB/s':>15}" for w in small)
        + " "
        + " ".join(f"{'MLA ' + w + ' ms':>22}" for w in ways)
        + " "
        + " ".join(f"{w + ' ms':>20}" for w in experts)
    )
    for r in range(args.rounds):
        reads = " ".join(f"{nbytes / seconds(f) / 1e9:>15.1f}" for f in small.values())
        mla = " ".join(f"{seconds(f) / args.layers * 1e3:>22.3f}" for f in ways.values())
        tokens = " ".join(f"{seconds(f) / args.layers * 1e3:>20.3f}" for f in experts.values())
        print(f"{r:>5} {reads} {mla} {tokens}")


if __name__ == "__main__":
    main()
