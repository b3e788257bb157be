"""Load a transformers MoE checkpoint straight into hybrid placement: `from_pretrained(path, config)`.

`AutoModelForCausalLM.from_pretrained` + `patch_model` holds every expert in host memory in a float type, and
keeps the safetensors file mapping resident beside the fused copies transformers makes of per-expert tensors:
peak host memory about twice the checkpoint. Here the model is built with uninitialised parameters (no page
touched), the dense weights are copied in from the shards, and each MoE layer's experts are read into place
while it is patched, one layer at a time, then converted to the host format (`cpu_weight_dtype`). Peak host
memory is about the final store plus the dense weights plus one layer in the model's dtype; in the model's
dtype the experts are read straight into the memory the store keeps. Dense linears that `dense_weight_dtype`
quantises are read and quantised a block of rows at a time, and the input embedding stays mapped in the file
(a token reads one row of it): with int8 weights the process peaks at 1.06x llama.cpp's resident memory on
the same model (benchmarks/RESULTS.md).

Checkpoint layouts: per-expert tensors (`experts.N.gate_proj/up_proj/down_proj.weight`, Mixtral's
`block_sparse_moe.experts.N.w1/w3/w2.weight` under transformers' own renaming) fused as transformers fuses
them (gate rows, then up rows), or already fused `experts.gate_up_proj` / `experts.down_proj`.
"""

from __future__ import annotations

import json
import re
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from tqdm.auto import tqdm

from .config import HybridMoEConfig
from .errors import InputError
from .model_patches import ARCHITECTURES
from .model_patches.base import check_structure, dense_linears, patch_with_spec
from .ops.host_memory import advise_huge_pages, fill_in_parallel
from .ops.quantize import QuantizedWeight, block_rows, empty_cpu_format, set_expert
from .prepared import MARKER, check_request, config_for, expert_keys, read_marker, write_store
from .runtime.expert_store import HostWeight

if TYPE_CHECKING:
    from .gguf_checkpoint import GGUFCheckpoint

_PER_EXPERT = re.compile(
    r"(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)"
    r"\.weight"
)
_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def from_pretrained(
    name_or_path: str | Path,
    config: HybridMoEConfig | None = None,
    dtype: torch.dtype | str = "auto",
    **overrides: object,
) -> torch.nn.Module:
    """A patched model from a local checkpoint directory or hub id, experts streamed into the store.

    Equivalent to `AutoModelForCausalLM.from_pretrained(path, dtype=dtype)` + `patch_model(model, config)` in its
    outputs, with about half the peak host memory. `dtype`: the model's compute dtype ("auto": the checkpoint's).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.initialization import no_init_weights

    config = (config or HybridMoEConfig()).replace(**overrides)
    source: Checkpoint | GGUFCheckpoint
    if str(name_or_path).endswith(".gguf"):
        from .gguf_checkpoint import GGUFCheckpoint  # imports the gguf package: only for GGUF files

        source = GGUFCheckpoint(Path(name_or_path))
        directory, model_config = source.directory, source.model_config()
        config = source.host_config(config)
    else:
        directory = local_directory(str(name_or_path))
        try:
            model_config = AutoConfig.from_pretrained(directory)
        except (OSError, ValueError) as err:  # malformed JSON, no model_type, a type transformers does not know
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise InputError(f"{directory}/config.json cannot be read ({first}); write it again") from None
        if model_config.model_type not in ARCHITECTURES:
            raise InputError(
                f"{name_or_path}: model type {model_config.model_type!r} is not supported; supported: "
                f"{', '.join(sorted(ARCHITECTURES))}"
            )
        if quantization := getattr(model_config, "quantization_config", None):
            fields = quantization if isinstance(quantization, dict) else vars(quantization)
            raise InputError(
                f"{name_or_path} is quantised ({fields.get('quant_method', 'a quantization_config')}), which this "
                "loader does not read; pass its bf16 / fp16 original (cpu_weight_dtype 'int8' / 'int4' quantises "
                "it) or a GGUF file"
            )
        prepared = read_marker(directory)
        if prepared is not None:  # experts already in a host format: read as they are
            config = config_for(config, prepared, directory)
        quantised_store = prepared is not None and prepared[0] in ("int8", "int4")
        source = Checkpoint(directory, model_config.model_type, quantised_store)
    if dtype == "auto":  # as transformers: config.json's dtype, else the stored weights' (GGUF: dequantised to fp32)
        stored = source.stored_dtype() if isinstance(source, Checkpoint) else torch.float32
        dtype = getattr(model_config, "dtype", None) or stored
    with no_init_weights():  # parameters stay torch.empty: allocated, never touched, so not resident
        model = AutoModelForCausalLM.from_config(model_config, dtype=dtype)
    model.tie_weights()  # tied weights (tie_word_embeddings) become one tensor, loaded under either name
    check_structure(model, ARCHITECTURES[model_config.model_type], config)  # before any weight is read
    for tensor in (*model.parameters(), *model.buffers()):  # untouched yet: ask for huge pages before loading
        advise_huge_pages(tensor)
    experts = {
        module: name
        for name, module in model.named_modules()
        if name.endswith(".experts") and isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
    }
    layout = {name: source.expert_layout(name, module) for module, name in experts.items()}
    checkpoint = source if isinstance(source, Checkpoint) else None  # GGUF: dense weights are read dequantised
    quantised = _quantised_linears(model, config, checkpoint) if checkpoint else {}
    mapped = _mapped_embedding(model, checkpoint) if checkpoint else set()
    source.load_dense(
        model,
        skip={f"{name}.{p}" for name in layout for p in ("gate_up_proj", "down_proj")}
        | set(quantised.values())
        | mapped,
    )
    if (directory / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(directory)
    model.eval()
    fmt, group = config.cpu_weight_dtype, config.cpu_weight_group_size
    return patch_with_spec(
        model,
        ARCHITECTURES[model_config.model_type],
        config,
        read_experts=lambda module: source.read_experts(module, layout[experts[module]], fmt, group),
        read_linear=lambda linear: (
            checkpoint.read_quantized(
                quantised[linear], linear.weight.dtype, config.dense_weight_dtype, config.dense_group_size
            )
            if checkpoint and linear in quantised
            else None
        ),
    )


def prepare(source: str | Path, out: str | Path, config: HybridMoEConfig, dtype: torch.dtype | str = "auto") -> Path:
    """Write checkpoint `source` (a directory or hub id) as a prepared store (prepared.py) in
    `config.cpu_weight_dtype` to the new directory `out`, which `from_pretrained` then loads with no conversion."""
    out = Path(out).absolute()  # "." names its directory: the store is written beside it, then renamed
    check_request(out, config)
    if str(source).endswith(".gguf"):
        raise InputError(
            f"{source}: a GGUF file loads without preparing (its Q8_0 / Q4_0 experts as they are); pass it "
            "to from_pretrained or `hybrid-moe generate --model` instead"
        )
    directory = local_directory(str(source))
    if read_marker(directory) is not None:
        raise InputError(f"{directory} is already a prepared store; prepare the original checkpoint")
    model = from_pretrained(directory, config.replace(expert_budget=0.0, device="cpu"), dtype=dtype)
    return write_store(model, directory, out, config)


def _untied(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers held under one name only (not tied to another)."""
    state = model.state_dict(keep_vars=True)
    names = defaultdict(list)
    for name, tensor in state.items():
        names[id(tensor)].append(name)
    return {name: tensor for name, tensor in state.items() if len(names[id(tensor)]) == 1}


def _quantised_linears(
    model: torch.nn.Module, config: HybridMoEConfig, checkpoint: Checkpoint
) -> dict[torch.nn.Linear, str]:
    """{linear: its weight's name} for the linears `dense_weight_dtype` quantises whose weight is their own: they are
    read and quantised a block of rows at a time when patching asks (never held in the model's dtype)."""
    if config.dense_weight_dtype == "model":
        return {}
    untied, names = _untied(model), {module: name for name, module in model.named_modules()}
    linears = {
        linear: f"{names[linear]}.weight" for _, _, linear in dense_linears(model, config, config.resolve_device())
    }
    chosen = {linear: name for linear, name in linears.items() if name in untied and name in checkpoint.source}
    for linear, name in chosen.items():  # checked now: nothing else reads these before patching quantises them
        key, shard = checkpoint.source[name]
        if shard.shape(key) != tuple(linear.weight.shape):
            raise InputError(
                f"checkpoint tensor {key} is {list(shard.shape(key))}, the model's config wants "
                f"{list(linear.weight.shape)}; config.json and the weights disagree"
            )
    return chosen


def _mapped_embedding(model: torch.nn.Module, checkpoint: Checkpoint) -> set[str]:
    """Leave the input embedding in the checkpoint file, mapped (its name, or nothing): a token reads one row of it,
    so only the rows of tokens seen become resident, as in llama.cpp (0.6 GB of Qwen3's 151936-token table that
    would otherwise be read in and kept). Only where the table is its own (an LM head tied to it reads every row)
    and stored in the model's dtype."""
    embedding = model.get_input_embeddings()
    name = next((n for n, t in _untied(model).items() if t is embedding.weight), None)
    if name is None or name not in checkpoint.source:
        return set()
    key, shard = checkpoint.source[name]
    if shard.tensors[key][:2] != (embedding.weight.dtype, tuple(embedding.weight.shape)):
        return set()
    if (shard.start + shard.tensors[key][2]) % embedding.weight.dtype.itemsize:  # a header not padded to 8 bytes
        return set()
    # save_pretrained into the checkpoint's own directory is safe: safetensors writes a new file and renames it
    # over the old, whose mapping stays valid (tested).
    embedding.weight.data = shard.map(key)
    return {name}


def local_directory(name: str, patterns: list[str] = _HUB_FILES) -> Path:
    """A checkpoint directory: as given, or a hub id's snapshot of the files matching `patterns` (downloaded, or
    from the local cache offline)."""
    from .embedded import resolve_model

    resolved = Path(resolve_model(name))
    if resolved.is_dir():
        return resolved
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=patterns))
    except Exception as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise InputError(
            f"cannot fetch {name!r} from the hub ({type(err).__name__}: {first}); pass a local "
            "checkpoint directory, or unset HF_HUB_OFFLINE where the hub is reachable"
        ) from None


@dataclass(frozen=True)
class ExpertSources:
    """One layer's expert tensors in a checkpoint: {"gate_up_proj" / "down_proj": [(key, shard)]}, either one
    fused tensor each, or per expert in expert order (gate_up: gate then up of each expert)."""

    fused: bool
    sources: dict[str, list[tuple[str, Shard]]]


class Checkpoint:
    """The safetensors shards of a checkpoint, keyed by the names the transformers model uses."""

    def __init__(self, directory: Path, model_type: str, quantised_store: bool = False) -> None:
        from transformers.conversion_mapping import (
            WeightRenaming,
            get_checkpoint_conversion_mapping,
        )

        index = directory / "model.safetensors.index.json"
        self.index_dtype: torch.dtype | None = None  # the index's metadata dtype, which transformers' "auto" takes
        if index.is_file():
            try:
                meta = json.loads(index.read_text())
                files = sorted(set(meta["weight_map"].values()))
                if not files:
                    raise ValueError("its weight_map names no file")
                named = (meta.get("metadata") or {}).get("dtype")
                self.index_dtype = getattr(torch, named) if named is not None else None
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                raise InputError(
                    f"{index} is not a safetensors index ({type(err).__name__}: {err}); write it again"
                ) from None
            if absent := [f for f in files if not (directory / f).is_file()]:
                raise InputError(
                    f"{index} names {len(absent)} file(s) not in {directory} (first: {absent[0]}); fetch every shard"
                )
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
            if not files:
                raise InputError(
                    f"{directory} has no *.safetensors files; convert the checkpoint with "
                    "transformers' save_pretrained (safe_serialization) first"
                )
        renamings = [
            (s, t)
            for rule in get_checkpoint_conversion_mapping(model_type) or []
            if isinstance(rule, WeightRenaming)
            for s, t in zip(rule.source_patterns, rule.target_patterns)
        ]
        self.directory = directory
        self.quantised_store = quantised_store  # a prepared store of int8 / int4 experts (prepared.py)
        self.source: dict[str, tuple[str, Shard]] = {}  # model-side name -> (checkpoint key, shard)
        # per-expert tensors by layer prefix: {prefix: [(expert, role, source)]}, indexed once for all layers
        self.per_expert: dict[str, list[tuple[int, str, tuple[str, Shard]]]] = defaultdict(list)
        self.shards = [Shard(directory / file) for file in files]
        for shard in self.shards:
            for key in shard.tensors:
                name = key
                for pattern, target in renamings:
                    name = re.sub(pattern, target, name)
                self.source[name] = (key, shard)
                if match := _PER_EXPERT.fullmatch(name):
                    self.per_expert[match["prefix"]].append((int(match["expert"]), _ROLE[match["proj"]], (key, shard)))
        if not quantised_store and any(name.endswith(".qdata") for name in self.source):
            raise InputError(
                f"{directory} holds prepared experts (*.qdata) but no {MARKER}; prepare the original checkpoint again"
            )

    def stored_dtype(self) -> torch.dtype:
        """What transformers' dtype="auto" takes when config.json names none: the index's metadata dtype, else the
        first floating tensor by name in the first file (fp8 skipped); fp32 where there is none. A mixed checkpoint
        (bf16 with an fp32 router) loads in the same dtype as transformers'."""
        if self.index_dtype is not None:
            return self.index_dtype
        first = self.shards[0].tensors
        dtypes = (first[key][0] for key in sorted(first))
        return next((d for d in dtypes if d.is_floating_point and d.itemsize > 1), torch.float32)

    def expert_layout(self, name: str, experts: torch.nn.Module) -> ExpertSources:
        """Where layer `name`'s experts are in the checkpoint, checked against the model's shapes."""
        if self.quantised_store:
            return self._prepared_layout(name)
        num_experts, two_inter, hidden = experts.gate_up_proj.shape
        fused = {p: self.source.get(f"{name}.{p}") for p in ("gate_up_proj", "down_proj")}
        is_fused = all(fused.values())
        if is_fused:
            want = {"gate_up_proj": experts.gate_up_proj.shape, "down_proj": experts.down_proj.shape}
            layout = cast(dict[str, list[tuple[str, Shard]]], {p: [fused[p]] for p in fused})  # all found
        else:
            roles: dict[str, list[tuple[str, Shard] | None]] = {
                "gate": [None] * num_experts,
                "up": [None] * num_experts,
                "down": [None] * num_experts,
            }
            for expert, role, source in self.per_expert.get(name, []):
                if expert < num_experts:
                    roles[role][expert] = source
            missing = [f"{name}.{e}.{role}" for role, found in roles.items() for e, s in enumerate(found) if s is None]
            if missing:
                raise InputError(
                    f"checkpoint {self.directory} lacks {len(missing)} expert tensors of {name} (first: "
                    f"{missing[0]}); is it a complete {experts.__class__.__name__} checkpoint?"
                )
            layout = cast(  # none missing, as just checked
                dict[str, list[tuple[str, Shard]]],
                {
                    "gate_up_proj": [s for e in range(num_experts) for s in (roles["gate"][e], roles["up"][e])],
                    "down_proj": roles["down"],
                },
            )
            want = {"gate_up_proj": (two_inter // 2, hidden), "down_proj": (hidden, two_inter // 2)}
        for proj, sources in layout.items():
            for key, shard in sources:
                if shard.shape(key) != tuple(want[proj]):
                    raise InputError(
                        f"checkpoint tensor {key} is {list(shard.shape(key))}, the model's config wants "
                        f"{list(want[proj])}; config.json and the weights disagree"
                    )
        return ExpertSources(is_fused, layout)

    def read_experts(
        self, experts: torch.nn.Module, layout: ExpertSources, fmt: str, group_size: int
    ) -> tuple[HostWeight, HostWeight]:
        """The layer's experts in host format `fmt`, read expert by expert. In the model's dtype they are read
        into the module's own uninitialised tensors, which the store then keeps; stored in the host format (a bf16
        checkpoint or prepared store read as bf16) straight into the store's. Those reads run on FILL_THREADS threads at
        once (most of their time is the kernel faulting in the fresh memory they land in: zeroing, huge-page
        compaction, on the reading thread's core). Otherwise a block of rows at a time through one reused buffer,
        converted as read: a Mixtral expert's whole gate / up in bf16 and its fp32 temporaries held 0.3 GB above the
        store's footprint while it loaded (benchmarks/RESULTS.md, 2026-12-01)."""
        if self.quantised_store:
            return self._read_prepared(experts, layout, fmt, group_size)
        out = []
        for proj, sources in layout.sources.items():
            param = getattr(experts, proj).data
            rows, cols = param.shape[1:]
            per_expert = len(sources) // param.shape[0]  # unfused: 2 for gate_up (gate, up), 1 for down

            def pieces(e: int, sources: list = sources, per_expert: int = per_expert, rows: int = rows) -> list[Piece]:
                if layout.fused:
                    return [(*sources[0], e, 0)]
                part = rows // per_expert
                return [(*s, None, p * part) for p, s in enumerate(sources[e * per_expert :][:per_expert])]

            dst = param if fmt == "model" else empty_cpu_format(tuple(param.shape), param.dtype, fmt, group_size)
            key, shard = sources[0]
            if isinstance(dst, torch.Tensor) and shard.tensors[key][0] == dst.dtype:  # stored as kept: no conversion

                def read(e: int, dst: torch.Tensor = dst, pieces: Callable[..., list[Piece]] = pieces) -> None:
                    for key, shard, index, first, end in _spans(pieces(e), dst.shape[1]):
                        shard.read(key, dst[e, first:end], index=index)

                fill_in_parallel(read, param.shape[0])
            else:
                for e in range(param.shape[0]):
                    _read_in_blocks(dst, e, pieces(e), rows, cols, param.dtype)
            out.append(dst)
        return out[0], out[1]

    def _prepared_layout(self, name: str) -> ExpertSources:
        """Where a prepared store keeps layer `name`'s int8 / int4 experts: (data, scale) per projection."""
        sources = {}
        for proj in ("gate_up_proj", "down_proj"):
            keys = expert_keys(name, proj, quantised=True)
            missing = [k for k in keys if k not in self.source]
            if missing:
                raise InputError(f"prepared store {self.directory} lacks {missing[0]}; prepare it again")
            sources[proj] = [self.source[k] for k in keys]
        return ExpertSources(True, sources)

    def _read_prepared(
        self, experts: torch.nn.Module, layout: ExpertSources, fmt: str, group_size: int
    ) -> tuple[HostWeight, HostWeight]:
        """A prepared layer's int8 / int4 experts, read into the store's format with no conversion."""
        out = []
        for proj, ((data_key, data_shard), (scale_key, scale_shard)) in layout.sources.items():
            param = getattr(experts, proj)
            dst = empty_cpu_format(tuple(param.shape), param.dtype, fmt, group_size)
            assert isinstance(dst, QuantizedWeight)  # fmt is int8 or int4 here
            for key, shard, into in ((data_key, data_shard, dst.data), (scale_key, scale_shard, dst.scale)):
                if shard.shape(key) != tuple(into.shape) or shard.tensors[key][0] != into.dtype:
                    raise InputError(
                        f"prepared tensor {key} is {shard.tensors[key][0]} {list(shard.shape(key))}, the model's "
                        f"config wants {into.dtype} {list(into.shape)}; config.json and the store disagree"
                    )
                fill_in_parallel(lambda e, k=key, s=shard, into=into: s.read(k, into[e], index=e), len(into))
            out.append(dst)
        return out[0], out[1]

    def read_quantized(self, name: str, dtype: torch.dtype, fmt: str, group_size: int) -> QuantizedWeight:
        """2-D weight `name` in int8 / int4 `fmt`, as quantising it in `dtype` gives, read `block_rows` at a time."""
        key, shard = self.source[name]
        rows, cols = shard.shape(key)
        dst = empty_cpu_format((1, rows, cols), dtype, fmt, group_size)
        assert isinstance(dst, QuantizedWeight)  # fmt is int8 or int4 (a dense_weight_dtype other than "model")
        _read_in_blocks(dst, 0, [(key, shard, None, 0)], rows, cols, dtype)
        return dst

    def load_dense(self, model: torch.nn.Module, skip: set[str]) -> None:
        """Copy every other parameter and persistent buffer in; a missing one is an error."""
        state = model.state_dict(keep_vars=True)
        wanted = {name: tensor for name, tensor in state.items() if name not in skip}
        by_tensor: dict[int, list[str]] = defaultdict(list)  # tied weights: one tensor, several names
        for name, tensor in wanted.items():
            by_tensor[id(tensor)].append(name)
        stored = [[n for n in names if n in self.source] for names in by_tensor.values()]
        missing = [names[0] for names, have in zip(by_tensor.values(), stored) if not have]
        if missing:
            raise InputError(
                f"checkpoint {self.directory} lacks {len(missing)} of the model's weights (first: "
                f"{missing[0]}); config.json and the weights disagree"
            )
        ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
        unused = [  # neither a model tensor nor an expert's: read by nothing (transformers lists them too)
            name
            for name in self.source
            if name not in state
            and not _PER_EXPERT.fullmatch(name)
            and not name.endswith((".qdata", ".qscale"))
            and not any(p.search(name) for p in ignored)
        ]
        if unused:
            warnings.warn(
                f"checkpoint {self.directory} holds {len(unused)} tensor(s) the model does not use (first: "
                f"{unused[0]}), left unread; check that config.json describes these weights",
                stacklevel=3,
            )
        with torch.no_grad():
            for first, *others in tqdm(stored, desc="loading dense weights", unit="tensor", leave=False):
                key, shard = self.source[first]
                shard.read(key, wanted[first].data)
                for name in others:  # tied names the file holds too: tied only where equal, as transformers ties
                    own = torch.empty_like(wanted[first].data)
                    self.source[name][1].read(self.source[name][0], own)
                    if not torch.equal(own, wanted[first].data):
                        _untie(model, name, own, first)


def _untie(model: torch.nn.Module, name: str, values: torch.Tensor, tied_to: str) -> None:
    """Parameter `name` as its own tensor of `values`, no longer `tied_to`'s: the config ties them, but the
    checkpoint holds both, different (transformers then leaves them untied, and says so)."""
    module, attr = name.rsplit(".", 1)
    old = model.get_parameter(name)
    setattr(model.get_submodule(module), attr, torch.nn.Parameter(values, requires_grad=old.requires_grad))
    getattr(model, "all_tied_weights_keys", {}).pop(name, None)
    warnings.warn(
        f"config.json ties {name} to {tied_to}, but the checkpoint holds both, with different values: loaded "
        "untied (as transformers does); set tie_word_embeddings=False in config.json to silence this",
        stacklevel=4,
    )


Piece = tuple[str, "Shard", int | None, int]  # (key, shard, index along its first dimension or None, first row)


def _spans(pieces: list[Piece], rows: int) -> Iterator[tuple[str, Shard, int | None, int, int]]:
    """Each piece with the expert's rows it holds, [first, end): up to the next piece's first row, or `rows`."""
    ends = [first for _, _, _, first in pieces[1:]] + [rows]
    return ((key, shard, index, first, end) for (key, shard, index, first), end in zip(pieces, ends))


def _read_in_blocks(
    dst: HostWeight, expert: int, pieces: list[Piece], rows: int, cols: int, dtype: torch.dtype
) -> None:
    """Rows [0, rows) of expert `expert` of `dst` from `pieces`, read and converted `block_rows(cols)` rows at a time
    through one buffer in `dtype`."""
    step = block_rows(cols)
    buffer = torch.empty((min(rows, step), cols), dtype=dtype)
    for key, shard, index, first, end in _spans(pieces, rows):
        for start in range(first, end, step):
            block = buffer[: min(end, start + step) - start]
            shard.read(key, block, index=index, rows=(start - first, start - first + block.shape[0]))
            set_expert(dst, expert, block, row=start)


class Shard:
    """One safetensors file, read with plain positioned reads into caller-owned memory: no file mapping, so
    nothing of the checkpoint stays resident in this process (mapped pages would count until unmapped)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            size = int.from_bytes(head, "little")
            try:
                if len(head) < 8 or size > file_size - 8:  # a git-lfs pointer, an HTML error page, an empty file
                    raise ValueError(f"its first 8 bytes give a {size}-byte header in a {file_size}-byte file")
                header = json.loads(f.read(size))
                if not isinstance(header, dict):
                    raise ValueError("its header is not a JSON object")
            except ValueError as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                raise InputError(
                    f"{path} is not a safetensors file ({err}); a git-lfs pointer? fetch the real file "
                    "(git lfs pull) or write it again"
                ) from None
        header.pop("__metadata__", None)
        self.start = 8 + size
        self.tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}  # key -> (dtype, shape, offset)
        for key, entry in header.items():
            try:
                named, shape, (begin, stop) = (
                    entry["dtype"],
                    tuple(int(n) for n in entry["shape"]),
                    entry["data_offsets"],
                )
            except (KeyError, TypeError, ValueError):
                raise InputError(
                    f"{path}: tensor {key}'s header entry is malformed: the file is corrupt; write it again"
                ) from None
            if named not in _SAFETENSORS_DTYPES:
                raise InputError(f"{path}: tensor {key} has dtype {named}, which this loader does not read")
            dtype = _SAFETENSORS_DTYPES[named]
            if stop - begin != torch.Size(shape).numel() * dtype.itemsize or begin < 0:
                raise InputError(
                    f"{path}: tensor {key}'s header gives {stop - begin} bytes at offset {begin} for {named} "
                    f"{list(shape)}: the file is corrupt; write it again"
                )
            self.tensors[key] = (dtype, shape, begin)
        end = self.start + max((entry["data_offsets"][1] for entry in header.values()), default=0)
        if path.stat().st_size < end:
            raise InputError(
                f"{path} is {path.stat().st_size} bytes, its header describes {end}: the file is "
                "truncated; download it again"
            )

    def shape(self, key: str) -> tuple[int, ...]:
        return self.tensors[key][1]

    def read(self, key: str, into: torch.Tensor, index: int | None = None, rows: tuple[int, int] | None = None) -> None:
        """Tensor `key` (its `index`-th slice along the first dimension, or its `rows` [start, stop), if given) into
        `into`, converting dtype; read straight into `into` when it is contiguous and of the stored dtype."""
        dtype, shape, offset = self.tensors[key]
        if index is not None:
            shape = shape[1:]
            offset += index * torch.Size(shape).numel() * dtype.itemsize
        if rows is not None:
            offset += rows[0] * torch.Size(shape[1:]).numel() * dtype.itemsize
            shape = (rows[1] - rows[0], *shape[1:])
        if tuple(into.shape) != tuple(shape):
            raise InputError(
                f"{self.path}: tensor {key} is {list(shape)}, the model wants {list(into.shape)}; "
                "config.json and the weights disagree"
            )
        if into.dtype.is_floating_point and not dtype.is_floating_point:
            raise InputError(
                f"{self.path}: tensor {key} holds {dtype} values, the model wants {into.dtype} weights; is the "
                "checkpoint quantised (load its bf16 / fp16 original)?"
            )
        target = into if into.dtype == dtype and into.is_contiguous() else torch.empty(shape, dtype=dtype)
        with open(self.path, "rb") as f:
            f.seek(self.start + offset)
            if f.readinto(target.view(-1).view(torch.uint8).numpy()) != target.nbytes:
                raise InputError(f"{self.path} ends inside tensor {key}: the file is truncated; download it again")
        if target is not into:
            into.copy_(target)

    def map(self, key: str) -> torch.Tensor:
        """Tensor `key` as a view of a private mapping of the file: its pages are read in, and count as resident,
        only where the tensor is read."""
        dtype, shape, offset = self.tensors[key]
        file = torch.from_file(str(self.path), shared=False, size=self.path.stat().st_size, dtype=torch.uint8)
        start = self.start + offset
        return file[start : start + torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)
