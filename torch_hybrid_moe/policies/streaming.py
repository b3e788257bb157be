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
    """The experts of `cpu` to stream instead: the k heaviest for the k that minimises `streaming_makespan` (often
    none for a few tokens, where the CPU computes an expert before the link could copy it). Taking the heaviest
    first is exact while each streamed expert costs its copy (the link bounds it, not the accelerator's compute:
    below ~1,400 tokens an expert on the presets; the tests check it there against every subset); with more tokens
    an expert it is a close heuristic (within ~2% of the best subset in a brute-force check). The model leaves out
    the link's other copies in the step (on-demand fetches) and assumes two or more buffers (with one, a copy and a
    compute do not overlap)."""
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
