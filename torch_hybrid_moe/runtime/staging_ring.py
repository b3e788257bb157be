"""A ring of accelerator buffers that a prefill step streams non-resident experts through.

While the accelerator computes the expert in one buffer, the copy of the next crosses the link into another,
so a streamed expert costs the larger of its copy and its compute (policies/streaming.py decides which). The
copies run on a side stream and are ordered by events only: nothing waits on the host, so the CPU computes its
own share of the step at the same time. On a CPU-only machine the buffers are CPU tensors and the copies plain
copies: the same code path, tested without a GPU.

With four buffers or more the ring works in halves: while one half's experts are computed together (one grouped
GEMM per projection, where torch has the kernel), the other half's are copied in. Each expert computed alone
queues a dozen kernels from the host; at 512 prompt tokens on an H100 that host work, not the link, bounded the
step (RESULTS.md, 2026-11-27). For the same reason a group's experts with consecutive ids, which lie side by side in
the host master, cross the link in one copy per weight: the ring takes its experts in id order, so at long prompts,
which stream most of a layer's experts, most of a group is one copy.
"""

from __future__ import annotations

import contextlib
import itertools

import torch

from ..ops.expert_math import expert_into_, grouped_slots
from .expert_store import ExpertStore


class StagingRing:
    """`depth` buffers of one expert each, in the slots' dtype on the store's device; they never join the cache (in
    halves from 4 buffers: an odd count leaves one idle).
    One ring serves every layer of a shape (`ring_for`): layers run one after another, and the events that order
    a buffer's reuse within a step order it across layers too. Allocated when first used, so a model that never
    streams holds none."""

    def __init__(
        self, device: torch.device, gate_up: tuple[int, ...], down: tuple[int, ...], dtype: torch.dtype, depth: int
    ) -> None:
        if depth < 1:
            raise ValueError(f"a staging ring needs at least one buffer, got {depth}")
        self.device, self.shapes, self.dtype, self.depth = device, (gate_up, down), dtype, depth
        self._buffers: list[torch.Tensor] = []
        cuda = device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device) if cuda else None
        self._copied = [torch.cuda.Event() for _ in range(depth)] if cuda else []
        self._computed = [torch.cuda.Event() for _ in range(depth)] if cuda else []

    def buffers(self) -> list[torch.Tensor]:
        """[gate_up, down] buffers of `depth` experts each, allocated on the first call."""
        if not self._buffers:
            self._buffers = [torch.empty((self.depth, *s), dtype=self.dtype, device=self.device) for s in self.shapes]
        return self._buffers

    def run(
        self,
        store: ExpertStore,
        out: torch.Tensor,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        experts: list[int],
    ) -> int:
        """out += the pairs of `experts` of `store`, each copied into a buffer and computed there (with four
        buffers or more, a group at a time in one half of the ring while the other half fills); returns the bytes
        copied. `topk_ids` / `topk_weights` are host tensors (the step's CPU share reads them too); `out`
        and `hidden` live on the ring's device. Queued without host synchronisation on CUDA."""
        if not experts:
            return 0
        experts = sorted(experts)  # consecutive ids copy together; a group's pairs are summed together anyway
        gate_up, down = self.buffers()
        num_k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, each expert's run found by searchsorted
        grouped, ids = flat[order], torch.tensor(experts, dtype=flat.dtype)
        starts = torch.searchsorted(grouped, ids).tolist()
        ends = torch.searchsorted(grouped, ids, right=True).tolist()
        pairs = order[torch.isin(grouped, ids)]  # the streamed experts' pairs, in their (ascending) order
        tokens, weights = self._to_device(pairs // num_k), self._to_device(topk_weights.reshape(-1)[pairs])
        compute = torch.cuda.current_stream(self.device) if self._copy_stream is not None else None
        sizes = [b - a for a, b in zip(starts, ends)]
        # with four buffers or more, groups of up to half the ring: at least two groups, so a copy always overlaps
        # a compute after the first, as the streaming cost model counts (policies/streaming.py)
        group = min(self.depth // 2, -(-len(experts) // 2)) if self.depth >= 4 and grouped_slots(gate_up) else 1
        bounds = None  # each group's ends among its pairs, for the grouped GEMMs: one small copy for the step
        if group > 1:
            ends_of = [end for g in range(0, len(experts), group) for end in itertools.accumulate(sizes[g : g + group])]
            bounds = self._to_device(torch.tensor(ends_of, dtype=torch.int32))
        start = 0
        for q, g in enumerate(range(0, len(experts), group)):
            members = experts[g : g + group]
            first = (q % (self.depth // group)) * group  # the group's buffers: one half, then the other
            slots = range(first, first + len(members))
            self._copy_in(store, members, first, gate_up, down)
            if compute is not None:  # the copy stream runs in order: its last copy done, all are
                compute.wait_event(self._copied[slots[-1]])
            rows = slice(start, start + sum(sizes[g : g + group]))
            together = slice(first, slots.stop) if group > 1 else first  # a group's buffers, or one expert's
            ends_of_group = bounds[g : g + len(members)] if bounds is not None else None
            expert_into_(
                out,
                hidden,
                tokens[rows],
                weights[rows],
                gate_up[together],
                down[together],
                store.rounds_inputs,
                ends_of_group,
            )
            if compute is not None:
                for slot in slots:
                    self._computed[slot].record(compute)
            start = rows.stop
        return len(experts) * store.expert_bytes

    def _copy_in(
        self, store: ExpertStore, members: list[int], first: int, gate_up: torch.Tensor, down: torch.Tensor
    ) -> None:
        """The host masters of `members` (ascending ids) into buffers first, first + 1, ..., one copy per weight for
        each run of consecutive ids, after the computes that last read those buffers (in this step, an earlier one or
        another layer's; an event never recorded is no wait). The group's last buffer's event marks them all copied."""
        runs = [0] + [i for i in range(1, len(members)) if members[i] != members[i - 1] + 1] + [len(members)]
        last = first + len(members) - 1
        if self._copy_stream is not None:
            for slot in range(first, last + 1):
                self._copy_stream.wait_event(self._computed[slot])
        with torch.cuda.stream(self._copy_stream) if self._copy_stream is not None else contextlib.nullcontext():
            for a, b in itertools.pairwise(runs):
                store.copy_experts(members[a], gate_up[first + a : first + b], down[first + a : first + b])
            if self._copy_stream is not None:
                self._copied[last].record(self._copy_stream)

    def _to_device(self, values: torch.Tensor) -> torch.Tensor:
        """A small host tensor on the ring's device without waiting for queued work (pinned, asynchronous)."""
        if self.device.type != "cuda":
            return values
        return values.pin_memory().to(self.device, non_blocking=True)


_rings: dict[tuple, StagingRing] = {}


def ring_for(store: ExpertStore, depth: int) -> StagingRing:
    """The ring every layer whose slots have this store's device, shapes and dtype shares."""
    key = (
        store.device,
        tuple(store.slot_gate_up.shape[1:]),
        tuple(store.slot_down.shape[1:]),
        store.slot_gate_up.dtype,
        depth,
    )
    if key not in _rings:
        _rings[key] = StagingRing(store.device, *key[1:])
    return _rings[key]
