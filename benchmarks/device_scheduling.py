"""What each scheduler's tensor form adds to a captured decode step: device ops per MoE layer step.

Inside a CUDA graph every aten op of the placement becomes a kernel node (a few microseconds each on the
device however small), so the figure that matters is the op count, side by side with the default
`cached_on_accelerator` form. Counted on this machine by dispatching the real `place` (and, for schedulers that
fetch, the slot assignment of their on-demand copies) on the CPU, for a DeepSeek-V2-Lite-shaped layer (64
experts, top-6, a quarter of them in slots) at several decode batch sizes, as the CUDA path runs it: DALI's and
HybriMoE's walks, ours' whole placement and the on-demand fetches' slot pairing each as one Triton program (its
launch and the ops around it). Where that differs, a second row counts the torch ops the CPU runs instead (a
dozen per expert for a walk: what a graph would hold without the programs).

    python benchmarks/device_scheduling.py [--batches 1 8 32] [--hardware rtx5090]
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torch_hybrid_moe.cli import bounded
from torch_hybrid_moe.cost_model import EXPERT_SHAPES, HARDWARE, CostModel
from torch_hybrid_moe.ops import placement_walks, slot_swaps
from torch_hybrid_moe.policies import SCHEDULERS, IdleLink, LayerInfo, device_caching, device_scheduling
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


class CountedLaunch:
    """Stands in for a Triton program's launch: one kernel node; its outputs (argument positions) zeroed outside
    the count."""

    def __init__(self, counter: OpCounter, *outputs: int) -> None:
        self.counter, self.outputs = counter, outputs

    def __getitem__(self, grid: tuple[int, ...]):
        def launch(*args: torch.Tensor, **kwargs: object) -> None:
            with torch.utils._python_dispatch._disable_current_modes():
                for i in self.outputs:
                    args[i].zero_()
            self.counter.ops += 1

        return launch


@contextlib.contextmanager
def as_on_cuda(counter: OpCounter) -> Iterator[None]:
    """Count what the CUDA paths launch: the walks (run uncounted, their launches counted), and ours' placement
    and the slot pairing through their own launchers, each program counted as one node."""
    originals = {name: getattr(device_scheduling, name) for name in WALK_OPS_ON_CUDA}

    def counted(name: str):
        def walk(*args: object) -> torch.Tensor:
            with torch.utils._python_dispatch._disable_current_modes():
                out = originals[name](*args)
            counter.ops += WALK_OPS_ON_CUDA[name]
            return out

        return walk

    def queue_place(*args: object) -> torch.Tensor:  # the form's arguments, its stand-in kernel replaced
        return placement_walks.queue_place(*args[:7], kernel=CountedLaunch(counter, 2))

    def swap_in(candidates, keep, values, expert_slot, slot_expert, k):
        return slot_swaps.swap_in(candidates, keep, values, slot_expert, k, kernel=CountedLaunch(counter, 4, 5))

    patches = [(device_scheduling, name, counted(name)) for name in originals]
    patches += [(device_scheduling, "queue_place", queue_place), (device_caching, "_swap_in", swap_in)]
    form = device_scheduling.QueueAwareForm  # takes its program only for CUDA tensors: made to take it here
    patches.append((form, "place", form.place_in_one_program))
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, value in patches:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


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
    with OpCounter() as counter, as_on_cuda(counter) if cuda else contextlib.nullcontext():
        resident = expert_slot >= 0
        on = form.place(counts, resident, SLOTS, max_active)
        if form.fetches:
            fetch_admissions(on & (expert_slot < 0), on, values, expert_slot, slot_expert, min(SLOTS, ids.numel()))
    return counter.ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=bounded(int, 1), nargs="+", default=[1, 8, 32])
    p.add_argument("--hardware", default="rtx5090", choices=sorted(HARDWARE))
    args = p.parse_args()
    costs = CostModel(HARDWARE[args.hardware], EXPERT_SHAPES["deepseek-v2-lite"])
    print(
        f"device ops per MoE layer step (placement + on-demand slot assignment), {EXPERTS} experts, top-{TOP_K}, "
        f"{SLOTS} slots"
    )
    print(f"{'scheduler':34s}" + "".join(f"{f'batch {b}':>18s}" for b in args.batches))
    base = {b: ops_per_step("cached_on_accelerator", costs, b, cuda=True) for b in args.batches}
    for name in SCHEDULERS.graph_names():
        counts = {cuda: [ops_per_step(name, costs, b, cuda) for b in args.batches] for cuda in (False, True)}
        # torch ops: what a graph would hold without the Triton programs (the CPU runs them so)
        rows = [(f"{name} (torch ops)", counts[False])] if counts[False] != counts[True] else []
        for label, cells in [*rows, (name, counts[True])]:
            print(
                f"{label:34s}" + "".join(f"{f'{n:6d} ({n / base[b]:5.1f}x)':>18s}" for n, b in zip(cells, args.batches))
            )


if __name__ == "__main__":
    main()
