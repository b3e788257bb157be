"""Prepared stores: a checkpoint whose routed experts are already in a host format (`hybrid-moe prepare`).

Quantising at every start costs minutes at real sizes; a prepared store is quantised once. It is a checkpoint
directory like any other (config, tokenizer, dense weights under their own names) whose experts are saved fused,
per MoE layer, in the host format: `<experts>.gate_up_proj` / `.down_proj` for bf16, and `.qdata` / `.qscale`
beside them for int8 / int4 (the store's own tensors, ops/quantize.py). `from_pretrained` reads them straight
into the store, expert by expert with no conversion: start-up is bounded by reading the file once.
`hybrid_moe_store.json` says which format and group size the experts hold.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .config import HybridMoEConfig
from .errors import InputError
from .ops.quantize import QuantizedWeight, laid_rows

MARKER = "hybrid_moe_store.json"
VERSION = 2  # 2: int8 / int4 group scales in fp16 (1 held them in fp32, which the kernel no longer reads)
SHARD_BYTES = 4 * 2**30
_NOT_COPIED = (".safetensors", ".safetensors.index.json", ".gguf", ".bin", ".pt", ".pth")


def read_marker(directory: Path) -> tuple[str, int] | None:
    """(cpu_weight_dtype, group size) of a prepared store's experts; None for an ordinary checkpoint. A store
    whose files changed since it was written (sizes, config.json's bytes) is refused: its experts were fused,
    quantised and sized for what config.json said then."""
    path = directory / MARKER
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
        fmt, group = meta["cpu_weight_dtype"], int(meta["group_size"])
        if meta["version"] != VERSION or fmt not in ("bfloat16", "int8", "int4"):
            raise ValueError(f"version {meta['version']}, format {fmt!r}")
        files = dict(meta.get("files", {}))  # stores written before 2026-11-30 record none
    except (ValueError, KeyError, TypeError) as err:
        raise InputError(f"{path} is not a prepared-store marker this version reads ({err}); prepare again") from None
    if changed := next((name for name, want in files.items() if _fingerprint(directory / name) != want), None):
        raise InputError(
            f"{directory}: {changed} is missing or changed since the store was prepared; prepare the original again"
        )
    return fmt, group


def _fingerprint(path: Path) -> str | None:
    """What the marker records of a store's file: config.json's digest, a weight file's size (reading every shard
    at each start would cost as much as the loading); None where the file is missing."""
    if not path.is_file():
        return None
    if path.suffix == ".json":
        return hashlib.sha256(path.read_bytes()).hexdigest()
    return str(path.stat().st_size)


def config_for(config: HybridMoEConfig, prepared: tuple[str, int], directory: Path) -> HybridMoEConfig:
    """The config to load a prepared store with: its format where the config asks for the default ("model");
    a different format or group asked for is an error (converting would undo what preparing saved); bf16 has no
    groups to differ."""
    fmt, group = prepared
    if config.cpu_weight_dtype == "model":
        return config.with_store_format(fmt, group)
    if config.cpu_weight_dtype != fmt or (fmt != "bfloat16" and config.cpu_weight_group_size != group):
        raise InputError(
            f"{directory} holds experts prepared as {fmt} (group {group}), but cpu_weight_dtype="
            f"{config.cpu_weight_dtype!r}, cpu_weight_group_size={config.cpu_weight_group_size} was asked for; "
            f"load it with cpu_weight_dtype={fmt!r}, cpu_weight_group_size={group}, or prepare the original again"
        )
    return config


def expert_keys(name: str, proj: str, quantised: bool) -> tuple[str, ...]:
    """A prepared layer's tensor names for one projection: (data, scale) when quantised, else (weight,)."""
    return (f"{name}.{proj}.qdata", f"{name}.{proj}.qscale") if quantised else (f"{name}.{proj}",)


def check_request(out: Path, config: HybridMoEConfig) -> None:
    """Refuse, before anything is read, an output that exists or a config that prepares nothing."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"{out} exists and is not an empty directory; pass a new one (nothing is overwritten)")
    blocking = next((parent for parent in out.absolute().parents if parent.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise InputError(f"{out}: {blocking} is a file, so no directory can be made there; pass another path")
    if blocking is not None:  # a directory made and removed there now, not found unwritable after the conversion
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".hybrid-moe-probe-", dir=blocking))
        except OSError as err:
            raise InputError(
                f"{out}: cannot make a directory in {blocking} ({err.strerror}); pass another path"
            ) from None
    if config.cpu_weight_dtype == "model":
        raise InputError("prepare needs a host format: pass cpu_weight_dtype bfloat16, int8 or int4")
    if config.dense_weight_dtype != "model":
        raise InputError(
            "prepare keeps the dense weights as the checkpoint has them; pass dense_weight_dtype when loading "
            "the prepared store instead"
        )


def write_store(model: torch.nn.Module, source: Path, out: Path, config: HybridMoEConfig) -> Path:
    """Write a model patched from checkpoint directory `source` (experts in `config.cpu_weight_dtype`) as a
    prepared store to `out`: written beside it under a temporary name, then renamed, so never half there."""
    tensors: dict[str, torch.Tensor | _Rows] = dict(_dense_tensors(model))
    for name, module in model.named_modules():
        layer = getattr(module, "_hybrid_moe_layer", None)
        if layer is None:
            continue
        for proj, host in (("gate_up_proj", layer.store.host_gate_up), ("down_proj", layer.store.host_down)):
            quantised = isinstance(host, QuantizedWeight)
            parts: tuple[torch.Tensor | _Rows, ...] = (host,)
            if isinstance(host, QuantizedWeight):
                parts = (_Rows(host.data, False), _Rows(host.scale, True)) if host.laid else (host.data, host.scale)
            tensors.update(zip(expert_keys(name, proj, quantised), parts))
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        _write_shards(tensors, partial, quantised=config.cpu_weight_dtype in ("int8", "int4"))
        for file in source.iterdir():
            if file.is_file() and not file.name.endswith(_NOT_COPIED):  # config, tokenizer, generation config
                shutil.copy2(file, partial / file.name)
        if (config_file := partial / "config.json").is_file():  # the dtype the store holds, which "auto" reads
            settings = json.loads(config_file.read_text())
            settings.pop("torch_dtype", None)
            config_file.write_text(json.dumps({**settings, "dtype": str(model.dtype).removeprefix("torch.")}, indent=2))
        weights = [f for f in partial.iterdir() if f.name.endswith(".safetensors") or f.name == "config.json"]
        meta = {
            "version": VERSION,
            "cpu_weight_dtype": config.cpu_weight_dtype,
            "group_size": config.cpu_weight_group_size,
            "source": str(source),
            "files": {f.name: _fingerprint(f) for f in sorted(weights)},
        }
        (partial / MARKER).write_text(json.dumps(meta, indent=1))
        if out.exists():
            out.rmdir()  # empty, as checked
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


def _dense_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer but the routed experts (which live in the stores), a tied tensor
    under its first name only (the loader ties them again)."""
    found: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        skip: set[str] = getattr(module, "_non_persistent_buffers_set", set())
        named = [*module._parameters.items(), *((n, b) for n, b in module._buffers.items() if n not in skip)]
        for name, tensor in named:
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            found[f"{prefix}.{name}" if prefix else name] = tensor.detach().contiguous()
    return found


@dataclass(frozen=True)
class _Rows:
    """Experts laid out for the CPU kernel (ops/quantize.py `lay_out`), written row by row as a store holds them:
    converted as their shard is written, not beside the whole model's."""

    laid: torch.Tensor
    scales: bool

    @property
    def nbytes(self) -> int:
        return self.laid.nbytes

    def tensor(self) -> torch.Tensor:
        return laid_rows(self.laid, self.scales)


def _write_shards(tensors: dict[str, torch.Tensor | _Rows], directory: Path, quantised: bool) -> None:
    """safetensors shards of at most SHARD_BYTES each (a larger tensor alone): a bf16 store's as transformers names
    them, with its index file (it loads them as the original); a `quantised` store's under names transformers does not
    look for, so that it refuses the directory instead of loading it with freshly initialised experts."""
    shards: list[dict[str, torch.Tensor | _Rows]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        if shards[-1] and size + tensor.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    weight_map = {}
    for i, shard in enumerate(tqdm(shards, desc="hybrid-moe: writing", unit="shard", leave=False), 1):
        file = f"{'hybrid-moe-store' if quantised else 'model'}-{i:05d}-of-{len(shards):05d}.safetensors"
        stored = {key: t.tensor() if isinstance(t, _Rows) else t for key, t in shard.items()}
        save_file(stored, str(directory / file), metadata={"format": "pt"})
        del stored  # before the next shard's conversion
        weight_map.update(dict.fromkeys(shard, file))
    if not quantised:  # the store's reader finds the shards either way
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
