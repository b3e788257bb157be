"""Synthetic routing traces with a chosen skew and temporal locality, to see where policies break down
beyond what the embedded models happen to route; `realistic_trace` draws routing with the statistics real MoE
models show (`routing_statistics` measures them on any trace)."""

from __future__ import annotations

import math

import torch

from ..traces import FORMAT_VERSION, LayerTrace, Trace


def zipf_probabilities(num_experts: int, skew: float) -> torch.Tensor:
    """p(rank r) proportional to r^-skew, r = 1..num_experts (skew 0: uniform). Every expert must keep a
    probability above zero: the traces draw up to every expert of a row without replacement."""
    if not 0 <= skew < math.inf:
        raise ValueError(f"skew must be a finite number >= 0; got {skew}")
    weights = torch.arange(1, num_experts + 1, dtype=torch.float64) ** -skew
    if weights[-1] == 0:
        raise ValueError(
            f"skew {skew} leaves the rarest of {num_experts} experts no probability (it underflows); use a smaller skew"
        )
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
    model_seed: int | None = None,
) -> Trace:
    """A `Trace` shaped like `record_trace`'s (prefill step 0, then one row per decoded token). `model_seed` draws
    the experts' popularity ranking (the "model"; None: `seed`), `seed` the routing: a calibration trace and the
    trace it calibrates for are two seeds of one model_seed, as two prompt sets of one real model.

    Each row of a layer reuses the previous row's experts of its sequence with probability `locality`; otherwise
    it draws `top_k` distinct experts with Zipf(`skew`) popularity over a per-layer random ranking of the experts.
    Router scores are the popularity renormalised over each row's listed experts (its k chosen, then up to k more
    Zipf draws: 2k, or every expert where there are fewer), handed out in descending order so that the chosen
    experts hold the row's highest scores, as a router's top-k do. No gate inputs are kept, so gate-based
    prefetchers cannot run on it.
    """
    if not 0 <= locality <= 1:
        raise ValueError(f"locality must be in [0, 1]; got {locality}")
    if not 0 < top_k <= num_experts:
        raise ValueError(f"need 0 < top_k <= num_experts; got top_k {top_k}, {num_experts} experts")
    if prompt_tokens < 1 or new_tokens < 2 or sequences < 1 or num_layers < 1:
        raise ValueError("need at least one sequence, layer and prompt token, and two new tokens")
    g = torch.Generator().manual_seed(seed)
    rankings = _rankings(num_layers, num_experts, seed if model_seed is None else model_seed)
    rows_per_seq = prompt_tokens + new_tokens - 1  # the last generated token is never fed back, as in tracing
    n = sequences * rows_per_seq
    popularity = zipf_probabilities(num_experts, skew)
    layers = {}
    for layer, rank in enumerate(rankings):  # expert rank[r] has the r-th highest popularity
        p = torch.empty(num_experts, dtype=torch.float64)
        p[rank] = popularity
        listed = torch.multinomial(p.expand(n, -1), min(2 * top_k, num_experts), replacement=False, generator=g)
        reuse = torch.rand(n, generator=g) < locality
        reuse[::rows_per_seq] = False  # a sequence's first row has nothing to reuse
        for row in reuse.nonzero().flatten().tolist():
            listed[row] = listed[row - 1]
        scores = p[listed].sort(dim=1, descending=True).values  # the chosen k hold the highest, as a router's
        layers[layer] = LayerTrace(
            listed[:, :top_k].to(torch.int16),
            listed.to(torch.int16),
            (scores / scores.sum(1, keepdim=True)).half(),
            torch.zeros(0, dtype=torch.int32),
            torch.zeros(0, 1, dtype=torch.float16),
        )
    model = f"synthetic-skew{skew:g}-locality{locality:g}-model{seed if model_seed is None else model_seed}"
    return _trace(model, num_experts, top_k, layers, sequences, prompt_tokens, new_tokens)


def _rankings(num_layers: int, num_experts: int, model_seed: int) -> list[torch.Tensor]:
    """Each layer's experts in descending popularity: the model's, apart from the routing drawn over it."""
    g = torch.Generator().manual_seed(model_seed)
    return [torch.randperm(num_experts, generator=g) for _ in range(num_layers)]


def _trace(
    model: str,
    num_experts: int,
    top_k: int,
    layers: dict[int, LayerTrace],
    sequences: int,
    prompt_tokens: int,
    new_tokens: int,
) -> Trace:
    """A `Trace` of `sequences` x (prompt_tokens + new_tokens - 1) rows, sequence by sequence, no gate inputs."""
    meta = {
        "version": FORMAT_VERSION,
        "model": model,
        "num_experts": num_experts,
        "top_k": top_k,
        "hidden_size": 1,
        "layers": list(layers),
        "score_fn": "softmax",
        "hidden_every": 0,
    }
    rows_per_seq = prompt_tokens + new_tokens - 1
    step = torch.cat([torch.zeros(prompt_tokens, dtype=torch.int32), torch.arange(1, new_tokens, dtype=torch.int32)])
    return Trace(
        meta,
        torch.zeros(sequences * rows_per_seq, dtype=torch.int32),
        torch.arange(sequences, dtype=torch.int32).repeat_interleave(rows_per_seq),
        step.repeat(sequences),
        torch.arange(rows_per_seq, dtype=torch.int32).repeat(sequences),
        layers,
    )


def realistic_trace(
    num_experts: int = 8,
    top_k: int = 2,
    num_layers: int = 4,
    sequences: int = 32,
    prompt_tokens: int = 32,
    new_tokens: int = 96,
    skew: float = 0.5,
    stickiness: float = 0.1,
    burst_experts: int = 2,
    burst_boost: float = 3.0,
    burst_tokens: float = 30.0,
    seed: int = 0,
    model_seed: int = 0,
) -> Trace:
    """Routing drawn with the statistics issue 18 reports for routing recorded from real models (Mixtral-8x7B,
    DeepSeek-V2-Lite, Qwen1.5-MoE):
    by default, for 8 experts top-2, reuse P(expert at token t+1 | at t) ~ 0.4 and per-layer load entropy ~0.96
    of the maximum (`routing_statistics`).

    Per layer the experts have a Zipf(`skew`) popularity over a random ranking drawn from `model_seed` (the
    "model": traces of other `seed`s are other prompts to it, as a calibration trace should be). Each sequence keeps
    a burst of `burst_experts` experts whose popularity is multiplied by `burst_boost`, redrawn with probability
    1 / `burst_tokens` at each token (bursts persist for tens of tokens). A token keeps each of the previous token's
    experts with probability `stickiness` and draws the rest, without replacement, from the burst-boosted
    popularity. Scores are the drawn weights renormalised over each row's 2k listed experts, as `synthetic_trace`.
    """
    if not (0 < top_k and 3 * top_k <= num_experts) or not 0 <= stickiness <= 1 or not 1 <= burst_boost < math.inf:
        raise ValueError("need 0 < top_k <= num_experts / 3, stickiness in [0, 1] and a finite burst_boost >= 1")
    if not burst_tokens >= 1 or not 0 <= burst_experts <= num_experts or min(sequences, prompt_tokens, num_layers) < 1:
        raise ValueError(
            "need burst_tokens >= 1, 0 <= burst_experts <= num_experts, and at least one sequence, prompt token "
            "and layer"
        )
    if new_tokens < 2:
        raise ValueError("need at least two new tokens")
    g = torch.Generator().manual_seed(seed)
    rows = prompt_tokens + new_tokens - 1
    popularity = zipf_probabilities(num_experts, skew)
    layers = {}
    for layer, rank in enumerate(_rankings(num_layers, num_experts, model_seed)):
        base = torch.empty(num_experts, dtype=torch.float64)
        base[rank] = popularity
        listed = torch.empty(sequences, rows, 2 * top_k, dtype=torch.long)
        scores = torch.empty(sequences, rows, 2 * top_k, dtype=torch.float64)
        burst = torch.zeros(sequences, num_experts, dtype=torch.bool)
        for t in range(rows):
            redraw = (torch.rand(sequences, generator=g) < 1 / burst_tokens) | (t == 0)
            if burst_experts and redraw.any():
                fresh = torch.multinomial(base.expand(int(redraw.sum()), -1), burst_experts, generator=g)
                burst[redraw] = torch.zeros(fresh.shape[0], num_experts, dtype=torch.bool).scatter_(1, fresh, True)
            weight = base * torch.where(burst, burst_boost, 1.0)
            keep = torch.zeros(sequences, num_experts, dtype=torch.bool)
            if t:
                previous = listed[:, t - 1, :top_k]
                kept = torch.rand(sequences, top_k, generator=g) < stickiness
                keep.scatter_(1, previous, kept)
            drawn = torch.multinomial(weight.masked_fill(keep, 0), 2 * top_k, generator=g)
            # the kept experts first, then the draws in order: the first top_k are the row's chosen experts
            priority = torch.full((sequences, num_experts), float("inf")).masked_fill(keep, -1.0)
            priority.scatter_(1, drawn, torch.arange(2 * top_k, dtype=torch.float32).expand(sequences, -1))
            listed[:, t] = priority.argsort(dim=1, stable=True)[:, : 2 * top_k]
            # the row's weights in descending order: the chosen experts hold the highest, as a router's top-k do
            scores[:, t] = weight.gather(1, listed[:, t]).sort(dim=1, descending=True).values
        layers[layer] = LayerTrace(
            listed[:, :, :top_k].reshape(-1, top_k).to(torch.int16),
            listed.reshape(-1, 2 * top_k).to(torch.int16),
            (scores / scores.sum(-1, keepdim=True)).reshape(-1, 2 * top_k).half(),
            torch.zeros(0, dtype=torch.int32),
            torch.zeros(0, 1, dtype=torch.float16),
        )
    model = f"realistic-{num_experts}x{top_k}-skew{skew:g}-stick{stickiness:g}-model{model_seed}"
    return _trace(model, num_experts, top_k, layers, sequences, prompt_tokens, new_tokens)


def routing_statistics(trace: Trace) -> dict[str, float]:
    """Means over layers of: `reuse`, P(an expert of a token's top-k is in the next token's, same sequence);
    `reuse_10`, the same ten tokens later (bursts keep it above what popularity alone gives); `load_entropy`, the
    entropy of the layer's expert loads over the trace as a share of log(num_experts). Rows may come in any
    order (a JSONL trace keeps forward order): pairs are found by sequence and position."""
    if not trace.layers:
        raise ValueError(f"{trace.meta['model']}: the trace has no layers")
    num_experts = trace.meta["num_experts"]
    index = torch.tensor(
        sorted(range(len(trace.sequence)), key=lambda i: (int(trace.sequence[i]), int(trace.position[i]))),
        dtype=torch.long,
    )
    sequence, position = trace.sequence[index], trace.position[index]
    stats: dict[str, list[float]] = {"reuse": [], "reuse_10": [], "load_entropy": []}
    for layer in trace.layers.values():
        ids = layer.topk_ids.long()[index]
        present = torch.zeros(ids.shape[0], num_experts, dtype=torch.bool).scatter_(1, ids, True)
        for key, lag in (("reuse", 1), ("reuse_10", 10)):
            pairs = (sequence[lag:] == sequence[:-lag]) & (position[lag:] == position[:-lag] + lag)
            if not pairs.any():
                raise ValueError(f"{trace.meta['model']}: no two tokens of a sequence {lag} apart to measure reuse on")
            stats[key].append(float((present[lag:] & present[:-lag])[pairs].sum() / present[:-lag][pairs].sum()))
        load = torch.bincount(ids.flatten(), minlength=num_experts).double()
        p = load[load > 0] / load.sum()
        stats["load_entropy"].append(float(-(p * p.log()).sum() / math.log(num_experts)))
    return {key: sum(values) / len(values) for key, values in stats.items()}
