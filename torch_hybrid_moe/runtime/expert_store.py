"""Where one MoE layer's routed experts live: a host master copy and a fixed pool of accelerator slots."""

from __future__ import annotations

import math
from typing import cast, overload

import torch

from ..ops.dense_linear import laid_out_wins
from ..ops.quantize import QuantizedWeight, lay_out_experts_
from .link_clock import CopyTimeline
from .slot_map import SlotMap

EXPERT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the kernels and slots compute in

HostWeight = torch.Tensor | QuantizedWeight


class ExpertStore(SlotMap):
    """Master weights of every routed expert in host memory, plus `num_slots` accelerator slots.

    The master is in the CPU weight format (the model's dtype, bf16, or int8 / int4 with scales; int4 maybe laid out
    for the CPU kernel where the store has no slots: `laid_out_for_kernel`); slots
    hold `slot_dtype` weights. The master is pinned when the accelerator is a CUDA device, so slot fills
    are asynchronous copies on a side stream (quantised experts cross PCIe quantised and are dequantised
    on the device). On a CPU-only machine the slots are CPU tensors and fills are plain copies: the same
    code path, which makes everything testable without a GPU.
    """

    def __init__(
        self, gate_up: HostWeight, down: HostWeight, num_slots: int, device: torch.device, slot_dtype: torch.dtype
    ) -> None:
        super().__init__(num_slots, gate_up.shape[0])
        self.device = device
        self.version = 0  # bumped whenever the slot map changes, so a CUDA graph's device tables can follow
        pin = device.type == "cuda"
        self.host_gate_up = _host_copy(gate_up, pin)
        self.host_down = _host_copy(down, pin)
        self.num_experts = gate_up.shape[0]
        self.expert_bytes = expert_nbytes(gate_up) + expert_nbytes(down)
        self.slot_gate_up = torch.empty((num_slots, *gate_up.shape[1:]), dtype=slot_dtype, device=device)
        self.slot_down = torch.empty((num_slots, *down.shape[1:]), dtype=slot_dtype, device=device)
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._landed: list[torch.cuda.Event | None] = [None] * num_slots  # each slot's last fill, recorded after it
        self.timeline: CopyTimeline | None = None  # told of each asynchronous copy (the layer's policies plan by it)
        for slot in range(min(num_slots, self.num_experts)):
            self.load(slot, slot)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one expert in a slot (the slots' dtype): what the accelerator reads of it."""
        per_expert = sum(math.prod(w.shape[1:]) for w in (self.slot_gate_up, self.slot_down))
        return per_expert * self.slot_gate_up.element_size()

    @property
    def rounds_inputs(self) -> bool:
        """Whether experts multiply rounded inputs (int8 / int4 masters): slots must then round them too."""
        return isinstance(self.host_gate_up, QuantizedWeight)

    def load(self, expert: int, slot: int) -> int:
        """Copy `expert` from host into `slot` (evicting its occupant); returns the bytes moved."""
        self.assign(expert, slot)
        self.version += 1
        if self._copy_stream is None:
            self._fill(slot, expert)
        else:
            # The slot may still be read by queued compute: the copy waits for it.
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._copy_stream):
                self._fill(slot, expert)
            landed = self._landed[slot] = torch.cuda.Event()
            landed.record(self._copy_stream)
            if self.timeline is not None:
                self.timeline.copied(expert, landed.query)
        return self.expert_bytes

    def follow(self, timeline: CopyTimeline | None) -> None:
        """Tell `timeline` of every later copy, and of the first fills still crossing: queued when the store was
        built, before its layer had a timeline, they would otherwise leave the link reading idle to the first step."""
        self.timeline = timeline
        if timeline is None:
            return
        for slot, landed in enumerate(self._landed):
            if landed is not None and not landed.query():
                timeline.copied(self.slot_experts[slot], landed.query)

    def _fill(self, slot: int, expert: int) -> None:
        self.copy_experts(expert, self.slot_gate_up[slot : slot + 1], self.slot_down[slot : slot + 1])

    def copy_experts(self, first: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Write the host masters of experts first, first + 1, ... into device buffers [k, ...] of the slots' shapes
        and dtype, on the current stream: the k consecutive experts, side by side in the host master, cross in one
        copy per tensor (quantised ones quantised, with their scales, then dequantised there one expert at a time:
        the fp32 temporaries of k at once would be k times an expert's)."""
        experts = slice(first, first + gate_up.shape[0])
        for dst, src in ((gate_up, self.host_gate_up), (down, self.host_down)):
            if isinstance(src, QuantizedWeight):
                data = src.data[experts].to(self.device, non_blocking=True)
                scale = src.scale[experts].to(self.device, non_blocking=True)
                crossed = QuantizedWeight(data, scale, src.bits, src.group_size)  # laid out or not, as stored
                for i in range(dst.shape[0]):
                    dst[i].copy_(crossed[i])
            else:
                dst.copy_(src[experts], non_blocking=True)

    def wait_for_copies(self) -> None:
        """Order the compute stream after every queued slot fill."""
        if self._copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)

    def wait_for(self, experts: list[int]) -> None:
        """Order the compute stream after the fills of these experts' slots only: a step whose experts have landed
        does not wait for copies still crossing for others (the previous step's admissions, prefetches for later
        steps), as the simulator's uncaptured step does not."""
        if self._copy_stream is None:
            return
        compute = torch.cuda.current_stream(self.device)
        for expert in experts:
            landed = self._landed[self.expert_slot[expert]]
            if landed is not None:
                compute.wait_event(landed)


def laid_out_for_kernel(gate_up: HostWeight, down: HostWeight) -> tuple[HostWeight, HostWeight]:
    """int4 experts laid out for the AVX-512 kernel, in place (`lay_out_experts_`: for host weights the caller has
    just converted and owns), where both projections' shapes multiply one token faster so on this machine
    (`laid_out_wins`, measured once per shape); others as they are. For stores with no slots: slot fills read rows."""
    pair = (gate_up, down)
    if not all(
        isinstance(w, QuantizedWeight) and w.bits == 4 and not w.laid and w.shape[1] % 16 == 0 and w.shape[2] % 64 == 0
        for w in pair
    ):  # panels of 16 rows, steps of 64 columns
        return gate_up, down
    quantised = cast(tuple[QuantizedWeight, QuantizedWeight], pair)
    if not all(laid_out_wins(*w.rows(0)) for w in quantised):
        return gate_up, down
    return lay_out_experts_(quantised[0]), lay_out_experts_(quantised[1])


def expert_nbytes(weight: HostWeight) -> int:
    """Bytes of one expert of an [E, N, K] host weight (data and scales where quantised)."""
    return weight.nbytes_per_expert() if isinstance(weight, QuantizedWeight) else weight[0].nbytes


@overload
def _host_copy(weight: torch.Tensor, pin: bool) -> torch.Tensor: ...
@overload
def _host_copy(weight: QuantizedWeight, pin: bool) -> QuantizedWeight: ...
def _host_copy(weight: HostWeight, pin: bool) -> HostWeight:
    """The host master: the CPU tensor itself when no pinning is needed (no second copy; a contiguous one where it is
    not, as the kernels read it), else a pinned copy."""
    if isinstance(weight, QuantizedWeight):
        return QuantizedWeight(
            _host_copy(weight.data, pin), _host_copy(weight.scale, pin), weight.bits, weight.group_size
        )
    weight = weight.detach()
    if weight.device.type == "cpu" and not pin:
        return weight.contiguous()
    host = torch.empty(weight.shape, dtype=weight.dtype, pin_memory=pin)
    host.copy_(weight)
    return host
