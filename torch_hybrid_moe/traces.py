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
            layers[idx] = LayerTrace(t.topk_ids[rows], t.score_ids[rows], t.scores[rows],
                                     index[t.hidden_rows.long()][keep].to(t.hidden_rows.dtype), t.hidden[keep])
        return Trace(self.meta, self.tokens[rows], self.sequence[rows], self.step[rows], self.position[rows], layers)

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            raw = (f.metadata() or {}).get(_META_KEY)
        if raw is None:
            raise ValueError(f"{path} is not a hybrid_moe trace (no {_META_KEY!r} metadata)")
        meta = json.loads(raw)
        if meta.get("version") != FORMAT_VERSION:
            raise ValueError(f"{path}: trace format version {meta.get('version')}, this reader knows {FORMAT_VERSION}")
        t = load_file(str(path))
        layers = {
            idx: LayerTrace(*(t[f"L{idx}.{n}"] for n in ("topk_ids", "score_ids", "scores", "hidden_rows", "hidden")))
            for idx in meta["layers"]
        }
        return cls(meta, t["tokens"], t["sequence"], t["step"], t["position"], layers)


@torch.no_grad()
def record_trace(
    model: torch.nn.Module,
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    model_name: str,
    hidden_every: int = 4,
) -> Trace:
    """Greedy-generate each prompt (1-D token ids) alone and record every MoE layer's routing."""
    from .model_patches import ARCHITECTURES

    spec = ARCHITECTURES[model.config.model_type]
    layers = model.get_decoder().layers
    moe = [i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts")]
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
            "version": FORMAT_VERSION, "model": model_name, "num_experts": layers[moe[0]].mlp.experts.num_experts,
            "top_k": top_k, "hidden_size": cfg.hidden_size, "layers": moe, "score_fn": spec.score_fn,
            "hidden_every": hidden_every,
        },
        tokens=_int32_cat(tokens), sequence=_int32_cat(sequence), step=_int32_cat(step), position=_int32_cat(position),
    )
    for idx in moe:
        topk, score_ids, scores, hidden = (torch.cat(parts) for parts in zip(*rows[idx]))
        keep = torch.arange(0, hidden.shape[0], hidden_every)
        trace.layers[idx] = LayerTrace(
            topk.to(torch.int16), score_ids.to(torch.int16), scores.to(torch.float16), keep.to(torch.int32),
            hidden[keep].to(torch.float16),
        )
    if any(layer.topk_ids.shape[0] != trace.tokens.numel() for layer in trace.layers.values()):
        raise RuntimeError("traced rows and fed tokens disagree: was the model run with a cache?")
    return trace


def _int32_cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts).to(torch.int32)
