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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..config import HybridMoEConfig
from ..cost_model import CostModel
from ..errors import is_count
from ..policies import CACHE_POLICIES, PREFETCHERS, SCHEDULERS, LayerInfo, Placement, Prefetcher
from ..policies.prefetching import GatePrefetch, MissingRouter
from ..policies.requests import RequestActivations
from ..policies.schedulers import place_step
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
    replay_time_s: float  # the whole replay's time: prefill and decode steps, dense layers included
    pcie_gb: float
    cpu_busy: float
    gpu_busy: float
    hits: int = 0  # active experts in a slot at the layer's start, as the live layer counts them
    misses: int = 0
    # hits whose copy had landed by then; the rest waited for it, or ran on the CPU (a scheduler that sees the link)
    landed_hit_rate: float = 0.0
    prefetch_accuracy: float | None = None  # DALI's metric (`top_workload_overlap`); None without a prefetcher
    planning_us: float = 0.0  # wall time of the policies' decisions per layer step (this machine, Python)
    captured: bool = False  # decode steps replayed as the live CUDA graph runs them (`GraphStep`)


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
    # "expert" on cpu / gpu, "deferred" on cpu, "dense" or "placement" on gpu; "fetch", "prefetch" or "admit" on pcie
    kind: str
    expert: int
    start: float
    end: float


@dataclass(frozen=True)
class GraphStep:
    """How a decode step captured as one CUDA graph runs its layers, where that differs from the uncaptured step
    the replay plays otherwise (runtime/graph_path.py, decode_graphs.py):
    - the cache admits at most `fills_per_step` experts a layer step, and the step ends once they are copied (the
      graph joins its fill stream at the end);
    - the GPU share is one grouped call (`CostModel.t_gpu_share`: one call's overhead, then each expert's read or
      compute) queued after all of the layer's on-demand fetches, its cached experts too;
    - a layer step first waits for its own copies in flight (prefetches), then the scheduler's tensor form runs
      before either share starts, costing `placement_s[scheduler]` seconds (`profiling.measure_placement`, on one
      64-expert layer step at batch 1, charged at every size and batch; a scheduler not in it costs nothing), except
      at a full budget, where the graph does not ask it;
    - its copies (fills, fetches, prefetches) are the row-copy kernel's, `fill_s` seconds an expert (None: the
      profile's copy-engine transfer time);
    - at a partial budget every layer step launches the CPU task, whose host functions (submit, then sync) hold
      the layer's stream for `cpu_task_s` in all, whether or not it has experts to compute (a step split in two
      halves, Expert Deferral's or DAOP's, launches two live; charged once here).
    `benchmarks/graph_costs.py` times both on a GPU. Prefill steps run uncaptured, as the replay plays them
    otherwise."""

    fills_per_step: int = HybridMoEConfig.fills_per_step  # the live default
    placement_s: dict[str, float] = field(default_factory=dict)
    fill_s: float | None = None
    cpu_task_s: float = 0.0


def _forward_steps(trace: Trace, batch: int) -> tuple[torch.Tensor, list[int]]:
    """Each row's forward step (0, 1, ... in replay order) and each forward step's trace step, with `batch`
    sequences run together: groups of consecutive sequence ids in order, each group's steps in order."""
    _, rank = torch.unique(trace.sequence.long(), return_inverse=True)
    step = trace.step.long()
    span = int(step.max()) + 1 if len(step) else 1
    keys, forward = torch.unique(rank // batch * span + step, return_inverse=True)
    return forward, (keys % span).tolist()


def step_rows(trace: Trace, batch: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(step, row mask) of each forward step of `batch` sequences run together, in replay order."""
    forward, steps = _forward_steps(trace, batch)
    for i, step in enumerate(steps):
        yield step, forward == i


def batched_steps(trace: Trace, batch: int) -> Iterator[tuple[bool, int, dict[int, tuple[list[int], list[float]]]]]:
    """(is_prefill, token rows, per layer: expert token counts and summed router scores) of each forward step
    of `batch` sequences run together. Scores are the trace's top-2k router scores (HybriMoE's TopP, p = 2k).
    Counted for all steps at once (a step's bins follow each other): the same sums, in the same order, as a count
    per step, which cost a third of a short replay."""
    num_experts = trace.meta["num_experts"]
    forward, steps = _forward_steps(trace, batch)
    bins = len(steps) * num_experts
    tokens = torch.bincount(forward, minlength=len(steps)).tolist()
    at = forward[:, None] * num_experts  # each row's step's first bin
    per_layer = {}
    for layer, t in trace.layers.items():
        counts = torch.bincount((at + t.topk_ids.long()).flatten(), minlength=bins)
        scores = torch.bincount((at + t.score_ids.long()).flatten(), t.scores.float().flatten(), bins)
        per_layer[layer] = (counts.view(-1, num_experts).tolist(), scores.view(-1, num_experts).tolist())
    for i, step in enumerate(steps):
        yield step == 0, tokens[i], {layer: (c[i], s[i]) for layer, (c, s) in per_layer.items()}


class _Link:
    """The host-to-device link: one copy at a time, on its own timeline."""

    def __init__(self, costs: CostModel, events: list[Event] | None = None) -> None:
        self.costs = costs
        self.now = 0.0
        self.free_at = 0.0
        self.copies = 0
        self.copy_s: float | None = None  # seconds a copy takes where not the profile's transfer (GraphStep.fill_s)
        self.captured = False  # the step under way is a captured one: its placements see the link idle, as there
        self.events = events
        self.where = (0, 0)  # (step, layer) the next copies belong to, for events

    def copy(self, start: float, kind: str = "fetch", expert: int = -1) -> float:
        """Queue one expert copy no earlier than `start`; returns when it completes."""
        begin = max(start, self.free_at)
        self.free_at = begin + (self.costs.t_transfer() if self.copy_s is None else self.copy_s)
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
        context = context | {"info": info, "timeline": self}  # as a live CUDA layer's (runtime/link_clock.py)
        self.scheduler = SCHEDULERS.create(stack.scheduler, **context)
        self.cache = CACHE_POLICIES.create(stack.cache_policy, **context)
        self.ready = [0.0] * info.num_experts  # when an expert's slot copy is complete
        for slot in range(min(info.num_slots, info.num_experts)):  # the store fills slots 0..S-1 at start
            self.assign(slot, slot)

    def link_free_in(self) -> float:
        """The link's backlog, as a live uncaptured layer sees it (runtime/link_clock.py); none in a captured step,
        whose tensor forms plan on an idle link (and which waits for the layer's own copies first)."""
        return 0.0 if self.link.captured else max(0.0, self.link.free_at - self.link.now)

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


def _prefetch(
    trace: Trace,
    source: int,
    target: int,
    rows: torch.Tensor,
    gate_input: torch.Tensor,
    prefetcher: Any,  # a Prefetcher with a `size` (every one but "none", which is never asked)
    layer: _Layer,
    now: float,
) -> tuple[int, int, float]:
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
    # a router's forecast is scored, not the copies it led to: HybriMoE's impact choice skips experts already in a
    # slot and copies that gain nothing, and scored on its copies it read as half as accurate as the same router
    guess = prefetcher.forecast(src.hidden[gate_input[kept]]) if isinstance(prefetcher, GatePrefetch) else wanted
    return *top_workload_overlap(guess, real.tolist(), prefetcher.size), took


def simulate_runnable(
    trace: Trace,
    stack: Stack,
    costs: CostModel,
    batch: int = 1,
    cache_ratio: float = 0.25,
    calibration: Calibration | None = None,
    events: list[Event] | None = None,
    graph: GraphStep | None = None,
) -> tuple[Stack, SimResult]:
    """(the stack run, its result): `stack`, or, where its prefetcher replays the model's router on gate inputs
    the trace lacks (synthetic routing), the stack without it, named "<name> (no prefetch)": a paper's stack is
    still judged, on what it can do there."""
    try:
        return stack, simulate(trace, stack, costs, batch, cache_ratio, calibration, events, graph)
    except MissingRouter:  # raised while the layers are built, before anything ran or was recorded
        stack = replace(stack, name=f"{stack.name} (no prefetch)", prefetcher="none")
        return stack, simulate(trace, stack, costs, batch, cache_ratio, calibration, events, graph)


def simulate(
    trace: Trace,
    stack: Stack,
    costs: CostModel,
    batch: int = 1,
    cache_ratio: float = 0.25,
    calibration: Calibration | None = None,
    events: list[Event] | None = None,
    graph: GraphStep | None = None,
) -> SimResult:
    """Replay `trace` in batches of `batch` sequences with `cache_ratio` of each layer's experts in slots.
    `calibration`: what the policies learn beforehand (default: `Calibration.from_trace(trace)`, the trace
    itself); `events`, when given, receives every busy interval of the CPU, GPU and link; `graph`: decode steps as
    the live CUDA graph runs them, for a stack that can run in one (`Stack.capturable`; others, and None, replay
    the uncaptured step)."""
    if not is_count(batch, 1):
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    sequences = len(trace.sequence.unique())
    if batch > sequences:  # it would replay a smaller batch under this one's label
        raise ValueError(f"batch {batch}: the trace holds {sequences} sequences; pass a batch of at most that")
    if not 0 <= cache_ratio <= 1:  # also refuses NaN
        raise ValueError(f"cache_ratio must lie in [0, 1], got {cache_ratio!r}")
    graph = graph if stack.capturable else None
    num_experts = trace.meta["num_experts"]
    steps = list(batched_steps(trace, batch))
    link = _Link(costs, events)
    calibration = calibration or Calibration.from_trace(trace)
    request = RequestActivations(list(trace.layers), num_experts, history=calibration.requests)
    slots = slots_for(cache_ratio, num_experts) if stack.uses_slots else 0
    layers, prefetchers = _build_layers(trace, stack, costs, slots, steps, calibration, request, link)
    _check_deferred(trace, stack)
    replay = _Replay(trace, stack, costs, layers, prefetchers, request, link, events, graph)
    for step_no, ((prefill, tokens, counts_by_layer), (_, rows)) in enumerate(zip(steps, step_rows(trace, batch))):
        replay.step(step_no, prefill, tokens, counts_by_layer, rows)
    return replay.result(batch, cache_ratio, len(steps))


def slots_for(cache_ratio: float, num_experts: int) -> int:
    """Slots a layer gets at `cache_ratio`: whole experts, rounded down (a ratio short of one expert gives none)."""
    return int(cache_ratio * num_experts + 1e-9)


def _build_layers(
    trace: Trace,
    stack: Stack,
    costs: CostModel,
    slots: int,
    steps: list[tuple[bool, int, dict[int, tuple[list[int], list[float]]]]],
    calibration: Calibration,
    request: RequestActivations,
    link: _Link,
) -> tuple[dict[int, _Layer], dict[int, Prefetcher]]:
    """Each layer's slots and policies, and a prefetcher for each layer after the first (it is asked during the
    layer before): built before the replay, since the oracles among them take the whole routing to come."""
    num_experts = trace.meta["num_experts"]
    layers: dict[int, _Layer] = {}
    prefetchers: dict[int, Prefetcher] = {}
    for prev, idx in zip([None, *trace.layers], trace.layers):
        info = LayerInfo(idx, num_experts, slots, costs.expert.nbytes)
        context = {  # everything a policy may use; each takes what its signature names
            "costs": costs,
            "request": request,
            "future": [step[2][idx][0] for step in steps],  # the routing to come: for the oracles only
            "popularity": calibration.popularity.get(idx),
            "router": calibration.routers.get(idx),
            "residual": None if prev is None else calibration.residuals.get(prev),
            **dict(stack.options),
        }
        layers[idx] = _Layer(info, stack, link, context)
        if prev is not None and stack.uses_slots and stack.prefetcher != "none":
            prefetchers[idx] = PREFETCHERS.create(stack.prefetcher, **context, info=info)
    return layers, prefetchers


def _check_deferred(trace: Trace, stack: Stack) -> None:
    """Expert Deferral keeps at least one expert of each token immediate: a layer's output needs one."""
    top_k = trace.layers[next(iter(trace.layers))].topk_ids.shape[1]
    if not 0 <= stack.deferred < top_k:
        raise ValueError(f"{stack.name}: deferred experts must be in [0, top-k {top_k}), got {stack.deferred}")


class _Replay:
    """A replay under way: the layers and their policies, the clock, and the totals `SimResult` reports. One method
    per phase of a layer step, called in the order the live runtime runs them, so the policies see the same calls."""

    def __init__(
        self,
        trace: Trace,
        stack: Stack,
        costs: CostModel,
        layers: dict[int, _Layer],
        prefetchers: dict[int, Prefetcher],
        request: RequestActivations,
        link: _Link,
        events: list[Event] | None,
        graph: GraphStep | None = None,
    ) -> None:
        self.trace, self.stack, self.costs, self.events = trace, stack, costs, events
        self.graph = graph
        self.captured = False  # whether the step under way is one the graph runs (decode, with `graph`)
        self.layers, self.prefetchers, self.request, self.link = layers, prefetchers, request, link
        self.following = {prev: idx for prev, idx in zip(layers, list(layers)[1:]) if idx in prefetchers}
        self.gate_input = {prev: _gate_input_index(trace, prev) for prev in self.following}
        self.last = list(layers)[-1]
        self.now = 0.0
        self.cpu_free = 0.0  # when the CPU finishes what it was given (deferred experts run past their layer's end)
        self.pending = 0.0  # when the previous layer's deferred experts are done (0: it deferred none)
        self.cpu_busy = self.gpu_busy = 0.0
        self.hits = self.misses = self.landed = 0
        self.planning = 0.0  # seconds the policies took to decide
        self.predicted = self.out_of = 0  # the prefetch accuracy's counts (`top_workload_overlap`)
        self.phase_time = {True: 0.0, False: 0.0}  # by is_prefill
        self.phase_tokens = {True: 0, False: 0}

    def step(
        self,
        step_no: int,
        prefill: bool,
        tokens: int,
        counts_by_layer: dict[int, tuple[list[int], list[float]]],
        rows: torch.Tensor,
    ) -> None:
        """One forward step through every layer, its time and tokens booked to prefill or decode (the two rates)."""
        step_start = self.now
        self.captured = self.graph is not None and not prefill
        self.link.copy_s = self.graph.fill_s if self.graph is not None and self.captured else None
        self.link.captured = self.captured
        if prefill:
            self.request.begin()
        self.pending = 0.0
        for idx, layer in self.layers.items():
            counts, scores = counts_by_layer[idx]
            defer = self.stack.deferred and not prefill and idx != self.last
            later = (
                _lowest_weight_counts(self.trace.layers[idx], rows, self.stack.deferred, layer.info.num_experts)
                if defer
                else None
            )
            self._layer_step(step_no, idx, layer, tokens, counts, scores, rows, later)
        if self.captured:  # the graph's last node joins the fill stream: the step ends with its copies
            self.now = max(self.now, self.link.free_at)
        self.phase_time[prefill] += self.now - step_start
        self.phase_tokens[prefill] += tokens

    def _layer_step(
        self,
        step_no: int,
        idx: int,
        layer: _Layer,
        tokens: int,
        counts: list[int],
        scores: list[float],
        rows: torch.Tensor,
        later: list[int] | None,
    ) -> None:
        """One decoder block: its dense work, then the MoE layer's phases. The layer ends when both shares and the
        previous layer's deferred experts are done; its hits are counted on the slots it started with."""
        self._dense(step_no, idx, tokens)
        self.request.record(idx, counts)
        if self.captured:
            self.now = max(self.now, *layer.ready)  # the graph's layer step waits for the layer's copies first
            if not layer.info.full:
                self._place_on_device(step_no, idx)
        self.link.now = start = self.now
        self.link.where = (step_no, idx)
        resident = layer.resident()
        plan = self._schedule(layer, counts, resident)
        if idx in self.following:
            self._prefetch_next(step_no, idx, rows)
        cpu_start = max(self.now, self.cpu_free)
        cpu_time, deferred_time = self._cpu_share(step_no, idx, plan.cpu, counts, later, cpu_start)
        after = max((layer.ready[e] for e in plan.fetch), default=self.now) if self.captured else self.now
        gpu_end = self._gpu_share(step_no, idx, layer, plan.accelerator, counts, after)
        self.cpu_busy += cpu_time + deferred_time
        end = max(cpu_start + cpu_time, gpu_end, self.pending)
        if self.graph is not None and self.captured and not layer.info.full:
            end += self.graph.cpu_task_s  # the CPU task's host functions hold the layer's stream
        self.cpu_free = cpu_start + cpu_time + deferred_time
        self.pending = self.cpu_free if deferred_time else 0.0
        active = [e for e, c in enumerate(counts) if c]
        layer_hits = sum(resident[e] for e in active)
        self.landed += sum(resident[e] and layer.ready[e] <= start for e in active)
        self.hits += layer_hits
        self.misses += len(active) - layer_hits
        self._admit(layer, counts, scores, end)
        self.now = end

    def _dense(self, step_no: int, idx: int, tokens: int) -> None:
        """The block's dense work on the GPU, or the CPU without one (attention, shared experts): the routing, so
        the experts, wait for it."""
        dense = self.costs.t_dense(tokens)
        on_cpu = self.costs.dense_on_cpu
        start = max(self.now, self.cpu_free) if on_cpu else self.now  # one CPU timeline: after its deferred experts
        if self.events is not None and dense:
            self.events.append(Event(step_no, idx, "cpu" if on_cpu else "gpu", "dense", -1, start, start + dense))
        if on_cpu:
            self.cpu_busy += dense
            self.cpu_free = start + dense
        else:
            self.gpu_busy += dense
        self.now = start + dense

    def _place_on_device(self, step_no: int, idx: int) -> None:
        """The scheduler's tensor form inside the graph: device time before the layer's shares start."""
        assert self.graph is not None
        took = self.graph.placement_s.get(self.stack.scheduler, 0.0)
        if self.events is not None and took:
            self.events.append(Event(step_no, idx, "gpu", "placement", -1, self.now, self.now + took))
        self.gpu_busy += took
        self.now += took

    def _schedule(self, layer: _Layer, counts: list[int], resident: list[bool]) -> Placement:
        """The scheduler's split, and the copies of the accelerator's experts not in a slot, queued at the layer's
        start: they run once copied."""
        began = time.perf_counter()
        plan = place_step(layer.scheduler, layer.info, counts, resident)
        self.planning += time.perf_counter() - began
        staged = getattr(layer.cache, "pinned_slots", False)  # fetched into a staging buffer, the slots untouched
        for e in plan.fetch:
            if not staged and not layer.fill(e, keep=set(plan.accelerator)):
                raise RuntimeError(f"{self.stack.name}: no slot free for on-demand fetch of expert {e}")
            layer.ready[e] = self.link.copy(self.now, "fetch", e)
        return plan

    def _prefetch_next(self, step_no: int, idx: int, rows: torch.Tensor) -> None:
        """The next layer's prefetch, asked at this layer's start (after its fetches) so its copies overlap this
        layer's compute; its copies are the next layer's events."""
        target = self.following[idx]
        self.link.where = (step_no, target)
        hit, of, took = _prefetch(
            self.trace, idx, target, rows, self.gate_input[idx], self.prefetchers[target], self.layers[target], self.now
        )
        self.predicted, self.out_of, self.planning = self.predicted + hit, self.out_of + of, self.planning + took
        self.link.where = (step_no, idx)

    def _cpu_share(
        self, step_no: int, idx: int, experts: Sequence[int], counts: list[int], later: list[int] | None, start: float
    ) -> tuple[float, float]:
        """Seconds of the CPU's share, back to back from `start`: the immediate tokens, which the layer's end waits
        for, then the deferred ones (Expert Deferral), which only the next layer's end waits for."""
        cpu_time = deferred_time = 0.0
        for e in experts:
            t_cpu = self.costs.t_cpu(counts[e] - (later[e] if later else 0))
            at = start + cpu_time
            if self.events is not None and t_cpu:
                self.events.append(Event(step_no, idx, "cpu", "expert", e, at, at + t_cpu))
            cpu_time += t_cpu
        if later:
            for e in experts:
                t_def = self.costs.t_cpu(later[e])
                at = start + cpu_time + deferred_time
                if self.events is not None and t_def:
                    self.events.append(Event(step_no, idx, "cpu", "deferred", e, at, at + t_def))
                deferred_time += t_def
        return cpu_time, deferred_time

    def _gpu_share(
        self, step_no: int, idx: int, layer: _Layer, experts: Sequence[int], counts: list[int], after: float
    ) -> float:
        """When the accelerator's share ends: uncaptured, its experts in the order their weights arrive, none before
        its copy nor before `after`; in the graph, one grouped call from `after` (`CostModel.t_gpu_share`), drawn as
        its experts back to back."""
        if self.captured:
            took = self.costs.t_gpu_share([counts[e] for e in experts])
            self.gpu_busy += took
            if self.events is not None and experts:
                each = took / len(experts)
                for i, e in enumerate(experts):
                    at = after + i * each
                    self.events.append(Event(step_no, idx, "gpu", "expert", e, at, at + each))
            return after + took
        gpu_end = after
        for e in sorted(experts, key=lambda e: layer.ready[e]):
            start = max(gpu_end, layer.ready[e])
            gpu_end = start + self.costs.t_gpu(counts[e])
            self.gpu_busy += self.costs.t_gpu(counts[e])
            if self.events is not None:
                self.events.append(Event(step_no, idx, "gpu", "expert", e, start, gpu_end))
        return gpu_end

    def _admit(self, layer: _Layer, counts: list[int], scores: list[float], end: float) -> None:
        """The cache policy's admissions, copied in the background from the layer's `end` and usable once copied;
        the first that finds no slot ends them."""
        admitted: set[int] = set()
        began = time.perf_counter()
        admissions = layer.cache.admit(counts, layer.resident(), scores)
        self.planning += time.perf_counter() - began
        if self.captured:
            assert self.graph is not None
            admissions = admissions[: self.graph.fills_per_step]
        for e in admissions:
            admitted.add(e)
            if not layer.fill(e, keep=admitted):
                break
            layer.ready[e] = self.link.copy(end, "admit", e)

    def result(self, batch: int, cache_ratio: float, steps: int) -> SimResult:
        """The totals as rates and fractions of the replay's time."""
        now, time_by, tokens_by = self.now, self.phase_time, self.phase_tokens
        return SimResult(
            stack=self.stack.name,
            hardware=self.costs.hardware.name,
            batch=batch,
            cache_ratio=cache_ratio,
            decode_tok_s=tokens_by[False] / time_by[False] if time_by[False] else 0.0,
            prefill_tok_s=tokens_by[True] / time_by[True] if time_by[True] else 0.0,
            hit_rate=self.hits / max(self.hits + self.misses, 1),
            replay_time_s=now,
            pcie_gb=self.link.copies * self.costs.expert.nbytes / 1e9,
            cpu_busy=self.cpu_busy / now if now else 0.0,
            gpu_busy=self.gpu_busy / now if now else 0.0,
            hits=self.hits,
            misses=self.misses,
            landed_hit_rate=self.landed / max(self.hits + self.misses, 1),
            prefetch_accuracy=self.predicted / self.out_of if self.out_of else None,
            planning_us=self.planning * 1e6 / max(steps * len(self.layers), 1),
            captured=self.graph is not None,
        )
