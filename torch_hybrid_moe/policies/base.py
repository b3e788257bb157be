"""What a layer asks its policies, and the shape of their answers.

Each MoE layer owns one scheduler, one cache policy and one prefetcher. They see plain Python
lists (per-expert token counts, which expert each slot holds) so the same objects drive the live
runtime and the trace simulator (`torch_hybrid_moe/simulator`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(frozen=True)
class LayerInfo:
    """Static facts about one MoE layer that policies size themselves by."""

    layer_idx: int
    num_experts: int
    num_slots: int
    expert_bytes: int  # one expert's host copy: what a copy into a slot moves
    slot_bytes: int = 0  # one expert in a slot, dequantised to the model's dtype: what the accelerator reads; 0: as
    # the host copy

    @property
    def full(self) -> bool:
        """A slot for every expert (a full budget): every step runs its experts from their slots, with nothing to
        place or admit (`schedulers.place_step`; the captured step asks no placement either)."""
        return self.num_slots >= self.num_experts


@dataclass
class Placement:
    """Where each activated expert of one layer step runs.

    fetch: missing experts the scheduler wants loaded into slots before the accelerator runs them
    (on-demand fetching); every expert in `fetch` is also in `accelerator`.
    """

    accelerator: list[int] = field(default_factory=list)
    cpu: list[int] = field(default_factory=list)
    fetch: list[int] = field(default_factory=list)


class Timeline(Protocol):
    """What a layer's copies are doing now, for schedulers that plan around the link's queue."""

    def link_free_in(self) -> float:
        """Seconds until the host-to-device link can start a new copy."""

    def ready_in(self, expert: int) -> float:
        """Seconds until a resident expert's slot copy is complete (0 when ready)."""


class IdleLink:
    """The `Timeline` of a link with nothing in flight: the CPU standing in for the accelerator copies synchronously,
    and a captured step waits for its layer's copies (a live uncaptured CUDA layer times its own:
    `runtime/link_clock.py`)."""

    def link_free_in(self) -> float:
        return 0.0

    def ready_in(self, expert: int) -> float:
        return 0.0


class Scheduler(Protocol):
    def place(self, counts: Sequence[int], resident: Sequence[bool]) -> Placement:
        """Split the activated experts (counts[e] > 0) between accelerator and CPU."""


class CachePolicy(Protocol):
    def admit(self, counts: Sequence[int], resident: Sequence[bool], scores: Sequence[float]) -> list[int]:
        """Record one step's activations (token counts and summed router scores per expert); return missing
        experts to bring into slots, best first."""

    def victim(self, slot_experts: Sequence[int], keep: set[int]) -> int:
        """The slot to overwrite next (slot_experts[s] is -1 for a free slot), never one holding `keep`;
        -1 when no slot may be given up."""


class Prefetcher(Protocol):
    def select(self, hidden: torch.Tensor, prev_topk_ids: torch.Tensor, resident: Sequence[bool]) -> list[int]:
        """Experts of this layer to load early, from the previous layer's gate input and routing."""
