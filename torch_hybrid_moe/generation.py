"""Greedy decoding in a loop of our own: `generate(do_sample=False)`'s tokens, less its per-token Python.

On the CPU, `model.generate()` spends 1.3-2.0 ms a token outside the compiled forward on 2 cores of an AVX2 EPYC
(input preparation, stopping criteria, a copy of the logits to fp32 and ATen's scalar argmax), 7-10% of a 4-bit token
of Qwen3-30B-A3B's layer shape (benchmarks/RESULTS.md, 2026-11-29). Here a decode step is one compiled graph from a
token to the next, the forward and `hybrid_moe::greedy_tokens`, called past Dynamo as `generate()`'s steps are
(runtime/decode_replay.py); the prompt runs uncompiled, as in `generate()`. The same forward over a static cache
(whose unfilled tail is masked, so its length changes no sum) and the same argmax: the same tokens. Where
`generate()` would do more than that (off the CPU, whose decode step is one CUDA graph; a generation config that
adds logits processors or beams; a prompt holding the pad token, which `generate()` masks), this is `generate()`.
"""

from __future__ import annotations

import copy
import functools
import inspect
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from transformers import GenerationConfig, PreTrainedModel, StaticCache
from transformers.generation.streamers import BaseStreamer

from .compile_passes.backend import CPU_DECODE_OPTIONS
from .errors import InputError, is_count
from .model_patches.base import is_patched
from .runtime.decode_replay import DecodeReplay

# The longest static cache each model has decoded into: later calls reuse its size, so the compiled step is not
# compiled again for every prompt length (as `generate()` keeps its own). Sizes go up in powers of two from
# _MIN_CACHE: a growing conversation recompiles a few times, not once per turn (Dynamo's limit is 8 a code object).
# A static cache is allocated whole at the first step, so the doubling stops at the model's maximum position, and a
# size above _KEPT_CACHE (one call's long max_new_tokens) is not kept for the calls after it.
_CACHE_LENGTHS: weakref.WeakKeyDictionary[PreTrainedModel, int] = weakref.WeakKeyDictionary()
_MIN_CACHE = 256
_KEPT_CACHE = 8192
_STEP_GRAPHS = 64  # graphs the compiled step keeps before it starts over (_compiled_next_tokens)
_POSITION_BLOCK = 256  # decode steps whose positions are made at a time
# What generate(do_sample=False) does beyond a plain argmax when a generation config sets it (field, its no-op value):
# a logits processor (penalties, forced or suppressed tokens, a minimum length), beam search, or a stopping criterion.
_PLAIN = (
    ("num_beams", 1),
    ("repetition_penalty", 1.0),
    ("encoder_repetition_penalty", 1.0),
    ("no_repeat_ngram_size", 0),
    ("bad_words_ids", None),
    ("min_length", 0),
    ("min_new_tokens", None),
    ("suppress_tokens", None),
    ("begin_suppress_tokens", None),
    ("forced_bos_token_id", None),
    ("forced_eos_token_id", None),
    ("sequence_bias", None),
    ("exponential_decay_length_penalty", None),
    ("remove_invalid_values", False),
    ("renormalize_logits", False),
    ("guidance_scale", None),
    ("watermarking_config", None),
    ("max_time", None),  # and stopping criteria beyond the end tokens and the length
    ("stop_strings", None),
)


def greedy_generate(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    attention_mask: torch.Tensor | None = None,
    streamer: BaseStreamer | None = None,
) -> torch.Tensor:
    """The prompt `input_ids` ([batch, length]) followed by up to `max_new_tokens` greedy tokens, as
    `model.generate(input_ids, attention_mask=..., do_sample=False, max_new_tokens=...)` returns them: a row that
    produced an end token (`eos_token_id`, default the model's generation config's; [] for none) continues with
    `pad_token_id` until every row has, which ends the call. Padded rows (the tokenizer's `attention_mask` with
    zeros) go to `generate()`. `streamer` gets the prompt, then each step's tokens, as `generate()` gives them. For a
    model patched by torch_hybrid_moe."""
    eos, pad = _check(model, input_ids, max_new_tokens, eos_token_id, pad_token_id, attention_mask)
    padded = attention_mask is not None and not bool(attention_mask.all())
    if padded or input_ids.device.type != "cpu" or _beyond_argmax(model.generation_config, input_ids, eos, pad):
        config = copy.deepcopy(model.generation_config)  # the end tokens as resolved here: [] stays none
        config.eos_token_id, config.pad_token_id = list(eos), pad  # (None would let generate() take the model's)
        config.do_sample, config.max_new_tokens = False, max_new_tokens  # in the config: generate() warns of both
        hf: Any = model  # generate() is GenerationMixin's, which PreTrainedModel's type does not include
        return hf.generate(input_ids, attention_mask=attention_mask, generation_config=config, streamer=streamer)
    batch, length = input_ids.shape
    text_config = model.config.get_text_config(decoder=True)
    need = length + max_new_tokens
    size = max(_MIN_CACHE, _CACHE_LENGTHS.get(model, 0))
    while size < need:
        size *= 2
    size = max(need, min(size, getattr(text_config, "max_position_embeddings", None) or size))
    forward = ForwardNames(model)
    cache = {forward.cache: StaticCache(config=text_config, max_cache_len=size)}
    step = DecodeReplay(model, functools.partial(_compiled_next_tokens, model))
    ends, padding = frozenset(eos), pad if pad is not None else 0
    finished = [False] * batch  # rows that have made an end token: they continue with `padding`
    out = [input_ids]
    if streamer is not None:
        streamer.put(input_ids.cpu())
    with torch.no_grad():
        for i, (positions, cache_position) in enumerate(_positions(batch, length, max_new_tokens)):
            inputs = dict(input_ids=out[-1], position_ids=positions, **cache)
            if forward.cache_position:  # a transformers release whose forward takes them gets cache positions too
                inputs["cache_position"] = cache_position
            # the prompt uncompiled, as generate() runs it; each decode step as one graph
            tokens = next_tokens(model, **inputs) if i == 0 else cast(torch.Tensor, step(**inputs))
            if ends:  # as plain ints: between two graphs, each small tensor op costs ~20-30 us on cold caches
                made = tokens[:, 0].tolist()
                if any(finished):
                    made = [padding if done else t for t, done in zip(made, finished)]
                    tokens = torch.tensor(made, dtype=tokens.dtype).view(batch, 1)
                finished = [done or t in ends for t, done in zip(made, finished)]
            out.append(tokens)
            if streamer is not None:
                streamer.put(tokens[:, 0].cpu())
            if ends and all(finished):
                break
    if streamer is not None:
        streamer.end()
    if size <= _KEPT_CACHE:
        _CACHE_LENGTHS[model] = size  # only once a call of that size has run
    return torch.cat(out, dim=1)


def _positions(batch: int, length: int, steps: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's position ids [batch, n] and cache positions [n]: the prompt's, then one for each new token, made
    _POSITION_BLOCK steps ahead, so that with the step's ids already [batch, 1] no op of a decode step runs outside its
    graph but those an end token or a streamer asks for."""
    prompt = torch.arange(length).expand(batch, length)
    yield prompt, prompt[0]
    for start in range(length, length + steps - 1, _POSITION_BLOCK):
        block = [torch.full((batch, 1), p) for p in range(start, min(start + _POSITION_BLOCK, length + steps - 1))]
        yield from [(p, p[0]) for p in block]


def _beyond_argmax(config: GenerationConfig, input_ids: torch.Tensor, eos: tuple[int, ...], pad: int | None) -> bool:
    """Whether generate(do_sample=False) would do more than take each step's argmax: logits processors or beams
    the generation config asks for, or an attention mask it infers from pad tokens in the prompt (a pad token that
    is no end token)."""
    return any(getattr(config, field, default) not in (default, None) for field, default in _PLAIN) or (
        pad is not None and pad not in eos and bool((input_ids == pad).any())
    )


def next_tokens(model: PreTrainedModel, **inputs: object) -> torch.Tensor:
    """The greedy next token [batch, 1] after the step's inputs (the next step's input ids): the forward's last
    logits, their argmax."""
    logits = model(**inputs, use_cache=True, logits_to_keep=1).logits
    return torch.ops.hybrid_moe.greedy_tokens(logits[:, -1])[:, None]


def _compiled_next_tokens(model: PreTrainedModel, **inputs: object) -> torch.Tensor:
    """`next_tokens` through its compiled step, which keeps up to _STEP_GRAPHS graphs (one per batch size, cache
    length and set of live layer handles) and past that drops them all and compiles afresh, where Dynamo would
    fail at its default limit (8: a ninth batch size in one process)."""
    with torch._dynamo.config.patch(recompile_limit=_STEP_GRAPHS):
        try:
            return _compiled_step()(model, **inputs)
        except torch._dynamo.exc.FailOnRecompileLimitHit:  # raised before the step ran: nothing to undo
            torch._dynamo.eval_frame.reset_code(next_tokens.__code__)
            return _compiled_step()(model, **inputs)


@functools.cache
def _compiled_step() -> Callable[..., torch.Tensor]:
    """`next_tokens` compiled once per process with the hybrid_moe backend (a CPU step: its wrapper in C++)."""
    return torch.compile(
        next_tokens, backend="hybrid_moe", fullgraph=True, dynamic=False, options=dict(CPU_DECODE_OPTIONS)
    )


class ForwardNames:
    """What a model's forward calls its cache argument, and whether it takes cache positions. A compiled model's
    wrapper (`torch.compile`'s OptimizedModule) takes anything: its module's forward is read."""

    def __init__(self, model: torch.nn.Module) -> None:
        module: torch.nn.Module = getattr(model, "_orig_mod", model)
        params = inspect.signature(type(module).forward).parameters
        self.cache = "cache" if "cache" in params else "past_key_values"
        self.cache_position = "cache_position" in params


def _check(
    model: PreTrainedModel,
    input_ids: object,
    max_new_tokens: object,
    eos_token_id: int | Sequence[int] | None,
    pad_token_id: int | None,
    attention_mask: object = None,
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
        or input_ids.dtype not in (torch.int32, torch.int64)
        or 0 in input_ids.shape
    ):
        shape = (
            f"{input_ids.dtype} {tuple(input_ids.shape)}"
            if isinstance(input_ids, torch.Tensor)
            else type(input_ids).__name__
        )
        raise InputError(
            f"input_ids must be an int64 / int32 tensor [batch, length] of at least one token, got {shape}: "
            "pass tokenizer(..., return_tensors='pt').input_ids"
        )
    device = next(model.parameters()).device
    if input_ids.device != device:
        raise InputError(f"input_ids are on {input_ids.device} but the model is on {device}: move them first")
    if not is_count(max_new_tokens, 1):
        raise InputError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if context and input_ids.shape[1] + cast(int, max_new_tokens) - 1 > context:  # past it are not the model's
        raise InputError(
            f"a {input_ids.shape[1]}-token prompt and {max_new_tokens} new tokens exceed the model's {context} "
            "positions: shorten the prompt or generate fewer tokens"
        )
    config, vocab = model.generation_config, model.config.vocab_size

    def token(t: object) -> bool:
        return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab

    eos = config.eos_token_id if eos_token_id is None else eos_token_id
    eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    if not all(map(token, eos)):
        raise InputError(f"eos_token_id must be token ids below the vocabulary size {vocab}: {eos}")
    pad = config.pad_token_id if pad_token_id is None else pad_token_id
    if pad is not None and not token(pad):
        raise InputError(f"pad_token_id must be a token id below the vocabulary size {vocab}, got {pad!r}")
    if pad is None and eos:
        pad = eos[0]  # as generate() does
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            raise InputError("attention_mask must be a tensor of input_ids' shape: pass the tokenizer's")
        if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise InputError("attention_mask must hold 0 (padding) and 1 (token) only: pass the tokenizer's")
    elif pad is not None and pad in eos and len(input_ids) > 1:
        # generate() cannot tell padding from tokens when the pad token ends a sequence too (Qwen's and the
        # embedded models' do), and runs over it unmasked: rows that start with different runs of it are padded
        leading = (input_ids == pad).int().cumprod(dim=1).sum(dim=1)
        if bool((leading != leading[0]).any()):
            raise InputError(
                f"rows of input_ids start with different numbers of the pad token {pad}, which is an end token too: "
                "padding no mask can be inferred from; pass attention_mask (the tokenizer's)"
            )
    return eos, pad
