"""Two costs of the captured decode step that the cost profile does not take, timed on this GPU (issue 18, item 5:
the simulator over-predicts every hybrid stack, more the more it copies; benchmarks/RESULTS.md, 2026-11-27):

- a slot fill as the graph makes it: the row-copy kernel reading the expert's pinned host master through its
  device-mapped address (ops/row_copy.py), beside the copy engine's transfer of the same bytes (a cudaMemcpy from
  pinned memory: what the profile's `transfer_s` times);
- a layer step's CPU task round trip: the submit and sync host functions (ops/csrc/host_bridge.cpp) around a
  share with nothing to compute, and around one expert for one token;
- whether the CPU share and the fills compete for the host's memory: a share of --share experts, one token each,
  alone; fills of --share other experts alone; and both in one layer step as the graph runs it (submit, fills, sync).
  The CPU kernel reads an expert at about the host's copy rate (the fourth lease's profile: 17.3 MB in 0.25 ms, 69
  GB/s, on a host that copies at 76-80 GB/s), so a fill read over PCIe at the same time may slow both, which the
  simulator does not model (it treats the CPU and the link as separate resources).

Each is captured in one CUDA graph, --experts experts or --experts round trips in turn; medians of --repeats
replays. DeepSeek-V2-Lite's expert shape, bf16.

    python benchmarks/graph_costs.py [--experts 16] [--share 6] [--repeats 20]
"""

from __future__ import annotations

import argparse

import torch

from torch_hybrid_moe.cli import bounded
from torch_hybrid_moe.cost_model import EXPERT_SHAPES
from torch_hybrid_moe.ops.kernel_build import extension
from torch_hybrid_moe.ops.row_copy import copy_rows_, device_view
from torch_hybrid_moe.profiling import replay_seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=bounded(int, 1), default=16)
    p.add_argument("--repeats", type=bounded(int, 1), default=20)
    p.add_argument(
        "--share", type=bounded(int, 1), default=6, help="experts of the CPU share and of the fills beside it"
    )
    args = p.parse_args()
    if not 1 <= args.share <= args.experts // 2:
        raise SystemExit(f"--share must be 1 to --experts / 2 ({args.experts // 2}): the two sides take other experts")
    if not torch.cuda.is_available():
        raise SystemExit("graph_costs.py needs a CUDA GPU")
    ext = extension()
    if ext is None:
        raise SystemExit("graph_costs.py needs the C++ CPU kernel, which could not be built here")
    shape = EXPERT_SHAPES["deepseek-v2-lite"]
    n, h, i = args.experts, shape.hidden, shape.inter
    cuda = torch.device("cuda", 0)
    host = [torch.randn(n, *rows, dtype=torch.bfloat16).pin_memory() for rows in ((2 * i, h), (h, i))]
    slots = [torch.empty_like(t, device=cuda) for t in host]
    mapped = [device_view(t, cuda) for t in host]
    ids = torch.arange(n, device=cuda)

    def fills() -> None:
        for dst, src in zip(slots, mapped):
            copy_rows_(dst, ids, src, ids)

    def memcpys() -> None:
        for e in range(n):
            for dst, src in zip(slots, host):
                dst[e].copy_(src[e], non_blocking=True)

    nbytes = sum(t[0].numel() * t.element_size() for t in host)
    torch.cuda.synchronize()
    print(f"{torch.cuda.get_device_name(0)}; one expert {nbytes / 2**20:.1f} MiB (deepseek-v2-lite, bf16), {n} a graph")
    ways = (("row-copy kernel (the graph's fills)", fills), ("copy engine (the profile's transfer)", memcpys))
    for name, run in ways:
        for t in slots:
            t.zero_()
        s = replay_seconds(run, args.repeats) / n
        if not all(torch.equal(t.cpu(), h) for t, h in zip(slots, host)):  # a copy that moved nothing is no figure
            raise SystemExit(f"{name}: the slots do not hold the experts copied")
        print(f"{name:38s} {s * 1e6:8.1f} us an expert  {nbytes / s / 1e9:6.1f} GB/s")

    threads = torch.get_num_threads()
    for pairs, label in ((0, "nothing to compute"), (1, "one expert, one token")):
        hidden = torch.randn(1, h, dtype=torch.bfloat16).pin_memory()
        routed = torch.full((1, 6), -1, dtype=torch.int64).pin_memory()
        routed[0, :pairs] = 0
        weights = torch.ones(1, 6).pin_memory()
        out = torch.zeros(1, h).pin_memory()
        task = ext.CpuTask(hidden, routed, weights, host[0], None, host[1], None, out, threads)

        def round_trips(task: object = task) -> None:  # on the capturing stream, as graph_path launches them
            for _ in range(n):
                stream = torch.cuda.current_stream(cuda).cuda_stream
                task.launch_submit(stream)  # type: ignore[attr-defined]
                task.launch_sync(stream)  # type: ignore[attr-defined]

        s = replay_seconds(round_trips, args.repeats) / n
        print(f"CPU task round trip, {label:22s} {s * 1e6:8.1f} us ({threads} threads)")
        if error := ext.take_task_error():
            raise SystemExit(f"the CPU task failed: {error}")

    # the share: experts 0 .. k-1, one token each (k tokens, one pair each); the fills: experts k .. 2k-1
    k = args.share
    hidden = torch.randn(k, h, dtype=torch.bfloat16).pin_memory()
    routed = torch.full((k, 6), -1, dtype=torch.int64).pin_memory()
    routed[:, 0] = torch.arange(k)
    weights = torch.ones(k, 6).pin_memory()
    out = torch.zeros(k, h).pin_memory()
    task = ext.CpuTask(hidden, routed, weights, host[0], None, host[1], None, out, threads)
    others = torch.arange(k, 2 * k, device=cuda)

    def share() -> None:
        task.launch_submit(torch.cuda.current_stream(cuda).cuda_stream)  # type: ignore[attr-defined]
        task.launch_sync(torch.cuda.current_stream(cuda).cuda_stream)  # type: ignore[attr-defined]

    def other_fills() -> None:
        for dst, src in zip(slots, mapped):
            copy_rows_(dst, others, src, others)

    def both() -> None:  # a layer step: the CPU share runs between its submit and sync, the fills meanwhile
        task.launch_submit(torch.cuda.current_stream(cuda).cuda_stream)  # type: ignore[attr-defined]
        other_fills()
        task.launch_sync(torch.cuda.current_stream(cuda).cuda_stream)  # type: ignore[attr-defined]

    alone = {name: replay_seconds(run, args.repeats) for name, run in (("share", share), ("fills", other_fills))}
    together = replay_seconds(both, args.repeats)
    if error := ext.take_task_error():
        raise SystemExit(f"the CPU task failed: {error}")
    print(
        f"{k} experts on the CPU alone {alone['share'] * 1e6:8.1f} us; {k} fills alone {alone['fills'] * 1e6:8.1f} us; "
        f"both in one step {together * 1e6:8.1f} us = {together / max(alone.values()):.2f}x the slower alone "
        f"(1.00: no contention; {sum(alone.values()) / max(alone.values()):.2f}: one after the other)"
    )


if __name__ == "__main__":
    main()
