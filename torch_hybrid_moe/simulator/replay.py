"""Replay a routing trace through a policy stack on a hardware model.

Per MoE layer step: the scheduler splits the activated experts; the CPU runs its share back to back; the
GPU runs its share, each expert once its weights are in a slot; missing experts it was given are fetched
over PCIe first (one transfer at a time on the link's own timeline); after the step the cache policy's
admissions are copied in the background and become usable when their transfer ends. The layer ends when
both sides are done. Policies are the live runtime's objects, driven the same way (same calls, same
order), so hit counts agree with a live run on the same routing.

Each MoE block is preceded by the GPU's dense work of its decoder block (attention, shared experts:
`CostModel.t_dense`); the routing is known, and the layer's experts start, once it ends. With Expert Deferral
(`Stack.deferred`, decode only, never at the last MoE layer) the CPU runs each token's deferred experts
after its immediate ones while the next block's dense work and experts proceed; that next block's end waits
for them. The CPU is one timeline: deferred work delays the next layer's CPU experts.

Prefetching: when a stack names a prefetcher, layer l+1's prefetcher is asked at the start of layer l (after
l's own fetches are queued) with l's routing and the gate inputs the trace kept for the step's rows (all of
them in the embedded traces, `hidden_every` 1), and its copies go over the link while l computes.

Policies are built from one context on offer (`Registry.create`): costs, this layer's timeline, a
`RequestActivations` shared by all layers, and a `Calibration` learnt before the replay (routers, residuals,
popularity, past requests); only the oracles take `future`, the routing still to come.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..cost_model import CostModel
from ..policies import CACHE_POLICIES, PREFETCHERS, SCHEDULERS, LayerInfo
from ..policies.requests import RequestActivations
from ..runtime.slot_map import SlotMap
from ..traces import LayerTrace, Trace
from .calibration import Calibration
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
    prefetch_accuracy: float | None = None  # DALI's metric (`top_workload_overlap`); None without a prefetcher
    planning_us: float = 0.0  # wall time of the policies' decisions per layer step (this machine, Python)


def top_workload_overlap(predicted: Sequence[int], counts: Sequence[int], k: int) -> tuple[int, int]:
    """DALI's prefetch accuracy for one layer step, as (hits, out of): how many of the k highest-workload
    experts (the active ones if fewer) are among `predicted`. Experts tied with the k-th workload count as
    top experts up to the k places, so a tie is never held against the prediction."""
    active = sorted((c for c in counts if c), reverse=True)
    out_of = min(k, len(active))
    if not out_of:
        return 0, 0
    kth = active[out_of - 1]
    chosen = set(predicted)
    above = sum(1 for e, c in enumerate(counts) if c > kth and e in chosen)
    tied = sum(1 for e, c in enumerate(counts) if c == kth and e in chosen)
    return above + min(tied, out_of - sum(1 for c in active if c > kth)), out_of


@dataclass(frozen=True)
class Event:
    """One busy interval of a lane ("cpu", "gpu", "pcie"), for timelines: what ran or was copied, when."""

    step: int
    layer: int
    lane: str
    kind: str  # "expert" on cpu/gpu, "deferred" on cpu, "dense" on gpu; "fetch", "prefetch" or "admit" on pcie
    expert: int
    start: float
    end: float


def step_rows(trace: Trace, batch: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(step, row mask) of each forward step of `batch` sequences run together, in replay order."""
    sequences = trace.sequence.long()
    ids = sorted(set(sequences.tolist()))
    for first in range(0, len(ids), batch):
        group = torch.isin(sequences, torch.tensor(ids[first : first + batch]))
        for step in sorted(set(trace.step[group].tolist())):
            yield step, group & (trace.step == step)


def batched_steps(trace: Trace, batch: int) -> Iterator[tuple[bool, int, dict[int, tuple[list[int], list[float]]]]]:
    """(is_prefill, token rows, per layer: expert token counts and summed router scores) of each forward step
    of `batch` sequences run together. Scores are the trace's top-2k router scores (HybriMoE's TopP, p = 2k)."""
    num_experts = trace.meta["num_experts"]
    for step, rows in step_rows(trace, batch):
        counts = {
            layer: (torch.bincount(t.topk_ids[rows].long().flatten(), minlength=num_experts).tolist(),
                    torch.bincount(t.score_ids[rows].long().flatten(), t.scores[rows].float().flatten(),
                                   num_experts).tolist())
            for layer, t in trace.layers.items()
        }
        yield step == 0, int(rows.sum()), counts


class _Link:
    """The host-to-device link: one copy at a time, on its own timeline."""

    def __init__(self, costs: CostModel, events: list[Event] | None = None) -> None:
        self.costs = costs
        self.now = 0.0
        self.free_at = 0.0
        self.copies = 0
        self.events = events
        self.where = (0, 0)  # (step, layer) the next copies belong to, for events

    def copy(self, start: float, kind: str = "fetch", expert: int = -1) -> float:
        """Queue one expert copy no earlier than `start`; returns when it completes."""
        begin = max(start, self.free_at)
        self.free_at = begin + self.costs.t_transfer()
        self.copies += 1
        if self.events is not None:
            self.events.append(Event(*self.where, "pcie", kind, expert, begin, self.free_at))
        return self.free_at


class _Layer(SlotMap):
    """One layer's slots and policies, advanced exactly as runtime.HybridMoELayer advances them."""

    def __init__(self, info: LayerInfo, stack: Stack, link: _Link, context: dict[str, object]) -> None:
        super().__init__(info.num_slots, info.num_experts)
        self.info = info
        self.link = link
        context = context | {"info": info, "timeline": self}
        self.scheduler = SCHEDULERS.create(stack.scheduler, **context)
        self.cache = CACHE_POLICIES.create(stack.cache_policy, **context)
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


def _lowest_weight_counts(layer: LayerTrace, rows: torch.Tensor, n: int, num_experts: int) -> list[int]:
    """Per expert, how many of `rows` have it among their `n` lowest-weight routed experts (weights looked up
    in the trace's top-2k router scores; one missing there counts as the lowest)."""
    ids = layer.topk_ids[rows].long()
    match = layer.score_ids[rows].long()[:, None, :] == ids[:, :, None]
    weight = (match * layer.scores[rows].float()[:, None, :]).sum(-1)
    lowest = ids.gather(1, weight.topk(n, dim=1, largest=False).indices)
    return torch.bincount(lowest.flatten(), minlength=num_experts).tolist()


def _gate_input_index(trace: Trace, layer: int) -> torch.Tensor:
    """Row -> index into the layer's kept gate inputs, -1 for rows without one."""
    kept = trace.layers[layer].hidden_rows.long()
    index = torch.full((trace.tokens.numel(),), -1, dtype=torch.long)
    index[kept] = torch.arange(kept.numel())
    return index


def _prefetch(trace: Trace, source: int, target: int, rows: torch.Tensor, gate_input: torch.Tensor,
              prefetcher: object, layer: _Layer, now: float) -> tuple[int, int, float]:
    """Ask `target`'s prefetcher with `source`'s routing and the gate inputs its rows kept, queue its copies
    on the link at `now` (the source layer's start); returns its accuracy as `top_workload_overlap` counts it
    (on the rows with gate inputs when there are any, else on all) and the seconds the prefetcher took."""
    picked = rows.nonzero().flatten()
    kept = picked[gate_input[picked] >= 0]
    src = trace.layers[source]
    began = time.perf_counter()
    wanted = prefetcher.select(src.hidden[gate_input[kept]], src.topk_ids[picked].long(), layer.resident())
    took = time.perf_counter() - began
    for e in wanted:
        if layer.expert_slot[e] < 0:
            if not layer.fill(e, keep=set(wanted)):
                break
            layer.ready[e] = layer.link.copy(now, "prefetch", e)
    scored = kept if len(kept) else picked
    real = torch.bincount(trace.layers[target].topk_ids[scored].long().flatten(), minlength=layer.info.num_experts)
    return *top_workload_overlap(wanted, real.tolist(), prefetcher.size), took


def simulate(trace: Trace, stack: Stack, costs: CostModel, batch: int = 1, cache_ratio: float = 0.25,
             calibration: Calibration | None = None, events: list[Event] | None = None) -> SimResult:
    """Replay `trace` in batches of `batch` sequences with `cache_ratio` of each layer's experts in slots.
    `calibration`: what the policies learn beforehand (default: `Calibration.from_trace(trace)`, the trace
    itself); `events`, when given, receives every busy interval of the CPU, GPU and link."""
    num_experts = trace.meta["num_experts"]
    slots = int(cache_ratio * num_experts + 1e-9) if stack.uses_slots else 0
    steps = list(batched_steps(trace, batch))
    link = _Link(costs, events)
    calibration = calibration or Calibration.from_trace(trace)
    request = RequestActivations(list(trace.layers), num_experts, history=calibration.requests)
    layers: dict[int, _Layer] = {}
    prefetchers: dict[int, object] = {}
    for prev, idx in zip([None, *trace.layers], trace.layers):
        info = LayerInfo(idx, num_experts, slots, costs.expert.nbytes)
        context = {  # everything a policy may use; each takes what its signature names
            "costs": costs, "request": request,
            "future": [step[2][idx][0] for step in steps],  # the routing to come: for the oracles only
            "popularity": calibration.popularity.get(idx), "router": calibration.routers.get(idx),
            "residual": calibration.residuals.get(prev), **dict(stack.options),
        }
        layers[idx] = _Layer(info, stack, link, context)
        if prev is not None and stack.uses_slots and stack.prefetcher != "none":
            prefetchers[idx] = PREFETCHERS.create(stack.prefetcher, **context, info=info)
    following = {prev: idx for prev, idx in zip(layers, list(layers)[1:]) if idx in prefetchers}
    gate_input = {prev: _gate_input_index(trace, prev) for prev in following}
    predicted = out_of = 0
    planning = 0.0
    now = 0.0
    cpu_busy = gpu_busy = 0.0
    hits = misses = 0
    phase_time = {True: 0.0, False: 0.0}
    phase_tokens = {True: 0, False: 0}

    top_k = trace.layers[next(iter(trace.layers))].topk_ids.shape[1]
    if not 0 <= stack.deferred < top_k:
        raise ValueError(f"{stack.name}: deferred experts must be in [0, top-k {top_k}), got {stack.deferred}")
    last = list(layers)[-1]
    cpu_free = 0.0  # when the CPU finishes what it was given (deferred experts run past their layer's end)

    for step_no, ((prefill, tokens, counts_by_layer), (_, rows)) in enumerate(zip(steps, step_rows(trace, batch))):
        step_start = now
        if prefill:
            request.begin()
        pending = 0.0  # when the previous layer's deferred experts are done
        for idx, layer in layers.items():
            dense = costs.t_dense(tokens)
            if events is not None and dense:
                events.append(Event(step_no, idx, "gpu", "dense", -1, now, now + dense))
            gpu_busy += dense
            now += dense
            counts, scores = counts_by_layer[idx]
            defer = stack.deferred and not prefill and idx != last
            later = _lowest_weight_counts(trace.layers[idx], rows, stack.deferred, num_experts) if defer else None
            request.record(idx, counts)
            link.now = now
            link.where = (step_no, idx)
            resident = layer.resident()
            active = [e for e, c in enumerate(counts) if c]
            began = time.perf_counter()
            plan = layer.scheduler.place(counts, resident)
            planning += time.perf_counter() - began
            for e in plan.fetch:
                if not layer.fill(e, keep=set(plan.accelerator)):
                    raise RuntimeError(f"{stack.name}: no slot free for on-demand fetch of expert {e}")
                layer.ready[e] = link.copy(now, "fetch", e)
            if idx in following:
                link.where = (step_no, following[idx])
                hit, of, took = _prefetch(trace, idx, following[idx], rows, gate_input[idx],
                                          prefetchers[following[idx]], layers[following[idx]], now)
                predicted, out_of, planning = predicted + hit, out_of + of, planning + took
                link.where = (step_no, idx)
            cpu_start = max(now, cpu_free)
            cpu_time = deferred_time = 0.0
            for e in plan.cpu:
                t_cpu = costs.t_cpu(counts[e] - (later[e] if later else 0))
                at = cpu_start + cpu_time
                if events is not None and t_cpu:
                    events.append(Event(step_no, idx, "cpu", "expert", e, at, at + t_cpu))
                cpu_time += t_cpu
            for e in plan.cpu if later else ():
                t_def = costs.t_cpu(later[e])
                at = cpu_start + cpu_time + deferred_time
                if events is not None and t_def:
                    events.append(Event(step_no, idx, "cpu", "deferred", e, at, at + t_def))
                deferred_time += t_def
            gpu_end = now
            for e in sorted(plan.accelerator, key=lambda e: layer.ready[e]):
                start = max(gpu_end, layer.ready[e])
                gpu_end = start + costs.t_gpu(counts[e])
                gpu_busy += costs.t_gpu(counts[e])
                if events is not None:
                    events.append(Event(step_no, idx, "gpu", "expert", e, start, gpu_end))
            cpu_busy += cpu_time + deferred_time
            end = max(cpu_start + cpu_time, gpu_end, pending)
            cpu_free = cpu_start + cpu_time + deferred_time
            pending = cpu_free if deferred_time else 0.0
            layer_hits = sum(resident[e] for e in active)
            hits += layer_hits
            misses += len(active) - layer_hits
            admitted: set[int] = set()
            began = time.perf_counter()
            admissions = layer.cache.admit(counts, layer.resident(), scores)
            planning += time.perf_counter() - began
            for e in admissions:
                admitted.add(e)
                if not layer.fill(e, keep=admitted):
                    break
                layer.ready[e] = link.copy(end, "admit", e)
            now = end
        phase_time[prefill] += now - step_start
        phase_tokens[prefill] += tokens
    return SimResult(
        stack=stack.name, hardware=costs.hardware.name, batch=batch, cache_ratio=cache_ratio,
        decode_tok_s=phase_tokens[False] / phase_time[False] if phase_time[False] else 0.0,
        prefill_tok_s=phase_tokens[True] / phase_time[True] if phase_time[True] else 0.0,
        hit_rate=hits / max(hits + misses, 1), moe_time_s=now, pcie_gb=link.copies * costs.expert.nbytes / 1e9,
        cpu_busy=cpu_busy / now if now else 0.0, gpu_busy=gpu_busy / now if now else 0.0, hits=hits, misses=misses,
        prefetch_accuracy=predicted / out_of if out_of else None,
        planning_us=planning * 1e6 / max(len(steps) * len(layers), 1),
    )
