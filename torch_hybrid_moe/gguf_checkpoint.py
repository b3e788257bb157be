"""GGUF files (llama.cpp's format) as a checkpoint for `from_pretrained`: `from_pretrained("dir/model-Q8_0.gguf")`.

llama.cpp and KTransformers users already hold their models as GGUF, most often quantised. The routed experts go
into the host store with no float round trip where GGUF's block is the store's group: a Q8_0 block (one fp16 scale,
32 int8 weights) is the int8 format at group 32, a Q4_0 block (one fp16 scale, 32 nibbles holding q + 8) is the int4
format at group 32 once its nibbles are reordered. Other types are dequantised by the `gguf` package and converted
into the requested host format; left at the default ("model"), the host format is the nearest to the file's own
(int8 for 5- to 8-bit types, int4 below, the model's dtype for float types; the widest where tensors differ), so a
4-bit file is not inflated to bf16 in host memory. Dense weights are dequantised into the model's dtype, as
transformers' GGUF loader does, with llama.cpp's conversions undone (Llama's rotary permutation of q / k,
DeepSeek's split of kv_b into k_b and v_b).

GGUF's metadata does not carry every field transformers' configs need (DeepSeek's routing groups, Qwen's shared
expert widths), so the model's `config.json` (the original checkpoint's) must sit beside the file; every tensor's
shape is checked against it before anything is allocated. Files split by `gguf-split` (`-00001-of-0000N.gguf`) load
from their first part. Nothing is unpickled or executed: the file is read with positioned reads.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tqdm.auto import tqdm

from .config import HybridMoEConfig
from .errors import InputError
from .ops.host_memory import fill_in_parallel
from .ops.quantize import BITS, SCALE_DTYPE, QuantizedWeight, dequantize, empty_cpu_format, set_expert
from .runtime.expert_store import HostWeight

# transformers model type -> GGUF architecture (llama.cpp writes Mixtral as "llama" with experts)
ARCHITECTURES = {
    "mixtral": "llama",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "deepseek_v2": "deepseek2",
    "deepseek_v3": "deepseek2",
}
BLOCK_ROWS = 4096  # dense rows dequantised at a time
GROUP = 32  # GGUF's block of weights sharing a scale in Q8_0 and Q4_0
Q = gguf.GGMLQuantizationType
_FLOAT = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
_DIRECT = {Q.Q8_0: "int8", Q.Q4_0: "int4"}  # read into the host format with no float round trip
_NEAR_INT8 = {Q.Q8_0, Q.Q8_1, Q.Q8_K, Q.Q6_K, Q.Q5_0, Q.Q5_1, Q.Q5_K}  # 5- to 8-bit; every other quantised type: int4
_Fill = Callable[[torch.Tensor], None]  # writes a dense weight into the tensor given
_SPLIT = re.compile(r"(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf")
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")  # config.json's expert count, by architecture
_BLOCK = re.compile(r"blk\.(?P<bid>\d+)\.")
# GGUF metadata (after "<architecture>.") against config.json: (key, config name, its value or None)
_SETTINGS: tuple[tuple[str, str, Callable[[Any], Any]], ...] = (
    ("block_count", "num_hidden_layers", lambda c: c.num_hidden_layers),
    ("expert_count", "experts", lambda c: next((getattr(c, a) for a in _EXPERTS if hasattr(c, a)), None)),
    ("expert_used_count", "num_experts_per_tok", lambda c: getattr(c, "num_experts_per_tok", None)),
    ("attention.head_count", "num_attention_heads", lambda c: c.num_attention_heads),
    ("attention.head_count_kv", "num_key_value_heads", lambda c: getattr(c, "num_key_value_heads", None)),
    ("attention.layer_norm_rms_epsilon", "rms_norm_eps", lambda c: getattr(c, "rms_norm_eps", None)),
    ("rope.freq_base", "rope_theta", lambda c: (getattr(c, "rope_parameters", None) or {}).get("rope_theta")),
    # a file of a long-context variant (yarn) beside its base model's config, whose positions rotate otherwise
    ("rope.scaling.factor", "rope factor", lambda c: (getattr(c, "rope_parameters", None) or {}).get("factor", 1.0)),
    ("expert_weights_scale", "routed_scaling_factor", lambda c: getattr(c, "routed_scaling_factor", None)),
    ("expert_group_count", "n_group", lambda c: getattr(c, "n_group", None)),
    ("expert_group_used_count", "topk_group", lambda c: getattr(c, "topk_group", None)),
    # llama.cpp's gating function (1 softmax, 2 sigmoid): DeepSeek-V2 and V3 share the GGUF architecture
    (
        "expert_gating_func",
        "model_type's gating (1 softmax, 2 sigmoid)",
        lambda c: {"deepseek_v2": 1, "deepseek_v3": 2}.get(c.model_type),
    ),
    ("expert_weights_norm", "norm_topk_prob", lambda c: getattr(c, "norm_topk_prob", None)),
)
_LAYER = re.compile(r"layers\.(?P<bid>\d+)\.")


def nearest_format(qtype: gguf.GGMLQuantizationType) -> str:
    """The host format (`cpu_weight_dtype`) that keeps a GGUF type's precision at the fewest bytes."""
    if qtype in _FLOAT:
        return "model"
    return "int8" if qtype in _NEAR_INT8 else "int4"


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape without its leading 1s: GGUF keeps Qwen's [1, hidden] shared-expert gate as [hidden]."""
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: where its bytes are, read row by row with positioned reads."""

    path: Path
    name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # in torch's order (GGUF lists dimensions innermost first)
    offset: int  # of its first byte in the file

    @property
    def row_bytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return self.shape[-1] // block * size

    def check_readable(self) -> GGUFTensor:
        """The tensor, if its type can be read into floats here; otherwise a one-line error saying what to do."""
        if self.qtype not in _FLOAT and not hasattr(gguf.quants, self.qtype.name):  # the package's dequantisers
            raise InputError(
                f"{self.path}: tensor {self.name} is GGML type {self.qtype.name}, which the gguf package cannot "
                "dequantise; requantise the file (llama-quantize) to Q8_0, Q4_0 or a K-quant"
            )
        return self

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[:-1], dtype=np.int64))

    def read(self, start: int, count: int) -> torch.Tensor:
        """Rows [start, start + count) of the tensor, its leading dimensions flattened, as raw bytes."""
        raw = torch.empty((count, self.row_bytes), dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.offset + start * self.row_bytes)
            if f.readinto(raw.numpy().data) != raw.nbytes:
                raise InputError(f"{self.path} ends inside tensor {self.name}: the file is truncated; fetch it again")
        return raw

    def to_float(self, raw: torch.Tensor) -> torch.Tensor:
        """Raw rows as floats: the file's own float type, or fp32 dequantised (Q8_0 / Q4_0 by torch, the same
        products as the `gguf` package's, which dequantises every other type)."""
        if self.qtype in _FLOAT:
            return raw.view(_FLOAT[self.qtype])
        if self.qtype in _DIRECT:
            bits, rows = BITS[_DIRECT[self.qtype]], raw.shape[0]
            data = torch.empty((rows, self.shape[-1] * bits // 8), dtype=torch.int8 if bits == 8 else torch.uint8)
            scale = torch.empty((rows, self.shape[-1] // GROUP), dtype=SCALE_DTYPE)
            self.into_store(raw, data, scale)
            return dequantize(data, scale, bits, GROUP)
        return torch.from_numpy(gguf.quants.dequantize(raw.numpy(), self.qtype))

    def into_store(self, raw: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> None:
        """Raw Q8_0 / Q4_0 rows into the store's rows of (data, fp16 scale) at group 32, bit for bit the same weights,
        in strided passes straight into them (this is most of a GGUF file's load time)."""
        blocks = raw.view(raw.shape[0], -1, gguf.GGML_QUANT_SIZES[self.qtype][1])
        scale.copy_(blocks[..., :2].view(torch.float16).squeeze(-1))
        quants = blocks[..., 2:]
        if self.qtype == Q.Q8_0:
            data.view(quants.shape).copy_(quants.view(torch.int8))
            return
        # Q4_0 holds weight j of a block in the low nibble of byte j and weight j + 16 in its high nibble; the store
        # holds weights 2i and 2i + 1 in the low and high nibble of byte i. Both encode q + 8: only the order changes.
        even, odd, out = quants[..., 0::2], quants[..., 1::2], data.view(quants.shape)
        out[..., :8] = (even & 15) | ((odd & 15) << 4)  # weights 0-15: low nibbles
        out[..., 8:] = (even >> 4) | (odd & 0xF0)  # weights 16-31: high nibbles


class GGUFCheckpoint:
    """A GGUF file (all parts of a split one), keyed by GGUF tensor names, with the config beside it."""

    def __init__(self, path: Path) -> None:
        if not path.is_file():
            raise InputError(f"{path} {'is a directory' if path.is_dir() else 'does not exist'}; pass a .gguf file")
        parts = [path]
        if match := _SPLIT.fullmatch(path.name):
            count = int(match["count"])
            parts = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
            missing = [p for p in parts if not p.is_file()]
            if missing:
                raise InputError(f"{missing[0]} is missing: {path.name} is one of {count} parts; download them all")
        self.path, self.directory = path, path.parent
        self.tensors: dict[str, GGUFTensor] = {}
        self.fields = self._index(parts[0])  # the first part carries the model's metadata
        for part in parts[1:]:
            self._index(part)
        self.architecture = str(self.fields.get("general.architecture", ""))

    def _index(self, path: Path) -> dict[str, object]:
        """Add one file's tensors to the index; returns its metadata."""
        size = path.stat().st_size
        if size < 24:  # magic, version, two counts
            raise InputError(f"{path} is {size} bytes, not a GGUF file; fetch it again")
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            try:
                header = _Header(view)
            except (struct.error, ValueError, UnicodeDecodeError) as err:
                raise InputError(f"{path} is not a GGUF file this loader reads ({err}); fetch it again") from None
        for name, (qtype, shape, offset) in header.tensors.items():
            if qtype not in gguf.GGML_QUANT_SIZES:
                raise InputError(f"{path}: tensor {name} has GGML type {qtype}, which this gguf package does not know")
            tensor = GGUFTensor(path, name, Q(qtype), shape, header.data_start + offset)
            if tensor.offset + tensor.rows * tensor.row_bytes > size:
                raise InputError(f"{path} ends inside tensor {name}: the file is truncated; fetch it again")
            self.tensors[name] = tensor
        return header.fields

    def model_config(self) -> Any:
        """The transformers config beside the file, checked against the file's architecture."""
        from transformers import AutoConfig

        if not (self.directory / "config.json").is_file():
            raise InputError(
                f"{self.directory} has no config.json: GGUF metadata lacks fields transformers needs; put the "
                f"original model's config.json (a few KB from its hub repository) beside {self.path.name}"
            )
        config = AutoConfig.from_pretrained(self.directory)
        want = ARCHITECTURES.get(config.model_type)
        if want is None:
            raise InputError(
                f"{self.directory / 'config.json'}: model type {config.model_type!r} is not supported from GGUF; "
                f"supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        if self.architecture != want:
            raise InputError(
                f"{self.path} holds a {self.architecture!r} model, config.json a {config.model_type!r} one (GGUF "
                f"{want!r}); put the config of the model the file was converted from beside it"
            )
        self._check_settings(config)
        return config

    def _check_settings(self, config: Any) -> None:
        """The file's own settings, where it has them, against config.json's: a config of another variant of the
        model can give every tensor its expected shape (fewer layers, other top-k, rope base) and load silently."""
        for key, name, read in _SETTINGS:
            if key == "attention.head_count_kv" and self.architecture == "deepseek2":
                continue  # llama.cpp writes DeepSeek's MLA as one key-value head
            ours, theirs = self.fields.get(f"{self.architecture}.{key}"), read(config)
            if not isinstance(ours, int | float) or theirs is None:
                continue
            same = ours == theirs if isinstance(ours, int) else math.isclose(ours, float(theirs), rel_tol=1e-5)
            if not same:
                raise InputError(
                    f"{self.path} says {self.architecture}.{key} = {ours}, config.json {name} = {theirs}; put the "
                    "config of the model the file was converted from beside it"
                )
        if getattr(config, "tie_word_embeddings", False) and "output.weight" in self.tensors:
            raise InputError(
                f"{self.path} holds an LM head of its own (output.weight), but config.json ties it to the embedding "
                "(tie_word_embeddings); put the config of the model the file was converted from beside it"
            )
        layers = config.num_hidden_layers
        extra = sorted({n for n in self.tensors if (m := _BLOCK.match(n)) and int(m["bid"]) >= layers})
        if extra:
            raise InputError(
                f"{self.path} holds {extra[0]}, beyond config.json's {layers} layers; put the config of the model "
                "the file was converted from beside it"
            )

    def host_config(self, config: HybridMoEConfig) -> HybridMoEConfig:
        """`config` with the default host format ("model") replaced by the nearest to the experts' GGUF types (so
        the model's dtype needs asking for by name: "bfloat16"). Asking for int8 / int4 at a group other than 32 on
        Q8_0 / Q4_0 experts quantises them a second time: allowed, with a warning saying how to avoid it."""
        fmt = config.cpu_weight_dtype
        if fmt != "model":
            if config.cpu_weight_group_size != GROUP and any(
                _DIRECT.get(t.qtype) == fmt for n, t in self.tensors.items() if "_exps." in n
            ):
                warnings.warn(
                    f"{self.path.name}: its {fmt} experts are re-quantised at group {config.cpu_weight_group_size}, "
                    f"losing precision; cpu_weight_group_size={GROUP} reads them as they are",
                    stacklevel=3,
                )
            return config
        kinds = {nearest_format(t.qtype) for name, t in self.tensors.items() if "_exps." in name}
        for fmt in ("model", "int8", "int4"):  # widest first
            if fmt in kinds:
                return config if fmt == "model" else config.with_store_format(fmt, GROUP)
        return config

    def expert_layout(self, name: str, experts: torch.nn.Module) -> dict[str, tuple[GGUFTensor, ...]]:
        """Layer `name`'s expert tensors: {"gate_up_proj": (gate, up), "down_proj": (down,)}, shapes checked."""
        match = _LAYER.search(name)
        bid = match["bid"] if match else "?"
        layout: dict[str, tuple[GGUFTensor, ...]] = {}
        for proj, kinds in (("gate_up_proj", ("FFN_GATE_EXP", "FFN_UP_EXP")), ("down_proj", ("FFN_DOWN_EXP",))):
            param = getattr(experts, proj)
            want = (param.shape[0], param.shape[1] // len(kinds), param.shape[2])
            found = []
            for kind in kinds:
                key = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[kind]].format(bid=bid) + ".weight"
                tensor = self.tensors.get(key)
                if tensor is None:
                    raise InputError(f"{self.path} lacks {key} (experts of {name}); is it a complete MoE GGUF file?")
                if tensor.shape != want:
                    raise InputError(
                        f"{self.path}: tensor {key} is {list(tensor.shape)}, the model's config wants {list(want)}; "
                        "config.json and the weights disagree"
                    )
                found.append(tensor.check_readable())
            layout[proj] = tuple(found)
        return layout

    def read_experts(
        self,
        experts: torch.nn.Module,
        layout: dict[str, tuple[GGUFTensor, ...]],
        fmt: str,
        group_size: int,
    ) -> tuple[HostWeight, HostWeight]:
        """The layer's experts in host format `fmt`, expert by expert on FILL_THREADS threads: Q8_0 / Q4_0 into
        int8 / int4 at group 32 as they are, any other type dequantised and converted."""
        out = []
        for proj, tensors in layout.items():
            param = getattr(experts, proj).data
            dst = param if fmt == "model" else empty_cpu_format(tuple(param.shape), param.dtype, fmt, group_size)

            def read(e: int, dst: HostWeight = dst, tensors: tuple[GGUFTensor, ...] = tensors) -> None:
                for part, tensor in enumerate(tensors):
                    rows = tensor.shape[1]
                    raw = tensor.read(e * rows, rows)
                    at = slice(part * rows, (part + 1) * rows)
                    if isinstance(dst, QuantizedWeight) and (_DIRECT.get(tensor.qtype), dst.group_size) == (fmt, GROUP):
                        tensor.into_store(raw, dst.data[e, at], dst.scale[e, at])
                    else:
                        set_expert(dst, e, tensor.to_float(raw).to(param.dtype), row=part * rows)

            fill_in_parallel(read, param.shape[0])
            out.append(dst)
        return out[0], out[1]

    def load_dense(self, model: torch.nn.Module, skip: set[str]) -> None:
        """Every other parameter and persistent buffer from its GGUF tensor, dequantised into the model's dtype;
        a missing or misshapen one is an error naming it."""
        cfg: Any = model.config
        arch = {n: a for a, n in gguf.MODEL_ARCH_NAMES.items()}.get(self.architecture)
        if arch is None:
            raise InputError(f"the installed gguf package does not know {self.architecture!r}: pip install -U gguf")
        names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
        by_tensor: dict[int, list[str]] = defaultdict(list)  # tied weights: one tensor, several names
        state = model.state_dict(keep_vars=True)
        for name, tensor in state.items():
            if name not in skip:
                by_tensor[id(tensor)].append(name)
        fills = {}
        for group in by_tensor.values():  # everything is found and checked before any weight is read
            target = state[group[0]]
            found = next((v for v in (self._dense(n, names, cfg) for n in group) if v is not None), None)
            if found is None:
                raise InputError(
                    f"{self.path} has no tensor for {group[0]} (GGUF name: {self._key(group[0], names)}); "
                    "config.json and the file disagree"
                )
            if _squeezed(found[0]) != _squeezed(tuple(target.shape)):
                raise InputError(
                    f"{self.path}: the tensor for {group[0]} is {list(found[0])}, the model's config wants "
                    f"{list(target.shape)}; config.json and the weights disagree"
                )
            fills[group[0]] = found[1]
        with torch.no_grad():
            for name, fill in tqdm(fills.items(), desc="loading dense weights", unit="tensor", leave=False):
                fill(state[name].data)

    @staticmethod
    def _key(name: str, names: gguf.TensorNameMap) -> str | None:
        """The GGUF name of transformers parameter `name` (DeepSeek-V3's `e_score_correction_bias` is `exp_probs_b`)."""
        for suffix, gguf_suffix in ((".weight", ".weight"), (".bias", ".bias"), ("_bias", ".bias")):
            if name.endswith(suffix) and (key := names.get_name(name.removesuffix(suffix))):
                return key + gguf_suffix
        return None

    def _dense(self, name: str, names: gguf.TensorNameMap, cfg: Any) -> tuple[tuple[int, ...], _Fill] | None:
        """Parameter `name`'s GGUF values: (their shape, a function filling a tensor with them, dequantised and with
        llama.cpp's conversions undone); None where the file lacks them."""
        key = self._key(name, names)
        if key is None:
            return None
        tensor = self.tensors.get(key)
        if tensor is None:
            if key == "output.weight":  # llama.cpp drops an LM head equal to the embedding
                return self._dense("model.embed_tokens.weight", names, cfg)
            if key.endswith(".attn_kv_b.weight"):
                return self._kv_b(key, cfg)
            return None
        tensor.check_readable()
        if self.architecture == "llama" and key.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = cfg.num_attention_heads if key.endswith("q.weight") else cfg.num_key_value_heads

            def unpermute(target: torch.Tensor) -> None:
                # convert_hf_to_gguf stored each head's rotary rows (half, dim) as (dim, half): swap back
                value = self._whole(tensor)
                target.copy_(value.view(heads, -1, 2, value.shape[-1]).transpose(1, 2).reshape(target.shape))

            return tensor.shape, unpermute
        return tensor.shape, lambda target: self._copy(tensor, target.view(tensor.rows, tensor.shape[-1]))

    def _kv_b(self, key: str, cfg: Any) -> tuple[tuple[int, ...], _Fill] | None:
        """DeepSeek's kv_b_proj from the k_b (per head, transposed) and v_b halves llama.cpp splits it into."""
        k_b = self.tensors.get(key.replace("attn_kv_b", "attn_k_b"))
        v_b = self.tensors.get(key.replace("attn_kv_b", "attn_v_b"))
        if k_b is None or v_b is None:
            return None
        heads, lora, nope, v = cfg.num_key_value_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
        for tensor, want in ((k_b, (heads, lora, nope)), (v_b, (heads, v, lora))):
            tensor.check_readable()
            if tensor.shape != want:
                raise InputError(
                    f"{self.path}: tensor {tensor.name} is {list(tensor.shape)}, the model's config wants "
                    f"{list(want)}; config.json and the weights disagree"
                )

        def join(target: torch.Tensor) -> None:
            k = self._whole(k_b).view(k_b.shape).transpose(1, 2)  # [heads, nope, lora]
            v = self._whole(v_b).view(v_b.shape)  # [heads, v, lora]
            target.copy_(torch.cat((k.to(v.dtype), v), dim=1).reshape(target.shape))

        return (heads * (nope + v), lora), join

    @staticmethod
    def _copy(tensor: GGUFTensor, target: torch.Tensor) -> None:
        """A [rows, columns] tensor into `target`, BLOCK_ROWS rows at a time (no fp32 copy of a whole LM head)."""
        for start in range(0, tensor.rows, BLOCK_ROWS):
            count = min(BLOCK_ROWS, tensor.rows - start)
            target[start : start + count].copy_(tensor.to_float(tensor.read(start, count)))

    @staticmethod
    def _whole(tensor: GGUFTensor) -> torch.Tensor:
        return tensor.to_float(tensor.read(0, tensor.rows))


class _Header:
    """A GGUF file's metadata and tensor index, parsed from its header (gguf.md, versions 2 and 3). Array values
    (a tokenizer's vocabulary: hundreds of thousands of strings) are skipped, not decoded: reading the index of a
    file with a 150k-token vocabulary takes milliseconds, not the seconds `gguf.GGUFReader` spends on them."""

    _SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    _STRING, _ARRAY = 8, 9

    def __init__(self, view: mmap.mmap) -> None:
        self.view, self.at = view, 4
        if view[:4] != b"GGUF":
            raise ValueError("no GGUF magic number")
        version = self._get("I")
        if version not in (2, 3):
            raise ValueError(f"version {version}: byte-swapped, or not 2 or 3")
        n_tensors, n_fields = self._get("Q"), self._get("Q")
        self.fields: dict[str, object] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._get("I"))
        self.tensors: dict[str, tuple[int, tuple[int, ...], int]] = {}  # name -> (GGML type, torch shape, offset)
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._get("I")
            if not 1 <= n_dims <= 4:  # ggml's tensors have at most 4 dimensions
                raise ValueError(f"tensor {name} has {n_dims} dimensions")
            dims = [self._get("Q") for _ in range(n_dims)]
            if min(dims) < 1:
                raise ValueError(f"tensor {name} has an empty dimension")
            qtype, offset = self._get("I"), self._get("Q")
            self.tensors[name] = (qtype, tuple(reversed(dims)), offset)
        alignment = self.fields.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        self.data_start = -(-self.at // alignment) * alignment

    def _get(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self.view, self.at)[0]
        self.at += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._get("Q")
        self.at += length
        if self.at > len(self.view):
            raise ValueError("a string runs past the end of the file")
        return bytes(self.view[self.at - length : self.at]).decode()

    def _value(self, kind: int) -> object:
        if kind in self._SCALARS:
            return self._get(self._SCALARS[kind])
        if kind == self._STRING:
            return self._string()
        if kind != self._ARRAY:
            raise ValueError(f"unknown metadata type {kind}")
        item, count = self._get("I"), self._get("Q")
        if item in self._SCALARS:
            self.at += count * struct.calcsize(self._SCALARS[item])
        else:
            for _ in range(count):  # strings (or nested arrays): each says its own length
                self._value(item)
        return None
