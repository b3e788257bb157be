"""Greedy decoding in a loop of our own: `generate(do_sample=False)`'s tokens, less its per-token Python.

On the CPU, `model.generate()` spends ~1.4 ms a token outside the compiled forward on 2 cores of an AVX2 EPYC (input
preparation, stopping criteria, a copy of the logits to fp32 and ATen's scalar argmax), 7% of a 4-bit token of
Qwen3-30B-A3B's layer shape (benchmarks/RESULTS.md, 2026-11-29). Here a decode step is one compiled graph from a
token to the next, the forward and `hybrid_moe::greedy_tokens`, called past Dynamo as `generate()`'s steps are
(runtime/decode_replay.py); the prompt runs uncompiled, as in `generate()`. Same forward, same static cache, same
argmax: the same tokens. Off the CPU this is `generate(do_sample=False)` itself, whose decode step is one CUDA graph.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from transformers import PreTrainedModel, StaticCache
from transformers.generation.streamers import BaseStreamer

from .errors import InputError
from .model_patches.base import is_patched
from .ops import greedy  # noqa: F401  (registers hybrid_moe::greedy_tokens)
from .runtime.decode_replay import DecodeReplay

# The longest static cache each model has decoded into: later calls reuse its size, so the compiled step is not
# compiled again for every prompt length (as `generate()` keeps its own).
_CACHE_LENGTHS: weakref.WeakKeyDictionary[PreTrainedModel, int] = weakref.WeakKeyDictionary()


def greedy_generate(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    streamer: BaseStreamer | None = None,
) -> torch.Tensor:
    """The prompt `input_ids` ([batch, length], rows of one length, no padding) followed by up to `max_new_tokens`
    greedy tokens, as `model.generate(input_ids, do_sample=False, max_new_tokens=...)` returns them: a row that
    produced an end token (`eos_token_id`, default the model's generation config's; [] for none) continues with
    `pad_token_id` until every row has, which ends the call. `streamer` gets the prompt, then each step's tokens,
    as `generate()` gives them. For a model patched by torch_hybrid_moe."""
    eos, pad = _check(model, input_ids, max_new_tokens, eos_token_id, pad_token_id)
    if input_ids.device.type != "cpu":
        hf: Any = model  # nn.Module's __getattr__ hides generate() from the type checker
        return hf.generate(
            input_ids,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=list(eos) or None,
            pad_token_id=pad,
            streamer=streamer,
        )
    batch, length = input_ids.shape
    size = max(length + max_new_tokens, _CACHE_LENGTHS.get(model, 0))
    _CACHE_LENGTHS[model] = size
    forward = _ForwardNames(type(model))
    cache = {forward.cache: StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=size)}
    step = DecodeReplay(model, functools.partial(_compiled_step(), model))
    eos_ids = torch.tensor(eos, dtype=input_ids.dtype) if eos else None
    pad_ids = torch.tensor(pad if pad is not None else 0, dtype=input_ids.dtype)
    unfinished = torch.ones(batch, dtype=torch.bool)
    out = [input_ids]
    if streamer is not None:
        streamer.put(input_ids.cpu())
    with torch.no_grad():
        for i in range(max_new_tokens):
            positions = torch.arange(length).expand(batch, length) if i == 0 else torch.full((batch, 1), length + i - 1)
            inputs = dict(input_ids=input_ids if i == 0 else out[-1], position_ids=positions, **cache)
            if forward.cache_position:  # a transformers release whose forward takes them gets cache positions too
                inputs["cache_position"] = positions[0]
            # the prompt uncompiled, as generate() runs it; each decode step as one graph
            tokens = next_tokens(model, **inputs) if i == 0 else cast(torch.Tensor, step(**inputs))
            if eos_ids is not None:
                tokens = torch.where(unfinished, tokens, pad_ids)
                unfinished &= ~torch.isin(tokens, eos_ids)
            out.append(tokens[:, None])
            if streamer is not None:
                streamer.put(tokens.cpu())
            if eos_ids is not None and not unfinished.any():
                break
    if streamer is not None:
        streamer.end()
    return torch.cat(out, dim=1)


def next_tokens(model: PreTrainedModel, **inputs: object) -> torch.Tensor:
    """The greedy next token [batch] after the step's inputs: the forward's last logits, their argmax."""
    logits = model(**inputs, use_cache=True, logits_to_keep=1).logits
    return torch.ops.hybrid_moe.greedy_tokens(logits[:, -1])


@functools.cache
def _compiled_step() -> Callable[..., torch.Tensor]:
    """`next_tokens` compiled once per process with the hybrid_moe backend; Dynamo keeps a graph per model."""
    return torch.compile(next_tokens, backend="hybrid_moe", fullgraph=True, dynamic=False)


class _ForwardNames:
    """What a model class's forward calls its cache argument, and whether it takes cache positions."""

    def __init__(self, cls: type[PreTrainedModel]) -> None:
        params = inspect.signature(cls.forward).parameters
        self.cache = "cache" if "cache" in params else "past_key_values"
        self.cache_position = "cache_position" in params


def _check(
    model: PreTrainedModel,
    input_ids: object,
    max_new_tokens: object,
    eos_token_id: int | Sequence[int] | None,
    pad_token_id: int | None,
) -> tuple[tuple[int, ...], int | None]:
    """The end tokens and the pad token to use, or InputError before anything runs."""
    if not is_patched(model):
        raise InputError(
            "greedy_generate runs a model patched by torch_hybrid_moe: patch it first (thm.patch_model or "
            "thm.from_pretrained), or call model.generate for an unpatched one"
        )
    if (
        not isinstance(input_ids, torch.Tensor)
        or input_ids.dim() != 2
        or input_ids.is_floating_point()
        or input_ids.is_complex()
        or input_ids.dtype == torch.bool
        or 0 in input_ids.shape
    ):
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise InputError(
            f"input_ids must be an integer tensor [batch, length] of at least one token, got {shape}: "
            "pass tokenizer(..., return_tensors='pt').input_ids"
        )
    device = next(model.parameters()).device
    if input_ids.device != device:
        raise InputError(f"input_ids are on {input_ids.device} but the model is on {device}: move them first")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    config = model.generation_config
    eos = config.eos_token_id if eos_token_id is None else eos_token_id
    eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < model.config.vocab_size for t in eos):
        raise InputError(f"eos_token_id must be token ids below the vocabulary size {model.config.vocab_size}: {eos}")
    pad = config.pad_token_id if pad_token_id is None else pad_token_id
    if pad is None and eos:
        pad = eos[0]  # as generate() does
    return eos, pad
