"""Expert-activation traces: what every MoE layer routed, token by token, for the simulator and policies.

File format (version 1): one safetensors file. Its metadata holds "hybrid_moe_trace" = JSON with
`version`, `model`, `num_experts`, `top_k`, `hidden_size`, `layers` (decoder indices of the MoE
layers), `score_fn` and `hidden_every`. Tensors, N = traced token rows in forward order:
- `tokens` [N] int32: the token id fed at that row
- `sequence` [N] int32: which prompt it belongs to (each prompt is generated alone, batch 1)
- `step` [N] int32: the forward call within its sequence (0 = prefill, then one per decoded token);
  per-expert workloads of a step are the bincount of its rows' expert ids
- `position` [N] int32: position within the sequence
- per MoE layer L: `L{L}.topk_ids` [N, k] int16 (the experts used, in router order),
  `L{L}.score_ids` [N, 2k] int16 and `L{L}.scores` [N, 2k] float16 (the 2k highest router scores,
  softmax or sigmoid as the architecture scores, before any bias or renormalisation),
  `L{L}.hidden_rows` [M] int32 and `L{L}.hidden` [M, H] float16 (the gate input of every
  `hidden_every`-th row, for gate-based and residual-based predictors).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from .errors import InputError, is_count

FORMAT_VERSION = 1
_META_KEY = "hybrid_moe_trace"


@dataclass
class LayerTrace:
    topk_ids: torch.Tensor
    score_ids: torch.Tensor
    scores: torch.Tensor
    hidden_rows: torch.Tensor
    hidden: torch.Tensor


@dataclass
class Trace:
    meta: dict
    tokens: torch.Tensor
    sequence: torch.Tensor
    step: torch.Tensor
    position: torch.Tensor
    layers: dict[int, LayerTrace] = field(default_factory=dict)

    @property
    def gate_inputs(self) -> bool:
        """Whether every layer recorded every row's gate input, which the router-replaying prefetchers need: a trace
        of every N-th row's (`hidden_every` N > 1) left them steps with nothing to route, where they were scored
        as misses (benchmarks/RESULTS.md, 2026-11-30) or, on DeepSeek's grouped routers, crashed the replay."""
        rows = self.tokens.numel()
        return bool(self.layers) and all(layer.hidden_rows.numel() == rows for layer in self.layers.values())

    def save(self, path: str | Path) -> None:
        tensors = {"tokens": self.tokens, "sequence": self.sequence, "step": self.step, "position": self.position}
        for idx, layer in self.layers.items():
            for name, value in vars(layer).items():
                tensors[f"L{idx}.{name}"] = value.contiguous()
        save_file(tensors, str(path), metadata={_META_KEY: json.dumps(self.meta)})

    def select(self, rows: torch.Tensor) -> Trace:
        """The sub-trace of the rows where the boolean mask `rows` is set (gate inputs re-indexed)."""
        index = torch.cumsum(rows.long(), 0) - 1
        layers = {}
        for idx, t in self.layers.items():
            keep = rows[t.hidden_rows.long()]
            layers[idx] = LayerTrace(
                t.topk_ids[rows],
                t.score_ids[rows],
                t.scores[rows],
                index[t.hidden_rows.long()][keep].to(t.hidden_rows.dtype),
                t.hidden[keep],
            )
        return Trace(self.meta, self.tokens[rows], self.sequence[rows], self.step[rows], self.position[rows], layers)

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read and check a trace file: metadata against the tensors (ids in range, shapes consistent, scores
        and gate inputs finite), before anything is sized from it. Raises InputError naming file and field."""
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        if not path.is_file():
            raise InputError(f"{path} is a directory, not a trace file" if path.is_dir() else f"{path}: no such file")
        try:
            with safe_open(str(path), "pt") as f:
                raw = (f.metadata() or {}).get(_META_KEY)
            tensors = load_file(str(path)) if raw is not None else {}
        except (SafetensorError, OSError) as err:
            raise InputError(f"{path} is not a safetensors trace file ({err})") from None
        if raw is None:
            raise InputError(f"{path} is not a hybrid_moe trace (no {_META_KEY!r} metadata)")
        try:
            meta = json.loads(raw)
        except json.JSONDecodeError as err:
            raise InputError(f"{path}: metadata {_META_KEY!r} is not JSON ({err})") from None
        if not isinstance(meta, dict) or meta.get("version") != FORMAT_VERSION:
            version = meta.get("version") if isinstance(meta, dict) else None
            raise InputError(f"{path}: trace format version {version}, this reader knows {FORMAT_VERSION}")
        _check_meta(path, meta)
        for name in ("tokens", "sequence", "step", "position"):
            if name not in tensors:
                raise InputError(f"{path}: tensor {name!r} is missing")
        names = ("topk_ids", "score_ids", "scores", "hidden_rows", "hidden")
        missing = [f"L{idx}.{n}" for idx in meta["layers"] for n in names if f"L{idx}.{n}" not in tensors]
        if missing:
            raise InputError(f"{path}: tensor {missing[0]!r} is missing (metadata lists layers {meta['layers']})")
        layers = {idx: LayerTrace(*(tensors[f"L{idx}.{n}"] for n in names)) for idx in meta["layers"]}
        trace = cls(meta, tensors["tokens"], tensors["sequence"], tensors["step"], tensors["position"], layers)
        trace.check(path)
        return trace

    def check(self, where: str | Path = "trace") -> None:
        """Every tensor consistent with the metadata and the row count; raises InputError naming the field."""
        meta, n = self.meta, self.tokens.shape[0] if self.tokens.dim() == 1 else -1
        for name in ("tokens", "sequence", "step", "position"):
            t = getattr(self, name)
            if t.dim() != 1 or t.shape[0] != n or t.is_floating_point():
                raise InputError(
                    f"{where}: {name} must be an integer tensor [N] like tokens, got {t.dtype} {tuple(t.shape)}"
                )
            if n and int(t.min()) < 0:
                raise InputError(f"{where}: {name} holds negative values")
        if n:
            self._check_order(where)
        e, k, h = meta["num_experts"], meta["top_k"], meta["hidden_size"]
        if list(self.layers) != sorted(set(self.layers)):  # replayed, and residuals taken, in decoder order
            raise InputError(
                f"{where}: metadata 'layers' must list decoder indices in ascending order, got {list(self.layers)}"
            )
        first_rows = None
        for idx, layer in self.layers.items():
            field_ = f"L{idx}"
            _check_ids(where, f"{field_}.topk_ids", layer.topk_ids, (n, k), e)
            if n and k > 1 and bool((layer.topk_ids.long().sort(1).values.diff(dim=1) == 0).any()):
                raise InputError(
                    f"{where}: {field_}.topk_ids lists an expert twice in one row (a router picks k distinct)"
                )
            _check_ids(where, f"{field_}.score_ids", layer.score_ids, (n, min(2 * k, e)), e)
            _check_values(where, f"{field_}.scores", layer.scores, (n, min(2 * k, e)))
            if n and (float(layer.scores.min()) < 0 or float(layer.scores.max()) > 1):
                raise InputError(f"{where}: {field_}.scores must be router probabilities in [0, 1]")
            rows = layer.hidden_rows
            if (
                rows.dim() != 1
                or rows.is_floating_point()
                or (rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < n)
            ):
                raise InputError(f"{where}: {field_}.hidden_rows must be row indices in [0, {n}) [M]")
            if rows.numel() > 1 and not bool((rows.diff() > 0).all()):
                raise InputError(f"{where}: {field_}.hidden_rows must be ascending without repeats")
            if first_rows is not None and not torch.equal(rows.long(), first_rows):
                raise InputError(
                    f"{where}: {field_}.hidden_rows differ from the first layer's (every layer keeps the same rows)"
                )
            first_rows = rows.long()
            _check_values(where, f"{field_}.hidden", layer.hidden, (rows.shape[0], h) if rows.numel() else None)

    def _check_order(self, where: str | Path) -> None:
        """Each sequence's rows, by position: distinct positions, a prefill (step 0) first, steps that never go back,
        and one row per decode step (the replay batches and prices steps from these; a trace breaking them gave
        figures, a prefill of 0 tok/s among them)."""
        sequence, position, step = (t.long() for t in (self.sequence, self.position, self.step))
        order = torch.argsort(sequence * (int(position.max()) + 1) + position)
        sequence, position, step = sequence[order], position[order], step[order]
        same = sequence[1:] == sequence[:-1]
        problems = {
            "has two rows at one position": same & (position[1:] == position[:-1]),
            "goes back a step at a later position": same & (step[1:] < step[:-1]),
            "has two rows for one decode step": same & (step[1:] == step[:-1]) & (step[1:] > 0),
        }
        for what, bad in problems.items():
            if bool(bad.any()):
                row = int(bad.nonzero()[0]) + 1
                raise InputError(
                    f"{where}: sequence {int(sequence[row])} {what} (position {int(position[row])}, step "
                    f"{int(step[row])}): each sequence is a prefill (step 0) then one row per decode step"
                )
        first = torch.cat([torch.tensor([True]), ~same])
        if bool((step[first] != 0).any()):
            raise InputError(
                f"{where}: sequence {int(sequence[first][step[first] != 0][0])} starts without a prefill row "
                "(step 0): each sequence is a prefill then one row per decode step"
            )


MAX_LAYERS = 2**16


def trace_from_jsonl(path: str | Path, num_experts: int, model: str = "external") -> Trace:
    """A trace from routing recorded by other tools: one JSON object per token row, in forward order,
    `{"sequence": s, "step": t, "ids": {"L": [k ids], ...}, "weights": {"L": [k weights], ...}}` with the same
    MoE layers L (decoder indices) and the same k on every row; `step` 0 is prefill, then one per decoded token;
    an optional `"token"` is the token id fed. Such routing holds only the top-k: each row's other k listed
    scores are 0 (score-aware caches see nothing beyond the top-k), and no gate inputs are kept (stacks that
    replay the router are skipped by the simulator). Raises InputError naming the line and the field."""
    path = Path(path)
    rows: list[dict] = []
    try:
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    rows.append(_jsonl_row(path, number, line))
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: cannot read ({err})") from None
    if not rows:
        raise InputError(f"{path}: no rows")
    layers = sorted(rows[0]["ids"], key=int)
    if int(layers[-1]) >= MAX_LAYERS:  # a safetensors trace names its layers in int32 metadata, and no model is so deep
        raise InputError(f"{path}: layer {layers[-1]} is no decoder index (at most {MAX_LAYERS - 1})")
    k = len(rows[0]["ids"][layers[0]])
    ids: dict[str, list[list[int]]] = {layer: [] for layer in layers}
    weights: dict[str, list[list[float]]] = {layer: [] for layer in layers}
    for number, row in enumerate(rows, 1):
        for name in ("ids", "weights"):
            if sorted(row[name], key=int) != layers:
                raise InputError(
                    f"{path}: row {number}: {name} of layers {sorted(row[name], key=int)} differ from the first row's "
                    f"layers {layers}"
                )
        for layer in layers:
            if len(row["ids"][layer]) != k or len(row["weights"][layer]) != k:
                raise InputError(
                    f"{path}: row {number}: layer {layer} lists {len(row['ids'][layer])} ids and "
                    f"{len(row['weights'][layer])} weights, the first row {k}"
                )
            ids[layer].append(row["ids"][layer])
            weights[layer].append(row["weights"][layer])
    listed = min(2 * k, num_experts)
    trace_layers = {}
    for layer in layers:
        top = torch.tensor(ids[layer], dtype=torch.long)
        if top.numel() and not 0 <= int(top.min()) <= int(top.max()) < num_experts:
            raise InputError(f"{path}: layer {layer}: expert ids outside [0, num_experts={num_experts})")
        # the listed ids: the top-k, then the lowest-numbered experts not chosen (score 0)
        others = torch.ones(len(top), num_experts, dtype=torch.bool).scatter_(1, top, False)
        rest = torch.sort(others.to(torch.int8), dim=1, descending=True, stable=True).indices[:, : listed - k]
        score_ids = torch.cat([top, rest], 1)
        given = torch.tensor(weights[layer], dtype=torch.float32)
        if given.numel() and not 0 <= float(given.min()) <= float(given.max()) <= 1:  # NaN fails too
            raise InputError(f"{path}: layer {layer}: weights must be router probabilities in [0, 1]")
        scores = torch.cat([given, torch.zeros(len(top), listed - k)], 1)
        trace_layers[int(layer)] = LayerTrace(
            top.to(torch.int16),
            score_ids.to(torch.int16),
            scores.half(),
            torch.zeros(0, dtype=torch.int32),
            torch.zeros(0, 1, dtype=torch.float16),
        )
    seen: set[tuple[int, int]] = set()
    last: dict[int, int] = {}
    for number, row in enumerate(rows, 1):  # a decode step is one row of its sequence (prefill may be many)
        key = (row["sequence"], row["step"])
        if row["step"] and key in seen:
            raise InputError(f"{path}: row {number}: sequence {key[0]} has a second row for decode step {key[1]}")
        if row["step"] < last.get(key[0], 0):  # positions are counted in row order
            raise InputError(
                f"{path}: row {number}: sequence {key[0]} goes back to step {key[1]} after step {last[key[0]]}; "
                "list each sequence's rows in forward order"
            )
        seen.add(key)
        last[key[0]] = row["step"]
    sequence = torch.tensor([r["sequence"] for r in rows], dtype=torch.int32)
    position = torch.zeros_like(sequence)
    for seq in sequence.unique():
        mask = sequence == seq
        position[mask] = torch.arange(int(mask.sum()), dtype=torch.int32)
    meta = {
        "version": FORMAT_VERSION,
        "model": model,
        "num_experts": num_experts,
        "top_k": k,
        "hidden_size": 1,
        "layers": [int(layer) for layer in layers],
        "score_fn": "softmax",
        "hidden_every": 0,
    }
    trace = Trace(
        meta,
        torch.tensor([r.get("token", 0) for r in rows], dtype=torch.int32),
        sequence,
        torch.tensor([r["step"] for r in rows], dtype=torch.int32),
        position,
        trace_layers,
    )
    _check_meta(path, meta)
    trace.check(path)
    return trace


def _jsonl_row(path: Path, number: int, line: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise InputError(f"{path}: line {number} is not JSON ({err.msg})") from None
    if not isinstance(row, dict):
        raise InputError(f"{path}: line {number} is not a JSON object")
    for name in ("sequence", "step", "token"):
        v = row.get(name, 0)  # "token" is optional
        if not is_count(v) or v >= 2**31:
            raise InputError(f"{path}: line {number}: {name!r} must be an int in [0, 2**31), got {v!r}")
    for name in ("ids", "weights"):
        if not isinstance(row.get(name), dict) or not row[name]:
            raise InputError(f"{path}: line {number}: {name!r} must map MoE layer indices to lists")
        for layer, values in row[name].items():
            kind = int if name == "ids" else (int, float)
            if (
                not (str(layer).isascii() and str(layer).isdigit())  # "²" is a digit to str.isdigit, not to int()
                or not isinstance(values, list)
                or not values
                or any(isinstance(v, bool) or not isinstance(v, kind) for v in values)
            ):
                raise InputError(f"{path}: line {number}: {name}[{layer!r}] must be a list of numbers")
            if name == "ids" and (len(set(values)) != len(values) or not all(0 <= v < 2**15 for v in values)):
                raise InputError(
                    f"{path}: line {number}: ids[{layer!r}] must list distinct expert ids in [0, 32768), got {values}"
                )
    return row


@torch.no_grad()
def record_trace(
    model: torch.nn.Module,
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    model_name: str,
    hidden_every: int = 1,
) -> Trace:
    """Greedy-generate each prompt (1-D token ids) alone and record every MoE layer's routing, and the gate input of
    every `hidden_every`-th row (0: none, for a model whose routers the simulator cannot load again)."""
    from .model_patches import ARCHITECTURES

    kind = model.config.model_type
    if kind not in ARCHITECTURES:
        raise InputError(f"model type {kind!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}")
    spec = ARCHITECTURES[kind]
    layers = model.get_decoder().layers
    moe = [i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts")]
    if not moe:
        raise InputError(f"the {kind} model has no MoE layers: there is no routing to trace")
    cfg = model.config.get_text_config()
    top_k = cfg.num_experts_per_tok
    rows: dict[int, list] = {i: [] for i in moe}

    def hook(idx: int) -> Callable:
        def capture(module: torch.nn.Module, args: tuple, output: tuple) -> None:
            hidden = args[0].reshape(-1, args[0].shape[-1])
            logits = output[0].float()
            scores = logits.softmax(-1) if spec.score_fn == "softmax" else logits.sigmoid()
            top = scores.topk(min(2 * top_k, scores.shape[-1]), dim=-1)
            rows[idx].append((output[2].reshape(-1, top_k).cpu(), top.indices.cpu(), top.values.cpu(), hidden.cpu()))

        return capture

    handles = [layers[i].mlp.gate.register_forward_hook(hook(i)) for i in moe]
    tokens, sequence, step, position = [], [], [], []
    try:
        for seq_idx, prompt in enumerate(tqdm(prompts, desc="tracing", unit="prompt", leave=False)):
            ids = prompt.view(1, -1).to(next(model.parameters()).device)
            out = model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
            full = out[0].cpu()
            n_prompt = ids.shape[1]
            fed = full[: n_prompt + max_new_tokens - 1]  # the last generated token is never fed back
            tokens.append(fed)
            sequence.append(torch.full((fed.numel(),), seq_idx))
            step.append(torch.cat([torch.zeros(n_prompt, dtype=torch.long), torch.arange(1, max_new_tokens)]))
            position.append(torch.arange(fed.numel()))
    finally:
        for h in handles:
            h.remove()
    trace = Trace(
        meta={
            "version": FORMAT_VERSION,
            "model": model_name,
            "num_experts": layers[moe[0]].mlp.experts.num_experts,
            "top_k": top_k,
            "hidden_size": cfg.hidden_size,
            "layers": moe,
            "score_fn": spec.score_fn,
            "hidden_every": hidden_every,
        },
        tokens=_int32_cat(tokens),
        sequence=_int32_cat(sequence),
        step=_int32_cat(step),
        position=_int32_cat(position),
    )
    for idx in moe:
        topk, score_ids, scores, hidden = (torch.cat(parts) for parts in zip(*rows[idx]))
        keep = torch.arange(0, hidden.shape[0], hidden_every) if hidden_every else torch.zeros(0, dtype=torch.long)
        trace.layers[idx] = LayerTrace(
            topk.to(torch.int16),
            score_ids.to(torch.int16),
            scores.to(torch.float16),
            keep.to(torch.int32),
            hidden[keep].to(torch.float16),
        )
    if any(layer.topk_ids.shape[0] != trace.tokens.numel() for layer in trace.layers.values()):
        raise RuntimeError("traced rows and fed tokens disagree: was the model run with a cache?")
    return trace


_INT16_IDS = 2**15  # expert ids are stored as int16


def _check_meta(path: Path, meta: dict) -> None:
    def bounded_int(name: str, low: int, high: int) -> None:
        v = meta.get(name)
        if not is_count(v, low) or v > high:
            raise InputError(f"{path}: metadata {name!r} must be an int in [{low}, {high}], got {v!r}")

    bounded_int("num_experts", 1, _INT16_IDS)
    bounded_int("top_k", 1, meta["num_experts"])
    bounded_int("hidden_size", 1, 2**20)
    bounded_int("hidden_every", 0, 2**31)  # 0: no gate inputs recorded
    layers = meta.get("layers")
    if (
        not isinstance(layers, list)
        or not layers
        or not all(is_count(i) for i in layers)
        or len(set(layers)) != len(layers)
    ):
        raise InputError(
            f"{path}: metadata 'layers' must be a non-empty list of distinct decoder indices, got {layers!r}"
        )
    if meta.get("score_fn") not in ("softmax", "sigmoid"):
        raise InputError(f"{path}: metadata 'score_fn' must be 'softmax' or 'sigmoid', got {meta.get('score_fn')!r}")
    if not isinstance(meta.get("model"), str):
        raise InputError(f"{path}: metadata 'model' must be a string, got {meta.get('model')!r}")


def _check_ids(where: str | Path, name: str, ids: torch.Tensor, shape: tuple[int, int], num_experts: int) -> None:
    if ids.is_floating_point() or tuple(ids.shape) != shape:
        raise InputError(f"{where}: {name} must be integer ids shaped {shape}, got {ids.dtype} {tuple(ids.shape)}")
    if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < num_experts:
        raise InputError(f"{where}: {name} holds expert ids outside [0, num_experts={num_experts})")


def _check_values(where: str | Path, name: str, values: torch.Tensor, shape: tuple[int, int] | None) -> None:
    if not values.is_floating_point() or (shape is not None and tuple(values.shape) != shape):
        raise InputError(f"{where}: {name} must be floats shaped {shape}, got {values.dtype} {tuple(values.shape)}")
    if not bool(torch.isfinite(values).all()):
        raise InputError(f"{where}: {name} holds NaN or infinite values")


def _int32_cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts).to(torch.int32)
