"""The request being served, seen across layers: for policies that look beyond one layer step.

MoE-Infinity matches the current request's expert activation matrix (layers x experts) against past
requests'; DAOP allocates experts per sequence from its prefill. Both need to know where a request starts
and what every layer routed so far, which a per-layer policy cannot see. One `RequestActivations` is shared
by all layers of a model (live) or of a replay (simulator); the driver calls `begin` when a new request
(a batch of sequences) starts and `record` for every layer step, before the layer's cache policy is asked.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class RequestActivations:
    """Token counts per (MoE layer, expert) of the request in flight, plus the finished requests' matrices."""

    def __init__(self, layers: Sequence[int], num_experts: int, history: Sequence[torch.Tensor] = ()) -> None:
        if not layers or num_experts < 1:
            raise ValueError(f"need at least one MoE layer and one expert; got layers {list(layers)}, {num_experts}")
        self.layers = list(layers)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.num_experts = num_experts
        self.matrix = torch.zeros(len(self.layers), num_experts, dtype=torch.float64)
        self.finished: list[torch.Tensor] = [h.double() for h in history]  # past requests, oldest first
        if any(h.shape != self.matrix.shape for h in self.finished):
            raise ValueError(f"past requests' matrices must be {tuple(self.matrix.shape)} (layers x experts)")
        self.steps = 0  # forward steps of the current request recorded at its first layer (0: nothing yet)
        self._stacked = torch.zeros(0, *self.matrix.shape, dtype=torch.float64)

    def past(self) -> torch.Tensor:
        """The finished requests' matrices stacked (requests x layers x experts), oldest first: extended as requests
        finish, since MoE-Infinity's matching reads all of them at every layer step (stacked anew, most of a replay's
        time)."""
        if len(self._stacked) != len(self.finished):
            self._stacked = torch.cat([self._stacked, torch.stack(self.finished[len(self._stacked) :])])
        return self._stacked

    def begin(self) -> None:
        """Close the request in flight (kept in `finished` when it routed anything) and start an empty one."""
        if self.matrix.any():
            self.finished.append(self.matrix)
        self.matrix = torch.zeros_like(self.matrix)
        self.steps = 0

    def record(self, layer: int, counts: Sequence[int]) -> None:
        """Add one layer step's per-expert token counts to the request's matrix."""
        if layer not in self.row:
            raise ValueError(f"layer {layer} is not one of the tracked MoE layers {self.layers}")
        if len(counts) != self.num_experts:
            raise ValueError(f"layer {layer}: {len(counts)} counts for {self.num_experts} experts")
        if self.row[layer] == 0:
            self.steps += 1
        self.matrix[self.row[layer]] += torch.tensor(counts, dtype=torch.float64)
