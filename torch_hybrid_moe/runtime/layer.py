"""One MoE layer at run time: its expert store, its policies, its counters, and the dispatch itself."""

from __future__ import annotations

import functools
import itertools
import weakref
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from ..config import HybridMoEConfig
from ..ops import cpu_kernel
from ..ops.expert_math import accumulate_experts_, grouped_slots, slot_experts_
from ..ops.kernel_build import extension
from ..ops.library import cpu_experts_into
from ..ops.quantize import kernel_operands
from ..policies import LayerInfo, Placement
from ..policies.prefetching import Router
from ..policies.schedulers import place_step
from ..policies.streaming import plan_streaming
from .costs import policy_context, streaming_costs
from .expert_store import ExpertStore
from .graph_path import GraphPath, Part
from .layer_policies import LayerPolicies, build_policies
from .link_clock import link_for
from .registry import register_layer
from .staging_ring import ring_for
from .stats import LayerStats


@dataclass(frozen=True)
class RoutingRule:
    """How the model's router turns logits into top-k weights, for modes that re-weight a changed expert set
    (daop_precalc's graceful degradation): scores are softmax or sigmoid of the logits; each chosen expert's
    weight is its score times a per-token constant, and `renormalise` says whether that constant divides by
    the chosen experts' score sum (Mixtral, norm_topk_prob) or not (DeepSeek-V2, Qwen without norm_topk_prob)."""

    score_fn: str
    renormalise: bool


_OWNERS = itertools.count(1)  # numbers of the layers published in the C++ table (csrc/cpu_layers.cpp)
Half = tuple[list[int], list[float], list[bool]]  # one dispatch of a split step: counts, scores, the slots it found


@functools.cache
def cpu_share_worker(threads: int) -> ThreadPoolExecutor:
    """The thread an uncaptured step's CPU share runs on beside the accelerator's, computing with `threads` threads:
    one short of the configured count, so the thread that queues the accelerator's share keeps a core (with every
    core computing, that queueing ran slower than the link on the H100 box and bounded the prefill step). The count
    is set once, when the thread starts; ATen then also starts threads created later with it, as the decode graph's
    CPU worker does (csrc/host_bridge.cpp)."""
    return ThreadPoolExecutor(
        1, thread_name_prefix=f"hybrid-moe-cpu-share-{threads}", initializer=torch.set_num_threads, initargs=(threads,)
    )


class HybridMoELayer:
    """Runs one layer's routed experts split between accelerator slots and the CPU.

    Every step: count tokens per expert, ask the scheduler where each activated expert runs, run the
    accelerator share from slots and the CPU share from the host master (into one fp32 accumulator,
    so the split never changes the rounding of the sum), then let the cache policy refill slots.
    A pair whose expert id is -1 is skipped: another dispatch computes it (daop_precalc splits a step in two).
    """

    def __init__(
        self,
        name: str,
        layer_idx: int,
        store: ExpertStore,
        config: HybridMoEConfig,
        router: Router | None = None,
        routing: RoutingRule | None = None,
        policies: LayerPolicies | None = None,
    ) -> None:
        """`policies`: built by the patching step for this layer (`layer_policies.build_policies` with this layer's
        `policy_context`); None builds them here."""
        config = config.for_device(store.device)  # an "auto" stack made concrete (the patching step did it already)
        self.name = name
        self.routing = routing
        self.store = store
        self.config = config
        info = LayerInfo(layer_idx, store.num_experts, store.num_slots, store.expert_bytes, store.slot_bytes)
        self.info = info
        _, two_inter, hidden = store.host_gate_up.shape
        if policies is None:
            capture = store.device.type == "cuda" and config.cuda_graph
            streaming = streaming_costs(
                config, store.device.type, hidden, two_inter // 2, store.expert_bytes, store.slot_bytes
            )
            context = policy_context(config, info, hidden, two_inter // 2, router, link_for(store.device))
            policies = build_policies(config, context, capture, streaming)
        store.follow(policies.timeline)
        self.scheduler, self.cache_policy, self.prefetcher = (
            policies.scheduler,
            policies.cache_policy,
            policies.prefetcher,
        )
        self.streaming = policies.streaming  # what plans prefill streaming; None: no staging ring
        self.counters = LayerStats()  # as counted in Python: `stats` takes in the steps run elsewhere first
        self.next_handle: int | None = None
        self.owner: int | None = None  # its number in the C++ table of all-CPU layers, once published there
        self.graph_mode = False  # True while a CUDA graph of the decode step is warmed up and captured
        self.mode_counters: torch.Tensor | None = None  # an approximate mode's device counters (DAOP's)
        # uncaptured: an AHEAD half's counts, scores and the slots as the step found them, for the plain dispatch that
        # counts and admits for the step; a LEADING dispatch's, for the BEHIND half that completes the step
        self._ahead: Half | None = None
        self._unadmitted: Half | None = None
        self._graph_path: GraphPath | None = None
        self.handle = register_layer(self, key=(name, layer_idx, config.compiled_fields()))

    def __deepcopy__(self, memo: dict) -> HybridMoELayer:
        raise TypeError(
            f"deepcopy of a patched model would share {self.name}'s expert store and handle with the original; "
            "deep-copy the model before patching it, then patch the copy"
        )

    def graph_path(self) -> GraphPath:
        """The replay-safe form of this layer's step, built on first use."""
        if self._graph_path is None:
            self._graph_path = GraphPath(self)
        return self._graph_path

    @property
    def stats(self) -> LayerStats:
        """The layer's counters, with the steps that ran outside Python (graph replays, `cpu_moe` calls) taken in."""
        self.settle()
        return self.counters

    @property
    def all_on_cpu(self) -> bool:
        """Whether every expert runs on the CPU from the host copy, as routed: no slots, no staging ring, the exact
        mode. Such a layer's compiled step is `hybrid_moe::cpu_moe` (compile_passes/cpu_dispatch.py)."""
        return (
            self.store.num_slots == 0
            and self.store.device.type == "cpu"
            and self.streaming is None
            and self.config.mode == "exact"
        )

    def publish(self, handle: int) -> None:
        """Let `hybrid_moe::cpu_moe` compute this layer's steps under `handle` (registry.py calls this whenever a handle
        comes to name the layer); for a layer with slots, make sure the handle names no other layer's experts there.
        Nothing where the kernel could not be built."""
        ext = extension()
        if ext is None:
            return
        if not self.all_on_cpu:
            ext.forget_cpu_handle(handle)
            return
        if self.owner is None:
            self.owner = next(_OWNERS)
            weakref.finalize(self, ext.drop_cpu_layer, self.owner)
        gate_up, gate_up_scale = kernel_operands(self.store.host_gate_up)
        down, down_scale = kernel_operands(self.store.host_down)
        ext.publish_cpu_layer(handle, self.owner, gate_up, gate_up_scale, down, down_scale)

    def settle(self) -> None:
        """Bring slot tables and counters changed by graph replays, and the counts of its `cpu_moe` steps, back into
        the store and `counters`."""
        if self._graph_path is not None:
            self._graph_path.pull()
        if self.owner is not None and (ext := extension()) is not None:  # published: the kernel is built
            self.counters.add_cpu_steps(*ext.take_cpu_layer_counts(self.owner))

    def resident_mask(self, device: torch.device) -> torch.Tensor:
        """Which experts sit in slots now, as a bool [E] tensor on `device`: on the replay-safe path the device
        tables once this step's copies for the layer are in (no host synchronisation), else the store's map."""
        if self.graph_mode:
            return self.graph_path().resident()
        self.settle()
        return torch.tensor(self.store.resident(), device=device)

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return self.end(self.begin(hidden, topk_ids, topk_weights, 0), hidden, 0)

    def begin(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, part: int
    ) -> torch.Tensor:
        """The step up to its fp32 partial sum. On the replay-safe path the CPU share is still running when this
        returns (`end` waits for it), so work placed in between overlaps it; elsewhere the step is complete.
        `part` (graph_path.Part) also says who counts the step and admits into slots: a
        plain dispatch does, for itself and for an AHEAD half begun before it (DAOP's early pairs, whose routing
        assumed the slots stay put until then); a BEHIND half (Expert Deferral's deferred pairs) only computes.
        A LEADING dispatch (Expert Deferral's immediate pairs) is a plain one here; on the replay-safe path its
        BEHIND half queues its slot fills."""
        if self.graph_mode:
            return self.graph_path().begin(hidden, topk_ids, topk_weights, part)
        return self._accumulate(hidden, topk_ids, topk_weights, part)

    def end(self, partial: torch.Tensor, hidden: torch.Tensor, part: int) -> torch.Tensor:
        """Finish the step `begin` started with the same `part`; the one rounding to the model's dtype."""
        if self.graph_mode:
            return self.graph_path().end(partial, hidden, part)
        return partial.to(hidden.dtype)

    def _accumulate(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, part: int = 0
    ) -> torch.Tensor:
        self.settle()
        store = self.store
        if (
            store.num_slots == 0
            and part == Part.PLAIN
            and self._ahead is None
            and hidden.device.type == "cpu"
            and self.streaming is None
        ):
            return self._all_on_cpu(hidden, topk_ids, topk_weights)
        # Token counts and summed routing weights per expert, read back in one host synchronisation. The named
        # ranges split a profiled step's host time (benchmarks/gpu_decode.py --profile): the wait for routing, the
        # Python that queues the accelerator's share, and the wait for the CPU's.
        flat = topk_ids.reshape(-1) + 1  # -1 (computed by another dispatch) lands in bin 0, dropped below
        with record_function("hybrid_moe::wait_routing"):
            counts_f, scores = torch.stack(
                (
                    torch.bincount(flat, minlength=store.num_experts + 1).float(),
                    torch.bincount(flat, topk_weights.reshape(-1).float(), store.num_experts + 1),
                )
            )[:, 1:].tolist()
        counts = [int(c) for c in counts_f]
        if len(counts) > store.num_experts:
            raise ValueError(f"{self.name}: expert id {len(counts) - 1} >= num_experts {store.num_experts}")
        resident = store.resident()
        active = {e for e, c in enumerate(counts) if c}
        plan = place_step(self.scheduler, self.info, counts, resident)
        self._check_plan(plan, active, resident)
        for expert in plan.fetch:
            if not self._fill(expert, keep=set(plan.accelerator)):
                raise RuntimeError(f"{self.name}: no slot free for on-demand fetch of expert {expert}")

        streamed = plan_streaming(counts, plan.cpu, plan.accelerator, self.streaming) if self.streaming else []
        cpu = sorted(set(plan.cpu) - set(streamed))
        # Host copies taken before the accelerator's work is queued (each waits for the queue): the CPU share
        # must not wait for the accelerator's.
        host_ids, host_weights = (topk_ids.cpu(), topk_weights.cpu()) if plan.cpu else (topk_ids, topk_weights)
        share = rows = None
        if cpu:
            host_hidden, cpu_ids, cpu_weights, rows = self._cpu_rows(hidden, host_ids, host_weights, cpu)
        if cpu and (streamed or hidden.device.type == "cuda"):
            # The CPU share starts first, on a worker thread, so that it overlaps the Python that queues the
            # accelerator's share and the staging ring (the kernel runs without the GIL), one thread short
            # (`cpu_share_worker`). A route not yet measured for this shape and thread count is measured there
            # first, waited for here, not beside that work (only for batches that can take one: the round trip costs
            # ~40 us, per layer step of an uncaptured decode).
            worker = cpu_share_worker(max(1, self.config.resolve_cpu_threads() - 1))
            if cpu_kernel.best_isa() >= 0 and cpu_kernel.routed(host_hidden.shape[0]):
                gate_up, gate_up_scale = kernel_operands(store.host_gate_up)
                worker.submit(cpu_kernel.gemm_route, host_hidden, gate_up, gate_up_scale).result()
            share = worker.submit(self._cpu_share, host_hidden, cpu_ids, cpu_weights)
        try:
            with record_function("hybrid_moe::queue_accelerator"):
                on_slots = sum(counts[e] for e in plan.accelerator)
                acc = self._accelerator_share(hidden, topk_ids, topk_weights, plan.accelerator, on_slots)
                if streamed:
                    ring = ring_for(store, self.config.staging_slots)
                    self.counters.bytes_transferred += ring.run(store, acc, hidden, host_ids, host_weights, streamed)
        finally:  # the worker's share is done before anything else happens, even when the accelerator's failed
            if share is not None:
                with record_function("hybrid_moe::wait_cpu_share"):
                    wait([share])
        if cpu:
            out = share.result() if share is not None else self._cpu_share(host_hidden, cpu_ids, cpu_weights)
            out = out.to(acc.device, non_blocking=True)
            if rows is None:
                acc += out
            else:
                acc[rows] += out  # one add to each of its rows, as `acc += out` made (the other rows added 0)

        s = self.counters
        s.accelerator_experts += len(plan.accelerator)
        s.cpu_experts += len(cpu)
        s.streamed_experts += len(streamed)
        if part == Part.AHEAD:  # the layer's plain dispatch of this step counts and admits for it
            self._ahead = counts, scores, resident
            return acc
        if part == Part.BEHIND:  # Expert Deferral's deferred pairs complete the step their LEADING dispatch began
            if self._unadmitted is not None:
                (lead_counts, lead_scores, resident), self._unadmitted = self._unadmitted, None
                later = [e for e in active if not lead_counts[e]]  # experts only the deferred pairs use
                hits = sum(resident[e] for e in later)
                s.hits += hits
                s.misses += len(later) - hits
                self._admit([a + b for a, b in zip(counts, lead_counts)], [a + b for a, b in zip(scores, lead_scores)])
            return acc
        if self._ahead is not None:
            ahead_counts, ahead_scores, resident = self._ahead  # the slots as the step found them, before its fetches
            counts = [a + b for a, b in zip(counts, ahead_counts)]
            scores = [a + b for a, b in zip(scores, ahead_scores)]
            active = {e for e, c in enumerate(counts) if c}
            self._ahead = None
        s.steps += 1
        s.tokens += hidden.shape[0]
        hits = sum(resident[e] for e in active)
        s.hits += hits
        s.misses += len(active) - hits
        if part == Part.LEADING:  # its BEHIND half admits for the whole step
            self._unadmitted = counts, scores, resident
        else:
            self._admit(counts, scores)
        return acc

    def _admit(self, counts: list[int], scores: list[float]) -> None:
        """The cache policy's admissions after a step (its token counts and summed scores per expert); the first that
        finds no slot ends them."""
        admitted: set[int] = set()
        for expert in self.cache_policy.admit(counts, self.store.resident(), scores):
            admitted.add(expert)
            if not self._fill(expert, keep=admitted):
                break

    def prefetch(self, hidden: torch.Tensor, prev_topk_ids: torch.Tensor) -> None:
        """Copy the experts the prefetcher predicts for this layer into slots, ahead of its routing. A layer without
        slots has nothing to prefetch into and counts no call, as its compiled step holds no prefetch op."""
        if not self.store.num_slots:
            return
        if self.graph_mode:
            self.graph_path().prefetch(hidden, prev_topk_ids)
            return
        self.counters.prefetch_calls += 1
        wanted = self.prefetcher.select(hidden, prev_topk_ids, self.store.resident())
        keep = set(wanted)
        for expert in wanted:
            if self.store.expert_slot[expert] < 0:
                if not self._fill(expert, keep=keep):
                    break
                self.counters.prefetched_experts += 1

    def _all_on_cpu(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """A step with no slots (budget 0) on the CPU: every pair runs in the kernel as routed, with no placement
        or admission to decide, so the per-expert Python of the general step is skipped (it is most of a decode
        step's fixed cost there). Same kernel call and stats as the general step."""
        acc = self._cpu_share(hidden, topk_ids, topk_weights)
        active = int(torch.bincount(topk_ids.reshape(-1) + 1, minlength=self.store.num_experts + 1)[1:].count_nonzero())
        self.counters.add_cpu_steps(1, hidden.shape[0], active)
        return acc

    def _accelerator_share(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        experts: list[int],
        on_slots: int,
    ) -> torch.Tensor:
        """The fp32 sum of the `on_slots` (token, expert) pairs of `experts` (each in a slot), on the accelerator."""
        store = self.store
        acc = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        if not experts:
            return acc
        store.wait_for(experts)
        slot_ids = self._relabel(topk_ids, {e: store.expert_slot[e] for e in experts})
        if store.device.type == "cpu" and not store.rounds_inputs:  # the CPU standing in for the accelerator
            cpu_experts_into(hidden, slot_ids, topk_weights, store.slot_gate_up, store.slot_down, None, None, acc)
        elif grouped_slots(store.slot_gate_up):
            # one grouped GEMM per projection over the used slots, as the decode graph computes them: a prefill's
            # Python loop over 16-64 experts cost ~0.4 ms of host time an expert on the H100 box, which bounded the
            # step (benchmarks/RESULTS.md)
            slot_experts_(
                acc, hidden, slot_ids, topk_weights, store.slot_gate_up, store.slot_down, store.rounds_inputs, on_slots
            )
        else:
            accumulate_experts_(
                acc, hidden, slot_ids, topk_weights, store.slot_gate_up, store.slot_down, rounded=store.rounds_inputs
            )
        return acc

    def _cpu_rows(
        self, hidden: torch.Tensor, host_ids: torch.Tensor, host_weights: torch.Tensor, cpu: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The CPU share's inputs on the host: hidden rows, ids (-1 for pairs computed elsewhere) and weights of
        the tokens with a pair of `cpu`, and their row indices on hidden's device (None: every row has one). Only
        those rows cross to the host and back, and the kernel passes over no others: it converts every row it is
        given (a 4096-token batch cost ~20 ms more than its pairs on 2 cores; RESULTS.md, 2026-11-27, midday).
        Each CPU expert keeps its tokens, so its sums are bit for bit the same: a batch under the least GEMM
        threshold takes the micro-kernels, which no expert of so few tokens leaves in a larger batch either."""
        ids = self._relabel(host_ids, {e: e for e in cpu})
        mine = (ids >= 0).any(1)
        if bool(mine.all()):
            return hidden.cpu(), ids, host_weights, None
        rows = mine.nonzero().squeeze(1)
        on_device = rows.to(hidden.device)
        return hidden[on_device].cpu(), ids[rows], host_weights[rows], on_device

    def _cpu_share(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The fp32 sum of the pairs whose id is >= 0, computed from the host masters by the CPU kernel (on the
        worker thread too, with torch's thread count: ATen gives every thread the count set for the process)."""
        out = torch.zeros(hidden.shape, dtype=torch.float32)
        gate_up, gate_up_scale = kernel_operands(self.store.host_gate_up)
        down, down_scale = kernel_operands(self.store.host_down)
        cpu_experts_into(hidden, ids, weights, gate_up, down, gate_up_scale, down_scale, out)
        return out

    def _relabel(self, topk_ids: torch.Tensor, index_of: dict[int, int]) -> torch.Tensor:
        """Expert ids rewritten as indices into one device's weights; -1 for pairs another device computes."""
        table = [-1] * self.store.num_experts
        for expert, index in index_of.items():
            table[expert] = index
        return torch.tensor([*table, -1], device=topk_ids.device)[topk_ids]  # id -1 reads the trailing -1

    def _fill(self, expert: int, keep: set[int]) -> bool:
        """Bring `expert` into the slot the cache policy gives up; False when no slot may be given up."""
        slot = self.store.choose_slot(self.cache_policy, keep)
        if slot < 0:
            return False
        self.counters.bytes_transferred += self.store.load(expert, slot)
        return True

    def _check_plan(self, plan: Placement, active: set[int], resident: list[bool]) -> None:
        """A scheduler bug must fail loudly, not silently drop or double-count an expert."""
        placed = plan.accelerator + plan.cpu
        if len(placed) != len(active) or set(placed) != active:
            raise RuntimeError(
                f"{self.name}: scheduler {self.config.scheduler!r} did not place each active expert once"
            )
        fetch = set(plan.fetch)
        if any(not resident[e] and e not in fetch for e in plan.accelerator) or not fetch <= set(plan.accelerator):
            raise RuntimeError(f"{self.name}: scheduler put a non-resident expert on the accelerator without a fetch")
