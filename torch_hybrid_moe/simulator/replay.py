"""Replay a routing trace through a policy stack on a hardware model.

Per MoE layer step: the scheduler splits the activated experts; the CPU runs its share back to back; the
GPU runs its share, each expert once its weights are in a slot; missing experts it was given are fetched
over PCIe first (one transfer at a time on the link's own timeline); after the step the cache policy's
admissions are copied in the background and become usable when their transfer ends. The layer ends when
both sides are done. Policies are the live runtime's objects, driven the same way (same calls, same
order), so hit counts agree with a live run on the same routing.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..cost_model import CostModel
from ..policies import CACHE_POLICIES, SCHEDULERS, LayerInfo
from ..runtime.slot_map import SlotMap
from ..traces import Trace
from .stacks import Stack


@dataclass
class SimResult:
    stack: str
    hardware: str
    batch: int
    cache_ratio: float
    decode_tok_s: float
    prefill_tok_s: float
    hit_rate: float
    moe_time_s: float
    pcie_gb: float
    cpu_busy: float
    gpu_busy: float
    hits: int = 0
    misses: int = 0


def batched_steps(trace: Trace, batch: int) -> Iterator[tuple[bool, int, dict[int, tuple[list[int], list[float]]]]]:
    """(is_prefill, token rows, per layer: expert token counts and summed router scores) of each forward step
    of `batch` sequences run together. Scores are the trace's top-2k router scores (HybriMoE's TopP, p = 2k)."""
    num_experts = trace.meta["num_experts"]
    sequences = trace.sequence.long()
    ids = sorted(set(sequences.tolist()))
    for first in range(0, len(ids), batch):
        group = torch.isin(sequences, torch.tensor(ids[first : first + batch]))
        for step in sorted(set(trace.step[group].tolist())):
            rows = group & (trace.step == step)
            counts = {
                layer: (torch.bincount(t.topk_ids[rows].long().flatten(), minlength=num_experts).tolist(),
                        torch.bincount(t.score_ids[rows].long().flatten(), t.scores[rows].float().flatten(),
                                       num_experts).tolist())
                for layer, t in trace.layers.items()
            }
            yield step == 0, int(rows.sum()), counts


class _Link:
    """The host-to-device link: one copy at a time, on its own timeline."""

    def __init__(self, costs: CostModel) -> None:
        self.costs = costs
        self.now = 0.0
        self.free_at = 0.0
        self.copies = 0

    def copy(self, start: float) -> float:
        """Queue one expert copy no earlier than `start`; returns when it completes."""
        self.free_at = max(start, self.free_at) + self.costs.t_transfer()
        self.copies += 1
        return self.free_at


class _Layer(SlotMap):
    """One layer's slots and policies, advanced exactly as runtime.HybridMoELayer advances them."""

    def __init__(self, info: LayerInfo, stack: Stack, costs: CostModel, link: _Link, future: list[set[int]]) -> None:
        super().__init__(info.num_slots, info.num_experts)
        self.info = info
        self.link = link
        context = {"timeline": self} if stack.scheduler == "queue_aware" else {}
        self.scheduler = SCHEDULERS.create(stack.scheduler, info=info, costs=costs, **context)
        extra = {"future": future} if stack.cache_policy == "belady" else {}  # the oracle sees what comes
        self.cache = CACHE_POLICIES.create(stack.cache_policy, info=info, costs=costs, **extra)
        self.ready = [0.0] * info.num_experts  # when an expert's slot copy is complete
        for slot in range(min(info.num_slots, info.num_experts)):  # the store fills slots 0..S-1 at start
            self.assign(slot, slot)

    def link_free_in(self) -> float:
        return max(0.0, self.link.free_at - self.link.now)

    def ready_in(self, expert: int) -> float:
        return max(0.0, self.ready[expert] - self.link.now)

    def fill(self, expert: int, keep: set[int]) -> bool:
        slot = self.choose_slot(self.cache, keep)
        if slot < 0:
            return False
        self.assign(expert, slot)
        return True


def simulate(trace: Trace, stack: Stack, costs: CostModel, batch: int = 1, cache_ratio: float = 0.25) -> SimResult:
    """Replay `trace` in batches of `batch` sequences with `cache_ratio` of each layer's experts in slots."""
    num_experts = trace.meta["num_experts"]
    slots = int(cache_ratio * num_experts + 1e-9) if stack.uses_slots else 0
    steps = list(batched_steps(trace, batch))
    link = _Link(costs)
    layers = {
        idx: _Layer(LayerInfo(idx, num_experts, slots, costs.expert.nbytes), stack, costs, link,
                    [{e for e, c in enumerate(step[2][idx][0]) if c} for step in steps])
        for idx in trace.layers
    }
    now = 0.0
    cpu_busy = gpu_busy = 0.0
    hits = misses = 0
    phase_time = {True: 0.0, False: 0.0}
    phase_tokens = {True: 0, False: 0}

    for prefill, tokens, counts_by_layer in steps:
        step_start = now
        for idx, layer in layers.items():
            counts, scores = counts_by_layer[idx]
            link.now = now
            resident = layer.resident()
            active = [e for e, c in enumerate(counts) if c]
            plan = layer.scheduler.place(counts, resident)
            for e in plan.fetch:
                if not layer.fill(e, keep=set(plan.accelerator)):
                    raise RuntimeError(f"{stack.name}: no slot free for on-demand fetch of expert {e}")
                layer.ready[e] = link.copy(now)
            cpu_time = sum(costs.t_cpu(counts[e]) for e in plan.cpu)
            gpu_end = now
            for e in sorted(plan.accelerator, key=lambda e: layer.ready[e]):
                gpu_end = max(gpu_end, layer.ready[e]) + costs.t_gpu(counts[e])
                gpu_busy += costs.t_gpu(counts[e])
            cpu_busy += cpu_time
            end = max(now + cpu_time, gpu_end)
            layer_hits = sum(resident[e] for e in active)
            hits += layer_hits
            misses += len(active) - layer_hits
            admitted: set[int] = set()
            for e in layer.cache.admit(counts, layer.resident(), scores):
                admitted.add(e)
                if not layer.fill(e, keep=admitted):
                    break
                layer.ready[e] = link.copy(end)
            now = end
        phase_time[prefill] += now - step_start
        phase_tokens[prefill] += tokens
    return SimResult(
        stack=stack.name, hardware=costs.hardware.name, batch=batch, cache_ratio=cache_ratio,
        decode_tok_s=phase_tokens[False] / phase_time[False] if phase_time[False] else 0.0,
        prefill_tok_s=phase_tokens[True] / phase_time[True] if phase_time[True] else 0.0,
        hit_rate=hits / max(hits + misses, 1), moe_time_s=now, pcie_gb=link.copies * costs.expert.nbytes / 1e9,
        cpu_busy=cpu_busy / now if now else 0.0, gpu_busy=gpu_busy / now if now else 0.0, hits=hits, misses=misses,
    )
