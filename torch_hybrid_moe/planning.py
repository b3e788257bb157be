"""`hybrid-moe plan`: does a checkpoint fit this machine, and how fast will it run? From its config alone.

The model is built on the meta device from its config (no weight is read, nothing is downloaded but config.json),
which gives every tensor's shape: the routed experts' bytes in each host format, the dense weights' bytes, and the
KV cache's per token. From those and the memory given: the host memory each format needs, and the expert budget
that fits in GPU memory beside the dense weights and the KV cache of the context. The expected speed per policy
stack is the trace simulator's (simulator/replay.py) on routing drawn like a real model's (simulator/synthetic.py)
with the model's expert count and top-k, on the hardware preset or this machine's measured profile.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from tqdm.auto import tqdm
from transformers import PretrainedConfig

from .config import CPU_WEIGHT_DTYPES, OURS_WINDOW
from .cost_model import HARDWARE, CostModel, ExpertShape
from .errors import InputError
from .loading import local_directory
from .model_patches import ARCHITECTURES
from .ops.quantize import BITS, check_group_size, expert_bytes_per_weight
from .ops.quantize import bytes_per_weight as quantized_bytes
from .simulator import STACKS
from .simulator.calibration import Calibration
from .simulator.replay import simulate_runnable
from .simulator.synthetic import synthetic_trace
from .simulator.tuning import ours

# Host formats and their bytes per weight (int8 / int4: one fp16 scale per `group` columns).
FORMATS = tuple(f for f in CPU_WEIGHT_DTYPES if f != "model")
SIMULATED_LAYERS = 4  # layers are alike to the simulator: tok/s is scaled from this many to the model's count
# Routing like real models' (issue 18's statistics): mild skew, reuse of the last token's experts ~0.4.
SKEW, LOCALITY = 0.6, 0.4


def bytes_per_weight(fmt: str, model_bytes: int, group: int, hidden: int, inter: int) -> float:
    """An expert's host bytes per weight in `fmt` (quantised: each projection in the group it gets, where it can be
    quantised in `group` at all; else the nominal group's bytes, for a format the plan refuses)."""
    if fmt in BITS:
        try:
            return expert_bytes_per_weight(BITS[fmt], group, hidden, inter)
        except ValueError:
            return quantized_bytes(BITS[fmt], group)
    return model_bytes if fmt == "model" else 2


@dataclass(frozen=True)
class ModelSummary:
    """What a plan needs of a model, from its config."""

    model_type: str
    layers: int
    moe_layers: int
    num_experts: int
    top_k: int
    hidden: int
    inter: int
    expert_weights: int  # routed experts' weights, all layers
    dense_weights: int  # everything else (embeddings, attention, shared experts, dense MLPs, LM head)
    lookup_weights: int  # of those, the input embedding's where it is not the LM head's: a token reads one row
    model_bytes: int  # bytes per weight of the checkpoint's dtype
    kv_bytes_per_token: int  # all layers' K and V of one token, in the model's dtype

    @property
    def expert_weights_each(self) -> int:
        return 3 * self.hidden * self.inter


def summarise(config: PretrainedConfig) -> ModelSummary:
    """Shapes from a transformers config: the model built on the meta device."""
    from transformers import AutoModelForCausalLM

    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise InputError(f"model type {model_type!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}")
    spec = ARCHITECTURES[model_type]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    text = config.get_text_config()
    experts = [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")]
    num_experts, top_k = getattr(text, spec.num_experts_attr), text.num_experts_per_tok
    if not (isinstance(num_experts, int) and isinstance(top_k, int) and 0 < top_k <= num_experts):
        raise InputError(
            f"this {model_type} config routes {top_k} of {num_experts} experts a token: plan a config with "
            "0 < num_experts_per_tok <= its expert count"
        )
    if not experts:
        raise InputError(f"this {model_type} config has no MoE layers (nothing to offload): plan a config with experts")
    expert_weights = sum(m.gate_up_proj.numel() + m.down_proj.numel() for m in experts)
    total = sum(p.numel() for p in model.parameters())  # tied weights are one parameter
    lookup, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    dtype = getattr(text, "dtype", None) or torch.bfloat16
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    heads = text.num_attention_heads
    if getattr(text, "kv_lora_rank", None):  # DeepSeek's MLA: transformers caches the compressed latent and k_pe
        kv = text.kv_lora_rank + text.qk_rope_head_dim
    else:
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv = 2 * getattr(text, "num_key_value_heads", heads) * head_dim
    return ModelSummary(
        model_type=model_type,
        layers=text.num_hidden_layers,
        moe_layers=len(experts),
        num_experts=num_experts,
        top_k=top_k,
        hidden=text.hidden_size,
        inter=getattr(text, spec.intermediate_attr),
        expert_weights=expert_weights,
        dense_weights=total - expert_weights,
        lookup_weights=0 if lookup is head else lookup.numel(),
        model_bytes=torch.empty(0, dtype=dtype).element_size(),
        kv_bytes_per_token=text.num_hidden_layers * kv * torch.empty(0, dtype=dtype).element_size(),
    )


def load_config(name: str) -> PretrainedConfig:
    """A checkpoint's config: a local directory's, an embedded model's, or a hub id's (config.json only)."""
    from transformers import AutoConfig

    path = local_directory(name, patterns=["config.json"])
    if not (path / "config.json").is_file():
        raise InputError(f"{path} has no config.json; pass a checkpoint directory")
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:  # not JSON, or an architecture transformers does not know
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise InputError(f"{path}/config.json is not a usable transformers config ({why})") from None


GIB = 2**30


@dataclass(frozen=True)
class FormatPlan:
    fmt: str
    host_bytes: int  # the experts' host copy (and, without a GPU, the dense weights and the KV cache)
    fits_host: bool
    refused: str  # why this format cannot run this model here ("" where it can)
    expert_budget: float  # fraction of each layer's experts the GPU's slots hold (whole slots); 0 without a GPU
    speeds: dict[str, tuple[float, float]]  # stack -> (decode, prefill tok/s); empty where it does not fit


def plan(
    summary: ModelSummary,
    gpu_bytes: int,
    host_bytes: int,
    context: int,
    costs_for: Callable[[ExpertShape], CostModel],
    group: int = 64,
    reserve_bytes: int = GIB,
    prompt: int = 512,
    staging_slots: int = 2,
) -> tuple[int, int, list[FormatPlan]]:
    """(dense weights' bytes, the KV cache's bytes, a plan per host format). `costs_for(shape)` gives the cost
    model for experts of `shape`; formats that do not fit in host memory get no speeds, and none does where the GPU
    cannot hold the dense weights, the KV cache, the reserve and the prefill staging ring (`staging_slots`
    experts). The budget is whole slots per layer, as the runtime rounds it (`HybridMoEConfig.slots_per_layer`)."""
    dense = summary.dense_weights * summary.model_bytes
    kv = summary.kv_bytes_per_token * context
    each = summary.expert_weights_each * summary.model_bytes  # slots and the ring hold the model's dtype
    free = gpu_bytes - dense - kv - reserve_bytes - staging_slots * each
    no_gpu_room = (
        "" if gpu_bytes <= 0 or free >= 0 else gpu_refusal(gpu_bytes, dense, kv, reserve_bytes, staging_slots * each)
    )
    fraction = max(0.0, min(1.0, free / (summary.expert_weights * summary.model_bytes))) if gpu_bytes > 0 else 0.0
    budget = math.floor(fraction * summary.num_experts + 1e-9) / summary.num_experts
    plans = []
    for fmt in FORMATS:
        per_weight = bytes_per_weight(fmt, summary.model_bytes, group, summary.hidden, summary.inter)
        # without a GPU the dense weights and the KV cache live in host memory beside the experts
        host = int(summary.expert_weights * per_weight) + (0 if gpu_bytes > 0 else dense + kv)
        speeds: dict[str, tuple[float, float]] = {}
        refused = no_gpu_room
        if fmt in ("int8", "int4") and not refused:
            try:  # the projections' column counts: hidden (gate / up) and the expert width (down)
                for columns in (summary.hidden, summary.inter):
                    check_group_size(columns, group)
            except ValueError as err:
                refused = str(err)
        if host <= host_bytes and not refused:
            # what a token's dense work reads, spread over the MoE layers the simulator steps (dense-only layers too)
            read = summary.dense_weights - summary.lookup_weights
            work = read / summary.moe_layers / summary.expert_weights_each
            shape = ExpertShape(
                "model",
                summary.hidden,
                summary.inter,
                per_weight,
                dense=work,
                dense_bytes_per_weight=summary.model_bytes,  # dense layers and slots hold the model's dtype
                slot_bytes_per_weight=summary.model_bytes,
            )
            # without a GPU the dense layers run on the CPU too, between the experts, at the model dtype's rates
            dense_rates = costs_for(replace(shape, bytes_per_weight=summary.model_bytes)).hardware
            costs = replace(costs_for(shape), dense_on_cpu=gpu_bytes <= 0, dense_hardware=dense_rates)
            speeds = _speeds(summary, costs, budget, prompt, fmt)
        plans.append(FormatPlan(fmt, host, host <= host_bytes, refused, budget, speeds))
    return dense, kv, plans


def gpu_refusal(gpu_bytes: int, dense: int, kv: int, reserve: int, ring: int) -> str:
    """Why the model cannot run with a GPU of `gpu_bytes`: what it must hold besides any expert slot."""
    return (
        f"the GPU's {gpu_bytes / GIB:.1f} GiB cannot hold the dense weights ({dense / GIB:.1f} GiB), the KV cache "
        f"({kv / GIB:.2f} GiB), the {reserve / GIB:.1f} GiB reserve and the staging ring ({ring / GIB:.2f} GiB)"
    )


def _speeds(
    summary: ModelSummary, costs: CostModel, budget: float, prompt: int, label: str
) -> dict[str, tuple[float, float]]:
    """Decode and prefill tok/s of each paper's stack, the LRU stack and ours (with its default settings, the stack
    a CUDA patch runs) on synthetic routing."""
    layers = min(summary.moe_layers, SIMULATED_LAYERS)

    shape = (summary.num_experts, summary.top_k, layers)
    both = synthetic_trace(SKEW, LOCALITY, *shape, sequences=2, prompt_tokens=prompt, new_tokens=33)
    # one sequence replayed; what the policies learn beforehand (Fiddler's popularity, MoE-Infinity's past
    # requests) from the other, routed by the same experts' popularity: learnt from the routing replayed, they
    # knew it ahead (Fiddler 1.4x faster)
    trace = both.select(both.sequence == 0)
    calibration = Calibration.from_trace(trace, both.select(both.sequence == 1))
    scale = layers / summary.moe_layers
    out: dict[str, tuple[float, float]] = {}
    stacks = [
        stack
        for stack in (*STACKS.values(), ours(**dict(OURS_WINDOW)))
        if not (stack.name.startswith("oracle") or (stack.uses_slots and budget == 0))
    ]
    # long prompts take minutes (a 32,768-token prompt: about 4): the bar says how far it is
    for stack in tqdm(stacks, desc=f"simulating {label}", unit="stack", leave=False):
        ran, r = simulate_runnable(trace, stack, costs, 1, budget, calibration)  # synthetic: no gate-input prefetch
        out[ran.name] = (r.decode_tok_s * scale, r.prefill_tok_s * scale)
    return out


def hardware_costs(hardware: str) -> Callable[[ExpertShape], CostModel]:
    """`costs_for(shape)` of a preset, or of this machine's measured profile ("local")."""
    if hardware == "local":
        from .profiling import profile_hardware

        def measured(shape: ExpertShape) -> CostModel:
            # one expert is what a profile times: the dense share is left out of its key, so one measurement serves
            # every model with these experts
            expert = replace(shape, dense=0.0, dense_bytes_per_weight=None)
            return CostModel(profile_hardware(expert, progress=True).hardware, shape)

        return measured
    if hardware not in HARDWARE:
        raise InputError(f"unknown hardware {hardware!r}; use 'local' or one of {', '.join(sorted(HARDWARE))}")
    return lambda shape: CostModel(HARDWARE[hardware], shape)
