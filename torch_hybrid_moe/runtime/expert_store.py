"""Where one MoE layer's routed experts live: a host master copy and a fixed pool of accelerator slots."""

from __future__ import annotations

import torch


class ExpertStore:
    """Master weights of every routed expert in host memory, plus `num_slots` accelerator slots.

    The master copy is pinned when the accelerator is a CUDA device, so slot fills are asynchronous
    copies on a side stream. On a CPU-only machine the slots are CPU tensors and fills are plain
    copies: the same code path and numerics, which makes everything testable without a GPU.
    """

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, num_slots: int, device: torch.device) -> None:
        self.device = device
        self.num_experts = gate_up.shape[0]
        self.host_gate_up = _host_copy(gate_up, pin=device.type == "cuda")
        self.host_down = _host_copy(down, pin=device.type == "cuda")
        self.expert_bytes = (gate_up[0].numel() * gate_up.element_size()) + (down[0].numel() * down.element_size())
        self.slot_gate_up = torch.empty((num_slots, *gate_up.shape[1:]), dtype=gate_up.dtype, device=device)
        self.slot_down = torch.empty((num_slots, *down.shape[1:]), dtype=down.dtype, device=device)
        self.slot_experts: list[int] = [-1] * num_slots
        self.expert_slot: list[int] = [-1] * self.num_experts
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        for slot in range(min(num_slots, self.num_experts)):
            self.load(slot, slot)

    @property
    def num_slots(self) -> int:
        return len(self.slot_experts)

    def resident(self) -> list[bool]:
        return [s >= 0 for s in self.expert_slot]

    def load(self, expert: int, slot: int) -> int:
        """Copy `expert` from host into `slot` (evicting its occupant); returns the bytes moved."""
        old = self.slot_experts[slot]
        if old >= 0:
            self.expert_slot[old] = -1
        self.slot_experts[slot] = expert
        self.expert_slot[expert] = slot
        if self._copy_stream is None:
            self.slot_gate_up[slot].copy_(self.host_gate_up[expert])
            self.slot_down[slot].copy_(self.host_down[expert])
        else:
            # The slot may still be read by queued compute: the copy waits for it.
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._copy_stream):
                self.slot_gate_up[slot].copy_(self.host_gate_up[expert], non_blocking=True)
                self.slot_down[slot].copy_(self.host_down[expert], non_blocking=True)
        return self.expert_bytes

    def wait_for_copies(self) -> None:
        """Order the compute stream after every queued slot fill."""
        if self._copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)


def _host_copy(weight: torch.Tensor, pin: bool) -> torch.Tensor:
    """The host master: the CPU tensor itself when no pinning is needed (no second copy), else a pinned copy."""
    weight = weight.detach()
    if weight.device.type == "cpu" and not pin:
        return weight
    host = torch.empty(weight.shape, dtype=weight.dtype, pin_memory=pin)
    host.copy_(weight)
    return host
