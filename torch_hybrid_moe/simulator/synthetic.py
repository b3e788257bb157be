"""Synthetic routing traces with a chosen skew and temporal locality, to see where policies break down
beyond what the embedded models happen to route."""

from __future__ import annotations

import torch

from ..traces import FORMAT_VERSION, LayerTrace, Trace


def zipf_probabilities(num_experts: int, skew: float) -> torch.Tensor:
    """p(rank r) proportional to r^-skew, r = 1..num_experts (skew 0: uniform)."""
    weights = torch.arange(1, num_experts + 1, dtype=torch.float64) ** -skew
    return weights / weights.sum()


def synthetic_trace(
    skew: float,
    locality: float,
    num_experts: int = 64,
    top_k: int = 6,
    num_layers: int = 4,
    sequences: int = 8,
    prompt_tokens: int = 64,
    new_tokens: int = 64,
    seed: int = 0,
) -> Trace:
    """A `Trace` shaped like `record_trace`'s (prefill step 0, then one row per decoded token).

    Each row of a layer reuses the previous row's experts of its sequence with probability `locality`; otherwise
    it draws `top_k` distinct experts with Zipf(`skew`) popularity over a per-layer random ranking of the experts.
    Router scores are the popularity renormalised over each row's 2k listed experts (its k chosen, then k more
    Zipf draws). No gate inputs are kept, so gate-based prefetchers cannot run on it.
    """
    if skew < 0 or not 0 <= locality <= 1:
        raise ValueError(f"skew must be >= 0 and locality in [0, 1]; got skew {skew}, locality {locality}")
    if not (0 < top_k and 2 * top_k <= num_experts):
        raise ValueError(f"need 0 < top_k and 2 * top_k <= num_experts; got top_k {top_k}, {num_experts} experts")
    if prompt_tokens < 1 or new_tokens < 2 or sequences < 1 or num_layers < 1:
        raise ValueError("need at least one sequence, layer and prompt token, and two new tokens")
    g = torch.Generator().manual_seed(seed)
    rows_per_seq = prompt_tokens + new_tokens - 1  # the last generated token is never fed back, as in tracing
    n = sequences * rows_per_seq
    popularity = zipf_probabilities(num_experts, skew)
    layers = {}
    for layer in range(num_layers):
        rank = torch.randperm(num_experts, generator=g)  # expert rank[r] has the r-th highest popularity
        p = torch.empty(num_experts, dtype=torch.float64)
        p[rank] = popularity
        listed = torch.multinomial(p.expand(n, -1), 2 * top_k, replacement=False, generator=g)
        reuse = torch.rand(n, generator=g) < locality
        reuse[::rows_per_seq] = False  # a sequence's first row has nothing to reuse
        for row in reuse.nonzero().flatten().tolist():
            listed[row] = listed[row - 1]
        scores = p[listed]
        layers[layer] = LayerTrace(
            listed[:, :top_k].to(torch.int16),
            listed.to(torch.int16),
            (scores / scores.sum(1, keepdim=True)).half(),
            torch.zeros(0, dtype=torch.int32),
            torch.zeros(0, 1, dtype=torch.float16),
        )
    step = torch.cat([torch.zeros(prompt_tokens, dtype=torch.int32), torch.arange(1, new_tokens, dtype=torch.int32)])
    meta = {
        "version": FORMAT_VERSION,
        "model": f"synthetic-skew{skew:g}-locality{locality:g}",
        "num_experts": num_experts,
        "top_k": top_k,
        "hidden_size": 1,
        "layers": list(layers),
        "score_fn": "softmax",
        "hidden_every": 0,
    }
    return Trace(
        meta,
        torch.zeros(n, dtype=torch.int32),
        torch.arange(sequences, dtype=torch.int32).repeat_interleave(rows_per_seq),
        step.repeat(sequences),
        torch.arange(rows_per_seq, dtype=torch.int32).repeat(sequences),
        layers,
    )
