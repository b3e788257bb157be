"""A ring of accelerator buffers that a prefill step streams non-resident experts through.

While the accelerator computes the expert in one buffer, the copy of the next crosses the link into another,
so a streamed expert costs the larger of its copy and its compute (policies/streaming.py decides which). The
copies run on a side stream and are ordered by events only: nothing waits on the host, so the CPU computes its
own share of the step at the same time. On a CPU-only machine the buffers are CPU tensors and the copies plain
copies: the same code path, tested without a GPU.
"""

from __future__ import annotations

import torch

from ..ops.expert_math import expert_into_
from .expert_store import ExpertStore


class StagingRing:
    """`depth` buffers of one expert each, in the slots' dtype on the store's device; they never join the cache."""

    def __init__(self, store: ExpertStore, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"a staging ring needs at least one buffer, got {depth}")
        self.store = store
        device, dtype = store.device, store.slot_gate_up.dtype
        self.gate_up = torch.empty((depth, *store.slot_gate_up.shape[1:]), dtype=dtype, device=device)
        self.down = torch.empty((depth, *store.slot_down.shape[1:]), dtype=dtype, device=device)
        cuda = device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device) if cuda else None
        self._copied = [torch.cuda.Event() for _ in range(depth)] if cuda else []
        self._computed = [torch.cuda.Event() for _ in range(depth)] if cuda else []

    @property
    def depth(self) -> int:
        return self.gate_up.shape[0]

    def run(
        self,
        out: torch.Tensor,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        experts: list[int],
    ) -> int:
        """out += the pairs of `experts`, each copied into the next buffer and computed there; returns the bytes
        copied. `topk_ids` / `topk_weights` are host tensors (the step's CPU share reads them too); `out` and
        `hidden` live on the store's device. Queued without host synchronisation on CUDA."""
        if not experts:
            return 0
        num_k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)
        pairs = [torch.nonzero(flat == e).flatten() for e in experts]
        sizes = [p.numel() for p in pairs]
        order = torch.cat(pairs)
        tokens, weights = self._to_device(order // num_k), self._to_device(topk_weights.reshape(-1)[order])
        rounded = self.store.rounds_inputs
        compute = torch.cuda.current_stream(self.store.device) if self._copy_stream is not None else None
        start = 0
        for i, (expert, size) in enumerate(zip(experts, sizes)):
            slot = i % self.depth
            self._copy_in(expert, slot)
            if compute is not None:
                compute.wait_event(self._copied[slot])
            rows = slice(start, start + size)
            expert_into_(out, hidden, tokens[rows], weights[rows], self.gate_up[slot], self.down[slot], rounded)
            if compute is not None:
                self._computed[slot].record(compute)
            start += size
        return len(experts) * self.store.expert_bytes

    def _copy_in(self, expert: int, slot: int) -> None:
        """The expert's host master into buffer `slot`, after the compute that last read that buffer (in this step
        or an earlier one; an event never recorded is no wait)."""
        if self._copy_stream is None:
            self.store.copy_expert(expert, self.gate_up[slot], self.down[slot])
            return
        stream = self._copy_stream
        stream.wait_event(self._computed[slot])
        with torch.cuda.stream(stream):
            self.store.copy_expert(expert, self.gate_up[slot], self.down[slot])
            self._copied[slot].record(stream)

    def _to_device(self, values: torch.Tensor) -> torch.Tensor:
        """A small host tensor on the store's device without waiting for queued work (pinned, asynchronous)."""
        if self.store.device.type != "cuda":
            return values
        return values.pin_memory().to(self.store.device, non_blocking=True)
