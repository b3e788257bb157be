"""One MoE layer's step in a form a CUDA graph can capture once and replay under any routing.

Per step, in stream order: the scheduler's tensor form places the step's experts from their token counts and
the device slot table; copy the hidden states, the CPU's (token, expert) pairs and the routing weights into
pinned buffers; the `submit` host function hands the CPU share to the worker thread; missing experts placed on
the GPU are copied into slots (the cache ranking gives the victims) while the CPU works; the GPU computes the
slot share (static shapes, `slot_experts_`); the `sync` host function waits for the CPU; its fp32 output is
copied in and added. Right after the slot share is queued, a side stream (overlapping the CPU share and the
following layers) runs the cache policy's tensor form: it updates its ranking and admits up to
`fills_per_step` missed experts; a Triton kernel copies them from the pinned host master into the slots the
ranking gives up, and the slot tables are updated. With the "gate" prefetcher, the previous layer's routing
also starts this layer's prefetch on that stream: this layer's router on the previous layer's gate input picks
the experts to copy in (`prefetch_admissions`). A layer's step waits, through an event, for the last
fill-stream work the same step queued for that layer (its prefetch, or the fills of an earlier dispatch of the
same layer); the fill stream runs in order, so that includes whatever it queued before (other layers' fills),
but not what comes after.
The fill stream reads copies of its inputs made on the compute stream: Inductor reuses a buffer as soon as
its last op in the graph returns, without asking the allocator, so `record_stream` alone would not keep the
original alive. No decision that depends on routing is taken in Python, so none is frozen at capture.
At a full budget every expert is in a slot, and the step runs them all from there with no CPU task and no
admission, whatever the scheduler: the uncaptured path (prefill) still follows the scheduler, which may send
resident experts to an idle CPU when their many tokens make that pay.

Without CUDA the same code runs eagerly (host functions called directly, torch indexing for the copies), which
is how the CPU-only test suite checks this path against the reference model.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..ops.cpu_kernel import extension, gemm_route
from ..ops.expert_math import slot_experts_
from ..ops.quantize import QuantizedWeight, kernel_operands
from ..ops.row_copy import copy_rows_, device_view
from ..ops.slot_swaps import claim_slots
from ..policies import CACHE_POLICIES, PREFETCHERS, SCHEDULERS
from ..policies.device_caching import admissions, fetch_admissions, prefetch_admissions

if TYPE_CHECKING:
    from ..policies.device_caching import DeviceRanking
    from ..policies.device_scheduling import DeviceScheduler
    from ..policies.prefetching import GatePrefetch
    from .layer import HybridMoELayer


class Part(enum.IntEnum):
    """Which half of a layer's step a dispatch is (the `part` of dispatch_begin / dispatch_end, an int in the ops'
    schemas), each with its own pinned task buffers, so a half still running never shares them with another
    dispatch of the layer."""

    PLAIN = 0  # a whole dispatch: counts the step and admits into slots
    # begun before the layer's plain dispatch of the step (DAOP's early pairs): that dispatch counts and admits for
    # it, so the slots its routing assumed stay put until then
    AHEAD = 1
    # begun after the layer's LEADING dispatch (Expert Deferral's deferred pairs): it only computes, then queues the
    # admission that dispatch left to it
    BEHIND = 2
    # a plain dispatch followed in the step by a BEHIND half (Expert Deferral's immediate pairs): it counts the step
    # but leaves the admission to that half, whose slot reads would otherwise wait for the copies
    LEADING = 3


@functools.cache
def fill_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream all layers' slot fills run on (PCIe moves one copy at a time anyway)."""
    return torch.cuda.Stream(device)


def check_task_errors() -> None:
    """Raise the first exception a CPU task hit on the worker thread (it cannot raise into CUDA's callback)."""
    ext = extension()
    assert ext is not None  # CPU tasks run only on a GraphPath, which is built only with the kernel
    err = ext.take_task_error()
    if err:
        raise RuntimeError(f"hybrid_moe CPU expert task failed: {err}")


@dataclass
class _TaskBuffers:
    hidden: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    out: torch.Tensor
    task: Any  # the extension's CpuTask


class GraphPath:
    """The replay-safe step of one layer; its slot tables are the device copy of the store's `SlotMap`."""

    # Counters accumulated on the device, folded into LayerStats (fields of the same name) when the tables are
    # pulled; the experts copied in ("fetched" on demand, "admitted" by the cache, prefetched) make its bytes.
    COUNTERS = (
        "steps",
        "tokens",
        "hits",
        "misses",
        "accelerator_experts",
        "cpu_experts",
        "prefetch_calls",
        "prefetched_experts",
        "fetched",
        "admitted",
    )

    def __init__(self, layer: HybridMoELayer) -> None:
        if extension() is None:
            raise RuntimeError("the CUDA graph path needs the C++ CPU kernel, which could not be built here")
        self.layer = layer
        store = layer.store
        self.device = store.device
        self.num_experts, self.num_slots = store.num_experts, store.num_slots
        self.full = layer.info.full  # every expert in a slot: no CPU task, nothing to place or admit
        self.fills = min(layer.config.fills_per_step, self.num_slots)
        config = layer.config
        self.ranking: DeviceRanking = CACHE_POLICIES.tensor_form(config.cache_policy)(
            layer.cache_policy, self.num_experts, self.device
        )
        self.scheduler: DeviceScheduler = SCHEDULERS.tensor_form(config.scheduler)(layer.scheduler)
        self.expert_slot = torch.full((self.num_experts,), -1, dtype=torch.int64, device=self.device)
        self.slot_expert = torch.full((self.num_slots,), -1, dtype=torch.int64, device=self.device)
        self.counters = torch.zeros(len(self.COUNTERS), dtype=torch.float64, device=self.device)
        self._buffers: dict[tuple, _TaskBuffers] = {}
        self._pending: dict[int, _TaskBuffers | None] = {}  # by part: a started step's CPU task, until finished
        # an AHEAD half's counts, scores and the slots it found, per expert; a LEADING dispatch's, for its BEHIND half
        self._ahead: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._unadmitted: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._host = {name: self._readable(getattr(store, f"host_{name}")) for name in ("gate_up", "down")}
        self.prefetcher: GatePrefetch | None = PREFETCHERS.tensor_form(config.prefetcher)(layer.prefetcher, self.device)
        self._ready: torch.cuda.Event | None = None  # this step's last fill-stream work for this layer
        self.pushed_version = -1
        # the device tables changed since the store last took them in (this layer's steps on the path, or replays of
        # its model's graphs: `replayed`); per layer, so that another model's replay never pulls stale tables here
        self.device_newer = False
        self.push()

    def _readable(self, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor | QuantizedWeight:
        """The host master as the fill kernel reads it: device-mapped views of the pinned memory on CUDA."""
        if self.device.type != "cuda":
            return weight
        if isinstance(weight, QuantizedWeight):
            return QuantizedWeight(
                device_view(weight.data, self.device),
                device_view(weight.scale, self.device),
                weight.bits,
                weight.group_size,
            )
        return device_view(weight, self.device)

    # -- keeping the device tables and the store's SlotMap in step ------------------------------------------

    def push(self) -> None:
        """Copy the store's slot map (changed by eager steps) into the device tables."""
        store = self.layer.store
        self.expert_slot.copy_(torch.tensor(store.expert_slot, dtype=torch.int64))
        self.slot_expert.copy_(torch.tensor(store.slot_experts, dtype=torch.int64))
        self.pushed_version = store.version

    def pull(self) -> None:
        """After replays: bring the device tables and counters back into the store and the layer's stats."""
        if not self.device_newer:
            return
        store = self.layer.store
        store.slot_experts[:] = self.slot_expert.tolist()
        store.expert_slot[:] = self.expert_slot.tolist()
        store.version += 1
        self.pushed_version = store.version
        c = dict(zip(self.COUNTERS, (int(v) for v in self.counters.tolist())))
        self.counters.zero_()
        s = self.layer.counters
        for name in self.COUNTERS[:-2]:
            setattr(s, name, getattr(s, name) + c[name])
        s.bytes_transferred += (c["fetched"] + c["admitted"] + c["prefetched_experts"]) * store.expert_bytes
        self.device_newer = False

    def replayed(self) -> None:
        """Called after each replay of a graph holding this layer's step: its device tables are now the newer."""
        self.device_newer = True

    def prepare_replay(self) -> None:
        """Before a replay: eager steps may have moved experts; make the device tables current."""
        if self.pushed_version != self.layer.store.version:
            self.push()
        self.layer.store.wait_for_copies()

    def begin_step(self) -> None:
        """Before a decode step is run or captured: no copy of this step is queued for the layer yet."""
        self._ready = self._ahead = self._unadmitted = None

    def resident(self) -> torch.Tensor:
        """The slot map as a bool [E] device tensor, once this step's copies queued for the layer are done."""
        self._wait_for_copies()
        return self.expert_slot >= 0

    def _wait_for_copies(self) -> None:
        if self._ready is not None:  # slots and tables this step's earlier copies for this layer change
            torch.cuda.current_stream(self.device).wait_event(self._ready)

    # -- the step ---------------------------------------------------------------------------------------------

    def begin(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, part: int
    ) -> torch.Tensor:
        """Place the step's experts (the scheduler's tensor form), submit the CPU share (task buffers `part`), copy
        in the missing experts placed on the accelerator, compute the slot share, queue the cache's fills as
        `part` says (`Part`); returns the fp32 accumulator `end` completes once the CPU share is in."""
        store = self.layer.store
        self.device_newer = True  # this step (run or captured) changes the device tables: pull before eager use
        self._wait_for_copies()
        ids = topk_ids.long()
        valid, expert = ids >= 0, ids.clamp(min=0)  # id -1: another dispatch's pair
        counts = torch.zeros(self.num_experts, dtype=torch.float32, device=ids.device)
        counts.scatter_add_(0, expert.flatten(), valid.flatten().float())
        weights = topk_weights.flatten().float() * valid.flatten()
        scores = torch.zeros_like(counts).scatter_add_(0, expert.flatten(), weights)
        resident = self.expert_slot >= 0
        # A full budget runs every expert from its slot, with no CPU task in the step: the rule of every step
        # (`schedulers.place_step`), in tensor form.
        on_accelerator = (
            counts > 0
            if self.full
            else self.scheduler.place(counts, resident, self.num_slots, min(self.num_experts, ids.numel()))
        )
        on_slot = valid & on_accelerator[expert]
        acc = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        buf = None
        if not self.full:
            buf = self._task_buffers(hidden, ids, part)
            buf.hidden.copy_(hidden, non_blocking=True)
            buf.ids.copy_(torch.where(on_slot, -1, ids), non_blocking=True)
            buf.weights.copy_(topk_weights, non_blocking=True)
            self._launch(buf.task, "submit")
        if self.scheduler.fetches and 0 < self.num_slots < self.num_experts:  # on-demand copies, while the CPU runs
            fetched, slot = fetch_admissions(
                on_accelerator & ~resident,
                on_accelerator,
                self.ranking.values,
                self.expert_slot,
                self.slot_expert,
                min(self.num_slots, self.num_experts, ids.numel()),
            )
            self._fill(fetched, slot)
            self._count(fetched=(fetched >= 0).sum())
        if self.num_slots:
            slot_experts_(
                acc,
                hidden,
                torch.where(on_slot, self.expert_slot[expert], -1),
                topk_weights,
                store.slot_gate_up,
                store.slot_down,
                rounded=store.rounds_inputs,
            )
        active = counts > 0
        self._count(accelerator_experts=on_accelerator.sum(), cpu_experts=(active & ~on_accelerator).sum())
        if part in (Part.PLAIN, Part.LEADING):
            ahead, self._ahead = self._ahead, None
            if ahead is not None:  # the step's hits are judged on the slots it found, before the AHEAD half's fetches
                counts, scores, resident = counts + ahead[0], scores + ahead[1], ahead[2]
                active = counts > 0
            self._count(steps=1, tokens=ids.shape[0], hits=(active & resident).sum(), misses=(active & ~resident).sum())
            if part == Part.PLAIN:
                self._admit_later(counts, scores)
            else:
                self._unadmitted = counts, scores, resident
        elif part == Part.AHEAD:
            self._ahead = counts, scores, resident
        elif self._unadmitted is not None:  # BEHIND: its slot reads are queued, the copies may follow
            (lead_counts, lead_scores, lead_resident), self._unadmitted = self._unadmitted, None
            later = active & (lead_counts == 0)  # experts only the deferred pairs use: the step's too
            self._count(hits=(later & lead_resident).sum(), misses=(later & ~lead_resident).sum())
            self._admit_later(counts + lead_counts, scores + lead_scores)
        self._pending[part] = buf
        return acc

    def end(self, acc: torch.Tensor, hidden: torch.Tensor, part: int) -> torch.Tensor:
        """Wait for the CPU share `begin` submitted with `part` (the `sync` host function) and add it."""
        buf = self._pending.pop(part)
        if buf is not None:
            self._launch(buf.task, "sync")
            acc = acc + buf.out.to(acc.device, non_blocking=True)
        return acc.to(hidden.dtype)

    def _task_buffers(self, hidden: torch.Tensor, ids: torch.Tensor, part: int) -> _TaskBuffers:
        """Static pinned buffers and the CPU task bound to them, one set per (tokens, top-k, dtype, part): a
        half still running never shares buffers with another dispatch of the layer."""
        key = (*ids.shape, hidden.dtype, part)
        if key not in self._buffers:
            pin = self.device.type == "cuda"
            store = self.layer.store
            hid = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=pin)
            cpu_ids = torch.empty(ids.shape, dtype=torch.int64, pin_memory=pin)
            weights = torch.empty(ids.shape, dtype=torch.float32, pin_memory=pin)
            out = torch.empty(hidden.shape, dtype=torch.float32, pin_memory=pin)
            gate_up, gate_up_scale = kernel_operands(store.host_gate_up)
            down, down_scale = kernel_operands(store.host_down)
            route = gemm_route(hid, gate_up, gate_up_scale)
            ext = extension()
            assert ext is not None  # checked when this GraphPath was built (extension() is cached)
            task = ext.CpuTask(
                hid,
                cpu_ids,
                weights,
                gate_up,
                gate_up_scale,
                down,
                down_scale,
                out,
                self.layer.config.resolve_cpu_threads(),
                route.tokens,
                route.code,
            )
            self._buffers[key] = _TaskBuffers(hid, cpu_ids, weights, out, task)
        return self._buffers[key]

    def _launch(self, task: Any, what: str) -> None:
        """On CUDA: a host function in the current stream (captured into the graph); else: call it now."""
        if self.device.type == "cuda":
            getattr(task, f"launch_{what}")(torch.cuda.current_stream(self.device).cuda_stream)
        else:
            (task.submit if what == "submit" else task.wait)()

    def prefetch(self, hidden: torch.Tensor, prev_topk_ids: torch.Tensor) -> None:
        """Start copying the experts the gate prefetcher predicts for this layer (module docstring); every call
        is counted, as on the uncaptured path."""
        self.device_newer = True
        if self.prefetcher is not None and 0 < self.num_slots < self.num_experts:
            self._on_fill_stream(self._prefetch, hidden)
        else:
            self._count(prefetch_calls=1)

    def _prefetch(self, hidden: torch.Tensor) -> None:
        assert self.prefetcher is not None  # `prefetch` queues this only with a prefetcher
        expert, slot = prefetch_admissions(
            self.prefetcher.priority(hidden),
            self.prefetcher.size,
            self.ranking.values,
            self.expert_slot,
            self.slot_expert,
        )
        self._fill(expert, slot)
        self._count(prefetch_calls=1, prefetched_experts=(expert >= 0).sum())

    def _count(self, **values: torch.Tensor | int) -> None:
        """Add to the named `COUNTERS` without host synchronisation: one in-place add each (Python numbers as
        scalars, since a host-to-device copy cannot be captured)."""
        for name, value in values.items():  # add_ on the element's view: `+=` would also write it back (a copy)
            self.counters[self.COUNTERS.index(name)].add_(value)

    def _on_fill_stream(self, work: Callable[..., None], *tensors: torch.Tensor) -> None:
        """Run `work` on copies of `tensors` on the fill stream, after what the compute stream queued so far, and
        note its end for this layer's next dispatch in the step (on CUDA); elsewhere, now."""
        if self.device.type != "cuda":
            work(*tensors)
            return
        tensors = tuple(t.clone() for t in tensors)  # Inductor may reuse the originals' memory right away
        stream = fill_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for t in tensors:  # freed on the compute stream while the fill stream may still read them
            t.record_stream(stream)
        with torch.cuda.stream(stream):
            work(*tensors)
            self._ready = torch.cuda.Event()
            self._ready.record(stream)

    def _admit_later(self, counts: torch.Tensor, scores: torch.Tensor) -> None:
        """The step's ranking update and admissions, on the fill stream; none at a full budget."""
        if not self.full:
            self._on_fill_stream(self._admit, counts, scores)

    def _admit(self, counts: torch.Tensor, scores: torch.Tensor) -> None:
        """The ranking update and slot fills of one layer step (counts and summed scores per expert)."""
        may_change = self.ranking.update(counts, scores)
        cap = self.ranking.max_fills
        fills = self.fills if cap is None else min(self.fills, cap)
        if fills:
            expert, slot = admissions(
                self.ranking.values,
                may_change,
                self.ranking.candidates(counts > 0),
                self.expert_slot,
                self.slot_expert,
                fills,
                self.ranking.margin,
            )
            self._fill(expert, slot)
            self._count(admitted=(expert >= 0).sum())

    def _fill(self, expert: torch.Tensor, slot: torch.Tensor) -> None:
        """Copy admitted experts (id >= 0) into their slots from the host master (dequantised or converted on the
        way when stored otherwise), then update the tables."""
        store = self.layer.store
        for dst, src in ((store.slot_gate_up, self._host["gate_up"]), (store.slot_down, self._host["down"])):
            copy_rows_(dst, slot, src, expert)
        claim_slots(expert, slot, self.expert_slot, self.slot_expert)
