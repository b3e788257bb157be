"""Which CPU-placed experts of a prefill step to stream through the accelerator's staging ring instead.

A prompt routes hundreds of tokens to most experts of a layer, and the CPU's time for an expert grows with its
tokens while its copy over the link does not. So a step's heaviest CPU experts are cheaper copied to the
accelerator and computed there, one ring buffer at a time, while the CPU computes the rest at the same time.
The ring leaves the cache's slots alone: a prompt's experts are not a forecast of the decode's.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..cost_model import CostModel


def streaming_makespan(
    counts: Sequence[int], streamed: Sequence[int], cpu: Sequence[int], accelerator: Sequence[int], costs: CostModel
) -> float:
    """The step's time when `streamed` experts cross the link and run on the accelerator after its resident ones
    (`accelerator`), while the CPU computes `cpu`: the later of the two sides. Through a ring of two or more
    buffers each streamed expert costs the larger of its copy and its compute (one overlaps the other)."""
    link = costs.t_transfer()
    device = sum(costs.t_gpu(counts[e]) for e in accelerator) + sum(max(link, costs.t_gpu(counts[e])) for e in streamed)
    return max(device, sum(costs.t_cpu(counts[e]) for e in cpu))


def plan_streaming(
    counts: Sequence[int], cpu: Sequence[int], accelerator: Sequence[int], costs: CostModel
) -> list[int]:
    """The experts of `cpu` to stream instead: the k heaviest for the k that minimises `streaming_makespan`
    (none at decode, where one token's CPU time is below a copy). Taking the heaviest first is exact when each
    streamed expert costs its copy (the link, not the accelerator's compute, bounds it: true of prefill at
    PCIe rates); the tests check it against every subset."""
    order = sorted(cpu, key=lambda e: -counts[e])
    link = costs.t_transfer()
    device = sum(costs.t_gpu(counts[e]) for e in accelerator)
    host = sum(costs.t_cpu(counts[e]) for e in order)
    best_k, best = 0, max(device, host)
    for k, e in enumerate(order, 1):  # running sums: streaming_makespan(order[:k], order[k:]) in O(1) each
        device += max(link, costs.t_gpu(counts[e]))
        host -= costs.t_cpu(counts[e])
        if max(device, host) < best:
            best_k, best = k, max(device, host)
    return order[:best_k]
