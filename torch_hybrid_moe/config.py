"""User-facing configuration of hybrid expert placement."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .cost_model import EXPERT_SHAPES, HARDWARE, CostModel, ExpertShape
from .errors import InputError, is_count
from .policies import CACHE_POLICIES, PREFETCHERS, SCHEDULERS, LayerInfo

CPU_WEIGHT_DTYPES = ("model", "bfloat16", "int8", "int4")
DENSE_WEIGHT_DTYPES = ("model", "int8", "int4")
QUANTISED_DTYPES = ("int8", "int4")
DEFAULT_GROUP_SIZE = 64
MODES = ("exact", "expert_deferral", "daop_precalc")
AUTO = "auto"  # the scheduler and cache policy chosen for the device when the model is patched (`for_device`)
# Ours' window cache settings, as its tuner picked them on the leases' traces and the GPU rows measured them
# (benchmarks/RESULTS.md): 8-step windows, one copy per closing window, scores kept at 0.8 across windows.
OURS_WINDOW: tuple[tuple[str, Any], ...] = (("decay", 0.8), ("u_size", 1), ("w_size", 8))
# A stack file (`hybrid-moe simulate --save-ours FILE`, `HybridMoEConfig.from_stack_file`): these config fields as
# JSON, with "format" and the run that tuned them ("tuned_on", kept for the reader, not read back)
STACK_FILE_FORMAT = 1
STACK_FILE_FIELDS = ("scheduler", "cache_policy", "cache_options")
PRECALC_FROM_LAYER = 5  # the paper predicts block i + 1 from block i for i >= 4: block 5 is the first approximated
_BYTE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def check_cache_values(cache_policy: str, cache_options: Mapping[str, object] | tuple[tuple[str, object], ...]) -> None:
    """Build `cache_policy` once with `cache_options` for a stand-in layer, so that a value it refuses (a window of
    0 steps, a decay of 1) or a context it needs and the live runtime lacks (a simulator-only policy's future
    routing) is a ValueError now, not when a model is patched."""
    options = dict(cache_options)
    stand_in = CostModel(HARDWARE["dali"], ExpertShape("stand-in", 8, 8))  # what a cost-aware one weighs by
    CACHE_POLICIES.create(cache_policy, info=LayerInfo(0, 8, 2, 1), costs=stand_in, **options)


@dataclass(frozen=True)
class HybridMoEConfig:
    """How a patched model splits its routed experts between accelerator slots and the CPU.

    expert_budget: a fraction in [0, 1] of each MoE layer's routed experts held in accelerator slots (any real
        number: float, int 0 or 1, numpy scalar, 0-d tensor), or an absolute byte budget for all layers' slots
        together as a size with a unit ("6GiB", "512MB", "2048B"). A bare number over 1 is refused, not read as bytes.
    device: "auto" (CUDA when present, else the CPU stands in for the accelerator), "cuda" or "cpu".
    scheduler, cache_policy, prefetcher: names looked up in `torch_hybrid_moe.policies` registries, or for the
        first two "auto" (the default), which `for_device` makes concrete when the model is patched: on CUDA with
        `cuda_graph` (the default) ours, `queue_aware` placement over the window cache with ours' settings
        (`OURS_WINDOW`), which measured ahead of the LRU stack there but at one budget (benchmarks/RESULTS.md,
        2026-11-28); elsewhere (the CPU standing in, or uncaptured CUDA steps, where ours was not measured)
        `cached_on_accelerator` over `lru`. An "auto" cache policy beside a named scheduler is ours' window for
        `queue_aware`, else `lru`.
    cache_options: the cache policy's own parameters, by name (a dict, kept as sorted pairs): e.g. the window cache
        ours tunes, `cache_policy="dali_window", cache_options={"w_size": 8, "u_size": 1, "decay": 0.8}`; MRS's
        `alpha`. A name the policy does not take is refused here; a value it refuses, when the model is patched.
        Only with a named cache policy.
    hardware: the cost model that cost-aware schedulers (fiddler, dali_greedy, optimal, hybrimoe, queue_aware)
        weigh placements with: a `cost_model.HARDWARE` preset, or "local" (this machine's measured profile,
        `profiling.py`, cached on disk); "" (the default) gives none, and a named cost-aware scheduler is refused.
        Ours chosen by "auto" takes the local profile then (the prefill ring measures it on CUDA anyway).
    expert_shape: cost the experts as a `cost_model.EXPERT_SHAPES` preset instead of the model's own size
        (what-if runs, and replaying a simulator's decisions live); "" means the model's own.
    cpu_weight_dtype: the format of the experts' host copy, which the CPU computes from and slots are filled
        from: "model" (as loaded), "bfloat16", or "int8" / "int4" with one scale per `cpu_weight_group_size`
        columns, multiplying inputs rounded to int8 per 32 columns (as llama.cpp's q8_0 / q4_0 do; on the CPU
        and in slots alike). Quantised formats are approximate: fewer bytes per weight make bandwidth-bound
        CPU experts faster, at an accuracy cost measured in benchmarks/RESULTS.md. Slots hold the experts
        dequantised to the model's dtype and multiply in it, where the CPU keeps fp32: in a bf16 model an
        expert's output differs a little by where it ran, so outputs differ by budget (perplexity cost of
        mixtral-tiny in bf16 at budget 0 and 1: int8 1.00035 and 1.00016, int4 1.00395 and 1.00392). The group
        is unused where nothing is int8 / int4, so one config can sweep formats (the CLI refuses it there).
    dense_weight_dtype: "model" (the default) keeps the dense layers' linears (attention projections, shared
        experts, dense MLPs, the LM head) as loaded; "int8" / "int4" quantise them with one scale per
        `cpu_weight_group_size` columns and run them on the CPU kernel's micro-kernels: an approximate mode for
        CPU-only machines, where those bytes bound every decode token (benchmarks/RESULTS.md); refused on CUDA.
    dense_weight_group_size: those dense layers' group; 0 (the default) takes `cpu_weight_group_size`. Loading a
        prepared or GGUF store sets the experts' group to the store's own and keeps this one as asked
        (`with_store_format`), so the dense layers are quantised as the config said.
    staging_slots: accelerator buffers a prefill step streams experts through when the cost model says a copy and
        the accelerator's compute beat the CPU for them (its heaviest experts; the CPU computes the rest at the same
        time, and the cache's slots are left alone; runtime/staging_ring.py). The cost model is `hardware`'s, or with
        `hardware` '' this machine's measured profile. CUDA only: without it the accelerator is the CPU itself.
        0: experts not in a slot all run on the CPU. From 4, half the buffers are computed together (grouped GEMMs)
        while the other half fill: fewer kernels for the host to queue, more GPU memory.
    cuda_graph: on CUDA, capture each decode step of `generate()` as one CUDA graph (CPU experts run from host
        functions inside it; slot decisions are made by tensor ops at replay). False: run decode uncaptured.
    fills_per_step: inside a graph, the most missed experts the cache policy may admit into slots per layer step
        (each is a PCIe copy overlapping the following layers). A fetching scheduler's on-demand copies and the
        gate prefetcher's (up to `prefetch_size`) come on top.
    prefetch_size: the most experts the prefetcher copies per layer step; 0 keeps the prefetcher's own default
        (the gate family's 2 * top_k // 3, as DALI sets it). Each copy is a whole expert over PCIe, which at
        batch 1 can cost more than the CPU computing it (benchmarks/RESULTS.md, H100 rows), hence the knob.
    cpu_threads: threads the CPU experts use inside graphs; 0 means torch's current thread count.
    mode: "exact" (the default: outputs are the unpatched model's) or "expert_deferral", KTransformers'
        approximate Expert Deferral: at every MoE layer but the last, each token's `deferred_experts`
        lowest-weight routed experts are left out of that layer's output and added to the residual stream
        after the next MoE layer's block instead (compile_passes/expert_deferral.py; compiled forwards only);
        or "daop_precalc", DAOP's approximate decode (prediction-based CPU pre-calculation with graceful
        degradation, see `precalc_from_layer`).
    deferred_experts: with mode "expert_deferral", how many of each token's top-k experts are deferred,
        1 <= deferred_experts < top_k (checked against the model's top-k when patching or compiling);
        0 with any other mode.
    precalc_from_layer: with mode "daop_precalc" (DAOP's approximate decode, compile_passes/daop_precalc.py;
        compiled decode forwards only), the first decoder-block index whose MoE layer takes its routing from
        its own router applied to the previous MoE layer's router input, swaps surplus CPU experts for
        resident ones, and computes its CPU experts on that earlier input. Earlier layers and prefill stay
        exact. A non-negative int; the paper's 5 by default (i + 1 for i >= 4), and only that default with other modes.
    """

    expert_budget: float | str = 0.25
    device: str = "auto"
    scheduler: str = AUTO
    cache_policy: str = AUTO
    cache_options: Mapping[str, object] | tuple[tuple[str, object], ...] = ()
    prefetcher: str = "none"
    hardware: str = ""
    expert_shape: str = ""
    cpu_weight_dtype: str = "model"
    cpu_weight_group_size: int = DEFAULT_GROUP_SIZE
    dense_weight_dtype: str = "model"
    dense_weight_group_size: int = 0
    staging_slots: int = 2
    cuda_graph: bool = True
    fills_per_step: int = 1
    prefetch_size: int = 0
    cpu_threads: int = 0
    mode: str = "exact"
    deferred_experts: int = 0
    precalc_from_layer: int = PRECALC_FROM_LAYER

    def __post_init__(self) -> None:
        object.__setattr__(self, "expert_budget", _budget_value(self.expert_budget))
        if self.cpu_weight_dtype not in CPU_WEIGHT_DTYPES:
            raise InputError(f"cpu_weight_dtype must be one of {CPU_WEIGHT_DTYPES}, got {self.cpu_weight_dtype!r}")
        if self.dense_weight_dtype not in DENSE_WEIGHT_DTYPES:
            raise InputError(
                f"dense_weight_dtype must be one of {DENSE_WEIGHT_DTYPES}, got {self.dense_weight_dtype!r}"
            )
        for name, least in (("cpu_weight_group_size", 1), ("dense_weight_group_size", 0)):
            value = getattr(self, name)
            if not is_count(value, least) or value % 32:
                zero = " (or 0)" if not least else ""
                raise InputError(f"{name} must be a positive multiple of 32{zero}, got {value!r}")
        if self.dense_weight_group_size and self.dense_weight_dtype == "model":
            raise InputError(
                f"dense_weight_group_size={self.dense_weight_group_size} groups quantised dense layers; set "
                "dense_weight_dtype='int8' or 'int4' too, or leave the group at 0"
            )
        for name in ("staging_slots", "fills_per_step", "prefetch_size", "cpu_threads"):
            value = getattr(self, name)
            if not is_count(value):
                raise InputError(f"{name} must be a non-negative int, got {value!r}")
        if self.prefetch_size and self.prefetcher == "none":
            raise InputError(
                f"prefetch_size={self.prefetch_size} needs a prefetcher (prefetcher='none' copies nothing)"
            )
        if not isinstance(self.cuda_graph, bool):
            raise TypeError(f"cuda_graph must be a bool, got {self.cuda_graph!r}")
        if self.device not in ("auto", "cuda", "cpu"):
            raise InputError(f"device must be 'auto', 'cuda' or 'cpu', got {self.device!r}")
        self.budget_bytes()  # validates the budget's range or size string
        self._check_mode()
        if self.hardware not in ("", "local", *HARDWARE):
            raise InputError(f"hardware must be '', 'local' or one of {sorted(HARDWARE)}, got {self.hardware!r}")
        if self.expert_shape not in ("", *EXPERT_SHAPES):
            raise InputError(f"expert_shape must be '' or one of {sorted(EXPERT_SHAPES)}, got {self.expert_shape!r}")
        if self.scheduler != AUTO:
            SCHEDULERS.check(self.scheduler)
        if self.cache_policy != AUTO:
            CACHE_POLICIES.check(self.cache_policy)
        PREFETCHERS.check(self.prefetcher)
        self._check_cache_options()

    @classmethod
    def from_stack_file(cls, path: str | os.PathLike[str], **fields: Any) -> HybridMoEConfig:
        """The config that runs the stack a tuning run saved (`hybrid-moe simulate --save-ours FILE`, ours tuned on a
        calibration trace with a hardware profile): its scheduler, cache policy and cache options, and `fields` for
        the rest; `hardware` defaults to "local", this machine's profile, which ours' placement weighs by. A file
        it cannot use (unreadable, malformed, or naming a policy or option value the runtime refuses) is an
        InputError naming it."""
        clash = sorted(set(fields) & set(STACK_FILE_FIELDS))
        if clash:
            raise InputError(f"stack file {path} sets {', '.join(clash)}: leave them out of the other fields")
        base = cls(**fields)  # the caller's own fields, checked before the file is read
        if not (base.budget_bytes() if isinstance(base.expert_budget, str) else base.expert_budget):
            raise InputError(
                f"stack file {path}: its placement and cache act on accelerator slots, and expert_budget "
                f"{base.expert_budget!r} gives none; give a budget above 0 or leave the stack file out"
            )
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise InputError(
                f"stack file {path}: cannot read it ({err}); write one with hybrid-moe simulate --save-ours"
            ) from None
        if not isinstance(data, dict) or type(data.get("format")) is not int or data["format"] != STACK_FILE_FORMAT:
            raise InputError(f"stack file {path}: not a stack file of format {STACK_FILE_FORMAT}")
        missing = [k for k in STACK_FILE_FIELDS if k not in data]
        unknown = sorted(set(data) - {"format", "tuned_on", *STACK_FILE_FIELDS})
        if missing or unknown:
            raise InputError(f"stack file {path}: missing {missing or 'nothing'}, unknown {unknown or 'nothing'}")
        if not isinstance(data["cache_options"], dict):
            raise InputError(f"stack file {path}: cache_options must be an object of names to values")
        stack = {k: data[k] for k in STACK_FILE_FIELDS}
        try:
            config = base.replace(**stack, hardware=fields.get("hardware", "local"))
            check_cache_values(config.cache_policy, config.cache_options)
        except (TypeError, ValueError) as err:
            raise InputError(f"stack file {path}: {err}") from None
        return config

    def for_device(self, device: torch.device | None = None) -> HybridMoEConfig:
        """This config with an "auto" scheduler and cache policy made concrete for experts whose slots are on
        `device` (default: `resolve_device()`, asked only then; see the class docstring); itself where both are
        named."""
        if AUTO not in (self.scheduler, self.cache_policy):
            return self
        device = device or self.resolve_device()
        fields: dict[str, Any] = {"scheduler": self.scheduler}
        if self.scheduler == AUTO:
            captured = device.type == "cuda" and self.cuda_graph
            fields["scheduler"] = "queue_aware" if captured else "cached_on_accelerator"
            if fields["scheduler"] == "queue_aware" and not self.hardware:
                fields["hardware"] = "local"  # ours weighs placements by cost: this machine's measured profile
        if self.cache_policy == AUTO:
            ours = fields["scheduler"] == "queue_aware"
            fields.update(cache_policy="dali_window" if ours else "lru", cache_options=OURS_WINDOW if ours else ())
        return self.replace(**fields)

    def _check_cache_options(self) -> None:
        options = self.cache_options
        if self.cache_policy == AUTO:
            if options:
                raise InputError(
                    f"cache_options {options!r} need a named cache_policy ('auto' chooses the policy and its settings)"
                )
            object.__setattr__(self, "cache_options", ())
            return
        pairs = list(options.items()) if isinstance(options, Mapping) else options
        if not isinstance(pairs, (list, tuple)) or not all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in pairs
        ):
            raise TypeError(f"cache_options must be a dict of parameter names to values, got {options!r}")
        names = [k for k, _ in pairs]
        allowed = CACHE_POLICIES.options(self.cache_policy)
        unknown = sorted(set(names) - set(allowed))
        if unknown:
            raise InputError(
                f"cache policy {self.cache_policy!r} takes no option(s) {unknown}; its options: "
                f"{', '.join(allowed) or 'none'}"
            )
        if len(set(names)) < len(names):
            raise InputError(f"cache_options names an option twice: {names}")
        object.__setattr__(self, "cache_options", tuple(sorted(pairs, key=lambda p: p[0])))

    def _check_mode(self) -> None:
        if self.mode not in MODES:
            raise InputError(f"mode must be one of {MODES}, got {self.mode!r}")
        n = self.deferred_experts
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"deferred_experts must be an int, got {n!r}")
        if self.mode != "expert_deferral" and n != 0:
            raise InputError(f"deferred_experts={n} needs mode='expert_deferral' (mode {self.mode!r} defers nothing)")
        if self.mode == "expert_deferral" and n < 1:
            raise InputError(f"mode='expert_deferral' needs deferred_experts >= 1 (and < the model's top-k), got {n}")
        start = self.precalc_from_layer
        if isinstance(start, bool) or not isinstance(start, int):
            raise TypeError(f"precalc_from_layer must be an int, got {start!r}")
        if start < 0:
            raise InputError(f"precalc_from_layer must be a decoder-block index >= 0, got {start}")
        if self.mode != "daop_precalc" and start != PRECALC_FROM_LAYER:
            raise InputError(
                f"precalc_from_layer={start} needs mode='daop_precalc' (mode {self.mode!r} predicts nothing)"
            )
        if self.mode == "daop_precalc" and self.prefetcher != "none":
            raise InputError(
                f"mode='daop_precalc' predicts each layer's routing itself and decides from the slot map "
                f"at that moment; prefetcher {self.prefetcher!r} would change the slots around it "
                "(use prefetcher='none')"
            )

    def compiled_fields(self) -> tuple:
        """The fields the compile passes read (expert_deferral.py, daop_precalc.py): a graph compiled for one
        layer is right for any layer of the same name and index whose config agrees on these (runtime/registry.py
        reuses handles on that basis). A pass that reads another field must add it here."""
        return self.mode, self.deferred_experts, self.precalc_from_layer

    def check_top_k(self, top_k: int) -> None:
        """With Expert Deferral, at least one of each token's `top_k` experts must stay immediate."""
        if self.mode == "expert_deferral" and not 0 < self.deferred_experts < top_k:
            raise InputError(
                f"deferred_experts must lie in [1, top_k - 1] = [1, {top_k - 1}] for a model that routes each "
                f"token to top_k = {top_k} experts, got {self.deferred_experts}"
            )

    @property
    def dense_group_size(self) -> int:
        """The group the dense layers are quantised in (with dense_weight_dtype int8 / int4)."""
        return self.dense_weight_group_size or self.cpu_weight_group_size

    def with_store_format(self, fmt: str, group: int) -> HybridMoEConfig:
        """This config for experts stored as `fmt` in groups of `group` (a prepared or GGUF store): the dense
        layers keep the group this config gives them."""
        dense_group = self.dense_group_size if self.dense_weight_dtype != "model" else 0
        return self.replace(cpu_weight_dtype=fmt, cpu_weight_group_size=group, dense_weight_group_size=dense_group)

    def replace(self, **overrides: Any) -> HybridMoEConfig:
        """A copy with fields overridden; unknown names are an error, not silently ignored."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown HybridMoEConfig field(s) {unknown}; known: {sorted(known)}")
        return dataclasses.replace(self, **overrides)

    def budget_bytes(self) -> int | None:
        """The absolute byte budget, or None when the budget is a fraction."""
        b = self.expert_budget
        if isinstance(b, str):
            size = parse_size(b)
            if size is None:
                raise InputError(
                    f"expert_budget {b!r} is not a size with a unit such as '512MiB', '6GB' or '1TiB' "
                    "(a fraction is a number, not a string: expert_budget=0.5)"
                )
            return size
        if not 0.0 <= b <= 1.0:  # a float by now (__post_init__); NaN fails too
            hint = " (a byte budget is a size with a unit, such as '6GiB')" if b > 1 else ""
            raise InputError(f"expert_budget fraction must lie in [0, 1], got {b!r}{hint}")
        return None

    def slots_per_layer(self, num_experts: int, expert_bytes: int, num_layers: int) -> int:
        """Accelerator slots each MoE layer gets under this budget."""
        total = self.budget_bytes()
        if total is None:
            return math.floor(float(self.expert_budget) * num_experts + 1e-9)
        return min(num_experts, total // max(1, expert_bytes * num_layers))

    def resolve_cpu_threads(self) -> int:
        return self.cpu_threads or torch.get_num_threads()

    def resolve_device(self) -> torch.device:
        """The accelerator device; the CPU stands in for it when no CUDA device exists."""
        if self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available()):
            if not torch.cuda.is_available():
                raise InputError("HybridMoEConfig(device='cuda') but no CUDA device is available; use device='auto'")
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def parse_size(text: str) -> int | None:
    """Bytes of a size with a unit ("512MiB", "6GB", "1.5 TiB"); None where `text` is not one."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", text)
    if not m or m.group(2).lower() not in _BYTE_UNITS:
        return None
    return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()])


def format_size(n: int) -> str:
    """`parse_size`'s inverse for printing: the largest binary unit `n` fills (a tiny model's memory is not 0.0 GiB)."""
    for unit in ("GiB", "MiB", "KiB"):
        if n >= _BYTE_UNITS[unit.lower()]:
            return f"{n / _BYTE_UNITS[unit.lower()]:.2f} {unit}"
    return f"{n} B"


def _budget_value(budget: object) -> float | str:
    """A size string as given; any real number (numpy scalars, 0-d tensors included) as a Python float."""
    if isinstance(budget, str):
        return budget
    if isinstance(budget, bool):
        raise TypeError("expert_budget must be a fraction or a size string such as '6GiB', not a bool")
    if isinstance(budget, torch.Tensor) and budget.numel() == 1 and not budget.is_complex():
        return float(budget)
    if isinstance(budget, numbers.Real):
        return float(budget)
    raise TypeError(f"expert_budget must be a fraction in [0, 1] or a size string such as '6GiB', got {budget!r}")
