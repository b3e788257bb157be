"""Held-out perplexity, the unigram baseline, and routing statistics (specialisation, temporal reuse)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

SEQ = 256


def windows(ids: torch.Tensor, seq: int = SEQ) -> torch.Tensor:
    """Consecutive [n, seq + 1] windows sharing one boundary token, so every token up to the last whole window is
    predicted once (those after it are not)."""
    n = (ids.numel() - 1) // seq
    if n < 1:
        raise ValueError(f"{ids.numel()} tokens make no window of {seq} predictions: give at least {seq + 1}")
    return torch.stack([ids[i * seq : i * seq + seq + 1] for i in range(n)])


@torch.no_grad()
def perplexity(model: torch.nn.Module, ids: torch.Tensor, seq: int = SEQ, batch: int = 8) -> float:
    """exp(mean next-token negative log-likelihood) over `ids`, in windows of `seq`, one forward per window."""
    return _perplexity(ids, seq, batch, model, lambda inputs: model(input_ids=inputs).logits, "perplexity")


@torch.no_grad()
def decode_perplexity(model: torch.nn.Module, ids: torch.Tensor, seq: int = SEQ, batch: int = 8) -> float:
    """`perplexity` with every token fed as its own decode step through a static KV cache, so a decode-only
    mode (daop_precalc) applies to every prediction: same windows, same tokens, same average."""
    from transformers import StaticCache

    from ..generation import ForwardNames

    caches: dict[int, StaticCache] = {}  # one per batch size: the last chunk may hold fewer windows
    names = ForwardNames(model)  # transformers 5.24 renamed past_key_values to cache and dropped positions

    def logits(inputs: torch.Tensor) -> torch.Tensor:
        if inputs.shape[0] not in caches:
            caches[inputs.shape[0]] = StaticCache(config=model.config, max_cache_len=seq)
        cache = caches[inputs.shape[0]]
        cache.reset()
        return torch.cat(
            [
                model(
                    input_ids=inputs[:, t : t + 1],
                    use_cache=True,
                    **{names.cache: cache},
                    **({"cache_position": torch.tensor([t], device=inputs.device)} if names.cache_position else {}),
                ).logits
                for t in range(inputs.shape[1])
            ],
            dim=1,
        )

    return _perplexity(ids, seq, batch, model, logits, "decode perplexity")


def _perplexity(
    ids: torch.Tensor,
    seq: int,
    batch: int,
    model: torch.nn.Module,
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    desc: str,
) -> float:
    w = windows(ids, seq)
    nll, count = 0.0, 0
    device = next(model.parameters()).device
    for chunk in tqdm(w.split(batch), desc=desc, unit="batch", leave=False):
        chunk = chunk.to(device)
        logits = logits_of(chunk[:, :-1]).float()
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum").item()
        count += chunk[:, 1:].numel()
    return math.exp(nll / count)


def unigram_perplexity(train_ids: torch.Tensor, heldout_ids: torch.Tensor, vocab: int) -> float:
    """Perplexity of add-one-smoothed training token frequencies on the held-out tokens."""
    counts = torch.bincount(train_ids, minlength=vocab).double() + 1
    logp = (counts / counts.sum()).log()
    return math.exp(-logp[heldout_ids[1:]].mean().item())


@contextmanager
def record_routing(model: torch.nn.Module) -> Iterator[dict[int, list[torch.Tensor]]]:
    """Collects each MoE layer's top-k expert ids ([tokens, k] per call) while the block is active."""
    seen: dict[int, list[torch.Tensor]] = {}
    handles = []
    for idx, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            seen[idx] = []
            handles.append(experts.register_forward_pre_hook(lambda m, a, idx=idx: seen[idx].append(a[1].cpu())))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def routing_report(model: torch.nn.Module, ids: torch.Tensor, seq: int = SEQ, max_windows: int = 16) -> dict:
    """Per MoE layer: load entropy / log(E) (1.0 = uniform) and temporal reuse P(e at t+1 | e at t)."""
    w = windows(ids, seq)[:max_windows]
    with record_routing(model) as seen:
        model(input_ids=w[:, :-1])
    layers = {}
    for idx, calls in seen.items():
        topk = calls[0].view(w.shape[0], seq, -1)
        num_experts = model.model.layers[idx].mlp.experts.num_experts
        k = topk.shape[-1]
        load = torch.bincount(topk.reshape(-1), minlength=num_experts).double()
        p = load / load.sum()
        entropy = -(p[p > 0] * p[p > 0].log()).sum().item() / math.log(num_experts)
        onehot = F.one_hot(topk, num_experts).sum(-2).bool()  # [windows, seq, E]
        reuse = (onehot[:, 1:] & onehot[:, :-1]).sum().item() / (onehot[:, :-1].sum().item())
        layers[idx] = {"load_entropy": entropy, "temporal_reuse": reuse, "random_reuse": k / num_experts}
    return {"routing": layers}
