"""Time of one expert on the CPU, on the GPU, and over PCIe, from a hardware profile and an expert's size.

Schedulers weigh placements with it and the simulator replays traces with it, so both agree on what a
placement costs. Hardware figures are published peak specifications times uniform efficiency factors
(stated below), or a profile measured on the machine at hand.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

# Fractions of the spec-sheet peaks a well-written kernel sustains (our CPU kernel: 76-87% of measured
# read bandwidth; GEMMs at small token counts run well below their peak rate).
BANDWIDTH_EFFICIENCY = 0.8
COMPUTE_EFFICIENCY = 0.5
PCIE_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Hardware:
    """One machine: CPU, GPU and the link between them (peak figures; efficiencies applied in CostModel)."""

    name: str
    description: str
    cpu_bandwidth_gb_s: float
    cpu_tflops: float
    gpu_bandwidth_gb_s: float
    gpu_tflops: float
    pcie_gb_s: float
    cpu_overhead_us: float = 20.0  # per expert call: dispatch, threads, activations
    gpu_overhead_us: float = 10.0  # per expert kernel launch
    pcie_latency_us: float = 10.0
    # the decode graph's grouped slot share, where measured (`profiling.measure_share`): its fixed part, and what
    # each expert of one token adds; None: priced from the per-expert terms (`CostModel.t_gpu_share`)
    gpu_share_overhead_us: float | None = None
    gpu_share_expert_us: float | None = None


# Spec-sheet figures (bf16 tensor throughput with fp32 accumulation, dense; DRAM channels x speed).
HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware(
            "dali",
            "RTX 3090 + PCIe 4.0 x16 + 16 cores of an EPYC 7532 (8ch DDR4-3200), as in DALI",
            204.8,
            1.2,
            936.0,
            71.0,
            32.0,
        ),
        Hardware(
            "hybrimoe",
            "RTX A6000 + PCIe 4.0 x16 + 10-core Xeon (6ch DDR4-2933), as in HybriMoE",
            140.8,
            1.4,
            768.0,
            154.8,
            32.0,
        ),
        Hardware(
            "ktransformers",
            "RTX 4080 + PCIe 4.0 x16 + Xeon Platinum 8452Y (36 cores, AMX, 8ch DDR5-4800), as in KTransformers",
            307.2,
            20.0,
            716.8,
            97.5,
            32.0,
        ),
        Hardware(
            "moe-infinity",
            "RTX A5000 + PCIe 4.0 x16 + 16-core Xeon (6ch DDR4-2933), as in MoE-Infinity",
            140.8,
            1.5,
            768.0,
            111.1,
            32.0,
        ),
        Hardware("rtx4090", "RTX 4090 + PCIe 4.0 x16 + Ryzen 9 7950X (2ch DDR5-6000)", 96.0, 4.4, 1008.0, 165.2, 32.0),
        Hardware("rtx5090", "RTX 5090 + PCIe 5.0 x16 + Ryzen 9 9950X (2ch DDR5-6000)", 96.0, 4.4, 1792.0, 209.5, 64.0),
    )
}


@dataclass(frozen=True)
class ExpertShape:
    """Size of one routed expert (a SiLU-gated FFN of hidden x inter, `bytes_per_weight` per weight)."""

    name: str
    hidden: int
    inter: int
    bytes_per_weight: float = 2.0
    dense: float = 0.0  # the GPU's work between two MoE blocks (attention, shared experts), in routed experts
    dense_bytes_per_weight: float | None = None  # that work's weights' bytes each (None: the experts'), so quantised
    # experts beside dense layers in the model's dtype read each at its own size
    slot_bytes_per_weight: float | None = None  # what an accelerator slot holds each (the model's dtype, into which
    # quantised experts are dequantised on arrival); None: as the host copy

    @property
    def nbytes(self) -> int:
        """Bytes of one expert's host copy: what the CPU reads and the link carries."""
        return int(3 * self.hidden * self.inter * self.bytes_per_weight)

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one expert in a slot: what the accelerator reads."""
        return int(3 * self.hidden * self.inter * (self.slot_bytes_per_weight or self.bytes_per_weight))

    @property
    def flops_per_token(self) -> int:
        return 6 * self.hidden * self.inter


EXPERT_SHAPES: dict[str, ExpertShape] = {
    s.name: s
    for s in (
        ExpertShape("deepseek-v2-lite", 2048, 1408, dense=3.6),  # MLA attention 13.8 M weights + 2 shared experts
        ExpertShape("qwen3-30b-a3b", 2048, 768, dense=4.0),  # GQA attention 18.9 M weights, no shared expert
        ExpertShape("mixtral-8x7b", 4096, 14336, dense=0.24),  # GQA attention 41.9 M weights
    )
}


class Terms(NamedTuple):
    """Time on one side, in seconds: overhead + max(read, experts * tokens * flops / rate) for tokens > 0, else 0.
    The scalar form below and the tensor form of the replay-safe schedulers evaluate it in this order, so
    both round alike."""

    overhead: float
    read: float
    experts: float
    flops: float  # per token and expert
    rate: float  # sustained flop/s

    def time(self, tokens: int) -> float:
        return self.overhead + max(self.read, self.experts * tokens * self.flops / self.rate) if tokens > 0 else 0.0

    def group_time(self, tokens: Sequence[int]) -> float:
        """One call over several experts, `tokens` each (a grouped GEMM per projection): one overhead, then each
        expert's read or compute. 0 with no tokens."""
        work = sum(max(self.read, self.experts * n * self.flops / self.rate) for n in tokens if n > 0)
        return self.overhead + work if work else 0.0


@dataclass(frozen=True)
class CostModel:
    """Seconds for one expert of `expert` size: t_cpu(tokens), t_gpu(tokens), t_transfer(); and of the rest of a
    decoder block, t_dense(tokens). `dense_us`: that block's time at one token, measured on a real step (attention,
    norms, router: dozens of small kernels, which `expert.dense` routed experts' worth of work underprices); more
    tokens add what the estimate adds. None keeps the estimate. `dense_on_cpu`: no accelerator, so that work runs
    on the CPU at its rates (a CPU-only plan); `dense_hardware`: whose rates those are (None: `hardware`'s; a
    profile fitted to int4 experts carries their arithmetic, which the model's dtype dense layers do not)."""

    hardware: Hardware
    expert: ExpertShape
    dense_us: float | None = None
    dense_on_cpu: bool = False
    dense_hardware: Hardware | None = None

    def _terms(
        self, bandwidth_gb_s: float, tflops: float, overhead_us: float, experts: float = 1.0, nbytes: float = 0.0
    ) -> Terms:
        read = experts * (nbytes or self.expert.nbytes) / (bandwidth_gb_s * 1e9 * BANDWIDTH_EFFICIENCY)
        return Terms(overhead_us * 1e-6, read, experts, self.expert.flops_per_token, tflops * 1e12 * COMPUTE_EFFICIENCY)

    @property
    def cpu(self) -> Terms:
        h = self.hardware
        return self._terms(h.cpu_bandwidth_gb_s, h.cpu_tflops, h.cpu_overhead_us)

    @property
    def gpu(self) -> Terms:
        h = self.hardware
        return self._terms(h.gpu_bandwidth_gb_s, h.gpu_tflops, h.gpu_overhead_us, nbytes=self.expert.slot_nbytes)

    def t_cpu(self, tokens: int) -> float:
        return self.cpu.time(tokens)

    def t_gpu(self, tokens: int) -> float:
        return self.gpu.time(tokens)

    def t_gpu_share(self, tokens: Sequence[int]) -> float:
        """The accelerator's share as the decode graph computes it (`slot_experts_`): one call over its experts,
        `tokens` each, instead of one call per expert. Where the grouped call was measured, its fixed part and per
        expert the more of its measured cost and its compute; else one per-expert overhead and each expert's read
        or compute (a profile's fit may put most of the read in that overhead: it cannot tell them apart)."""
        h, gpu = self.hardware, self.gpu
        if h.gpu_share_overhead_us is not None and h.gpu_share_expert_us is not None:
            gpu = gpu._replace(overhead=h.gpu_share_overhead_us * 1e-6, read=h.gpu_share_expert_us * 1e-6)
        return gpu.group_time(tokens)

    def t_dense(self, tokens: int) -> float:
        """GPU time (the CPU's with `dense_on_cpu`) of the rest of one decoder block (attention, shared experts) for
        `tokens` tokens; the KV cache's reads, which grow with the context, are left out."""
        h, e = self.dense_hardware or self.hardware, self.expert
        each = 3 * e.hidden * e.inter * (e.dense_bytes_per_weight or e.bytes_per_weight)  # an expert's worth of bytes
        if self.dense_on_cpu:
            terms = self._terms(h.cpu_bandwidth_gb_s, h.cpu_tflops, h.cpu_overhead_us, e.dense, each)
        else:
            terms = self._terms(h.gpu_bandwidth_gb_s, h.gpu_tflops, h.gpu_overhead_us, e.dense, each)

        def estimate(n: int) -> float:
            return terms.time(n) if self.expert.dense > 0 else 0.0

        if self.dense_us is None or tokens <= 0:
            return estimate(tokens)
        return self.dense_us * 1e-6 + estimate(tokens) - estimate(1)

    def t_transfer(self) -> float:
        h = self.hardware
        return h.pcie_latency_us * 1e-6 + self.expert.nbytes / (h.pcie_gb_s * 1e9 * PCIE_EFFICIENCY)
