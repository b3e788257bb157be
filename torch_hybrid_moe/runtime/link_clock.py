"""The host-to-device link as an uncaptured CUDA step queues copies on it, for schedulers that plan around its queue.

Slot fills are asynchronous copies (`ExpertStore.load`), so a step's placement can be asked while earlier copies (the
previous step's admissions, this step's prefetches) are still crossing. The runtime knows when it queued each one, and
the cost model says how long one takes; a CUDA event recorded after each says when it has landed. That is the
`Timeline` the simulator's link offers the same policies (`simulator/replay.py`), so live and replayed decisions
agree. A captured step decides on the device and waits for its layer's copies first; the CPU standing in for the
accelerator copies synchronously: both offer `IdleLink`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

Landed = Callable[[], bool]  # whether a queued copy has completed (a CUDA event's `query`)


class LinkClock:
    """The link every layer's copies share (one PCIe link, whichever stream queues them): one copy at a time, so a
    copy queued while others are in flight starts when they end."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.now = now
        self.free_at = 0.0  # when, by the cost model, the last queued copy ends
        self.pending: list[Landed] = []  # copies not yet seen landed (each layer's stream may finish in its own order)

    def queue(self, seconds: float, landed: Landed) -> float:
        """Book one copy of `seconds`, queued now; returns when it should end."""
        self.free_at = max(self.now(), self.free_at) + seconds
        self.pending.append(landed)
        return self.free_at

    def idle(self) -> bool:
        """Whether every copy queued so far has landed (those that have are forgotten)."""
        self.pending = [landed for landed in self.pending if not landed()]
        return not self.pending


class CopyTimeline:
    """One layer's view of the link (a `policies.Timeline`): predicted ends of its copies, each cut to zero once its
    event says it landed (a link faster than its profile then does not read as busy late)."""

    def __init__(self, clock: LinkClock, copy_s: float, num_experts: int) -> None:
        self.clock = clock
        self.copy_s = copy_s  # one expert's copy, by the cost model
        self.ends = [0.0] * num_experts
        self.landed: list[Landed] = [_landed] * num_experts

    def copied(self, expert: int, landed: Landed) -> None:
        """`expert`'s copy into its slot was just queued; `landed` tells when it completes."""
        self.ends[expert] = self.clock.queue(self.copy_s, landed)
        self.landed[expert] = landed

    def link_free_in(self) -> float:
        clock = self.clock
        return 0.0 if clock.idle() else max(0.0, clock.free_at - clock.now())

    def ready_in(self, expert: int) -> float:
        return 0.0 if self.landed[expert]() else max(0.0, self.ends[expert] - self.clock.now())


def link_for(device: torch.device) -> LinkClock | None:
    """The clock of `device`'s link, one per device in the process (every model's copies to it share the link); None
    where copies are synchronous (the CPU standing in for the accelerator)."""
    if device.type != "cuda":
        return None
    return _clock(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _clock(index: int) -> LinkClock:
    return LinkClock()


def _landed() -> bool:
    return True
