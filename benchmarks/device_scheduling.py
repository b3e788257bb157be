"""What each scheduler's tensor form adds to a captured decode step: device ops per MoE layer step.

Inside a CUDA graph every aten op of the placement becomes a kernel node (a few microseconds each on the
device however small), so the figure that matters is the op count, side by side with the default
`cached_on_accelerator` form. Counted on this machine by dispatching the real `place` (and, for schedulers that
fetch, the slot assignment of their on-demand copies) on the CPU, for a DeepSeek-V2-Lite-shaped layer (64
experts, top-6, a quarter of them in slots) at several decode batch sizes. DALI's and HybriMoE's sequential
walks and ours' local search are counted twice: as the CPU's torch loop (a dozen ops per expert, what a graph
would hold without the kernel) and as on CUDA, where one Triton program walks the list (the launch and its
buffers).

    python benchmarks/device_scheduling.py [--batches 1 8 32] [--hardware rtx5090]
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torch_hybrid_moe.cost_model import EXPERT_SHAPES, HARDWARE, CostModel
from torch_hybrid_moe.policies import SCHEDULERS, IdleLink, LayerInfo, device_scheduling
from torch_hybrid_moe.policies.device_caching import fetch_admissions

EXPERTS, TOP_K, SLOTS = 64, 6, 16


# What a walk costs on CUDA (placement_walks): the int8 copy of `resident`, the output buffer, the launch, the
# bool view of the result, and for HybriMoE the float64 scalar of the copy time.
WALK_OPS_ON_CUDA = {"dali_walk": 4, "hybrimoe_walk": 5}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it (views included: they are cheap, but a graph records them)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def walks_as_on_cuda(counter: OpCounter) -> Iterator[None]:
    """Run the walks uncounted and count what their CUDA form launches instead."""
    originals = {name: getattr(device_scheduling, name) for name in WALK_OPS_ON_CUDA}

    def counted(name: str):
        def walk(*args: object) -> torch.Tensor:
            with torch.utils._python_dispatch._disable_current_modes():
                out = originals[name](*args)
            counter.ops += WALK_OPS_ON_CUDA[name]
            return out

        return walk

    for name in originals:
        setattr(device_scheduling, name, counted(name))
    try:
        yield
    finally:
        for name, walk in originals.items():
            setattr(device_scheduling, name, walk)


class CountedLaunch:
    """Stands in for a Triton program's launch: one kernel node; its outputs zeroed outside the count."""

    def __init__(self, counter: OpCounter, output: int) -> None:
        self.counter, self.output = counter, output

    def __getitem__(self, grid: tuple[int, ...]):
        def launch(*args: object, **kwargs: object) -> None:
            with torch.utils._python_dispatch._disable_current_modes():
                args[self.output].zero_()
            self.counter.ops += 1

        return launch


def ops_per_step(name: str, costs: CostModel, tokens: int, cuda: bool) -> int:
    python = SCHEDULERS.create(name, info=LayerInfo(0, EXPERTS, SLOTS, 1), costs=costs, timeline=IdleLink())
    form = SCHEDULERS.tensor_form(name)(python)
    torch.manual_seed(0)
    ids = torch.stack([torch.randperm(EXPERTS)[:TOP_K] for _ in range(tokens)])
    counts = torch.bincount(ids.flatten(), minlength=EXPERTS).float()
    expert_slot = torch.full((EXPERTS,), -1)
    expert_slot[:SLOTS] = torch.arange(SLOTS)
    slot_expert, values = torch.arange(SLOTS), torch.rand(EXPERTS)
    max_active = min(EXPERTS, ids.numel())
    with OpCounter() as counter, walks_as_on_cuda(counter) if cuda else contextlib.nullcontext():
        resident = expert_slot >= 0
        if cuda and isinstance(form, device_scheduling.QueueAwareForm):  # its CUDA path: one program
            on = form.place_in_one_program(counts, resident, SLOTS, max_active, CountedLaunch(counter, output=2))
        else:
            on = form.place(counts, resident, SLOTS, max_active)
        if form.fetches:
            fetch_admissions(on & (expert_slot < 0), on, values, expert_slot, slot_expert, min(SLOTS, ids.numel()))
    return counter.ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--hardware", default="rtx5090", choices=sorted(HARDWARE))
    args = p.parse_args()
    costs = CostModel(HARDWARE[args.hardware], EXPERT_SHAPES["deepseek-v2-lite"])
    print(
        f"device ops per MoE layer step (placement + on-demand slot assignment), {EXPERTS} experts, top-{TOP_K}, "
        f"{SLOTS} slots"
    )
    print(f"{'scheduler':34s}" + "".join(f"{f'batch {b}':>18s}" for b in args.batches))
    base = {b: ops_per_step("cached_on_accelerator", costs, b, cuda=False) for b in args.batches}
    for name in SCHEDULERS.graph_names():
        walks = name in ("dali_greedy", "hybrimoe", "queue_aware")
        for cuda in (False, True) if walks else (False,):
            cells = []
            for b in args.batches:
                n = ops_per_step(name, costs, b, cuda)
                cells.append(f"{n:6d} ({n / base[b]:5.1f}x)")
            label = name + ((" (CUDA: walk kernel)" if cuda else " (torch loop)") if walks else "")
            print(f"{label:34s}" + "".join(f"{c:>18s}" for c in cells))


if __name__ == "__main__":
    main()
