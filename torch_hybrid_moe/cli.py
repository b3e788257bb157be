"""`hybrid-moe` command line: patch, compile with the hybrid_moe backend, generate, report placement."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, cast

import torch
from tqdm.auto import tqdm
from transformers.generation.streamers import BaseStreamer

import torch_hybrid_moe as thm
from torch_hybrid_moe.config import (
    CPU_WEIGHT_DTYPES,
    DEFAULT_GROUP_SIZE,
    DENSE_WEIGHT_DTYPES,
    PRECALC_FROM_LAYER,
    QUANTISED_DTYPES,
    STACK_FILE_FIELDS,
    STACK_FILE_FORMAT,
    check_cache_values,
    format_size,
    parse_size,
)
from torch_hybrid_moe.cost_model import EXPERT_SHAPES, HARDWARE
from torch_hybrid_moe.embedded import (
    DEFAULT_MODEL,
    embedded_models,
    load_model,
    load_tokenizer,
)
from torch_hybrid_moe.errors import InputError
from torch_hybrid_moe.tiny_models import TINY_ARCHITECTURES

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from torch_hybrid_moe.cost_model import CostModel
    from torch_hybrid_moe.profiling import HardwareProfile
    from torch_hybrid_moe.simulator.calibration import Calibration
    from torch_hybrid_moe.simulator.replay import GraphStep
    from torch_hybrid_moe.simulator.stacks import Stack
    from torch_hybrid_moe.traces import Trace

T = TypeVar("T")


class _TimingStreamer(BaseStreamer):
    """Timestamps greedy_generate()'s token pushes: the first push is the prompt, the second ends prefill."""

    def __init__(self, total: int) -> None:
        self.times: list[float] = []
        self.bar = tqdm(total=total, desc="generating", unit="tok", leave=False)

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())
        if len(self.times) > 1:
            self.bar.update(1)

    def end(self) -> None:
        self.bar.close()


def _prompt_ids(tokenizer: PreTrainedTokenizerBase | None, prompt: str, vocab_size: int) -> torch.Tensor:
    if tokenizer is None:  # random-weight model without a tokenizer: bytes folded into the vocabulary
        return torch.tensor([[3 + b % (vocab_size - 3) for b in prompt.encode()]])
    return tokenizer(prompt, return_tensors="pt").input_ids


_DTYPES: dict[str, Any] = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16}
CPU_BUDGET_NOTE = (
    "without CUDA the CPU stands in for the accelerator and its slots are copies in the same RAM: "
    "more memory, no speed-up (pass --expert-budget 0, the default here)"
)


def _config(args: argparse.Namespace) -> thm.HybridMoEConfig:
    """The command line's config. The expert budget defaults to 0.25 with CUDA and 0 without, where slots only
    duplicate host memory; a budget given there is kept, with a note saying why it does not help."""
    on_cpu = thm.HybridMoEConfig(device=args.device).resolve_device().type == "cpu"
    fields = dict(
        expert_budget=(0.0 if on_cpu else 0.25) if args.expert_budget is None else args.expert_budget,
        device=args.device,
        cpu_weight_dtype=args.cpu_weight_dtype,
        cpu_weight_group_size=_group_size(args),
        dense_weight_dtype=args.dense_weight_dtype,
    )
    config = thm.HybridMoEConfig.from_stack_file(args.stack, **fields) if args.stack else thm.HybridMoEConfig(**fields)
    if args.expert_budget and on_cpu:
        _phase(f"note: --expert-budget {args.expert_budget}: {CPU_BUDGET_NOTE}")
    return config


def _group_size(args: argparse.Namespace) -> int:
    """--cpu-weight-group-size, refused where no weight is int8 / int4 (it would group nothing)."""
    if args.cpu_weight_group_size is None:
        return DEFAULT_GROUP_SIZE
    if args.cpu_weight_dtype not in QUANTISED_DTYPES and getattr(args, "dense_weight_dtype", "model") == "model":
        raise InputError(
            f"--cpu-weight-group-size {args.cpu_weight_group_size} groups int8 / int4 weights and none are asked "
            "for: add --cpu-weight-dtype int8 or int4 (or --dense-weight-dtype), or leave the group out"
        )
    return args.cpu_weight_group_size


def _phase(message: str) -> None:
    """One line per start-up phase on stderr, so a long first run is not mistaken for a hang."""
    print(f"hybrid-moe: {message}", file=sys.stderr, flush=True)


def _timed(what: str, fn: Callable[[], T]) -> T:
    _phase(f"{what}...")
    start = time.perf_counter()
    result = fn()
    _phase(f"{what}: {time.perf_counter() - start:.1f} s")
    return result


def _kernel_ready() -> None:
    """Load the C++ CPU kernel now, saying so: its first load on a machine builds it (cached afterwards)."""
    from torch_hybrid_moe.ops import cpu_kernel

    _timed(
        "C++ CPU kernel (built on its first use per machine and torch version, a minute or two; "
        "`hybrid-moe build` does it ahead)",
        cpu_kernel.extension,
    )


def _load_with_tokenizer(
    name: str, dtype: torch.dtype, command: str
) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    model, tokenizer = load_model(name, dtype)
    if tokenizer is None:
        raise InputError(f"{command} needs a model with a tokenizer (an embedded model or a local directory)")
    return model, tokenizer


def generate(args: argparse.Namespace) -> int:
    config, dtype = _config(args), _DTYPES[args.dtype]
    if args.model.startswith("tiny:"):
        model, tokenizer = load_model(args.model, dtype)
        _kernel_ready()
        thm.patch_model(model, config)
    else:  # the experts stream from the checkpoint into the store: no second resident copy
        tokenizer = load_tokenizer(args.model)  # a model that is not there is refused before the kernel's build
        _kernel_ready()
        converting = f", converting experts to {config.cpu_weight_dtype}" if config.cpu_weight_dtype != "model" else ""
        model = _timed(
            f"loading {args.model}{converting}", lambda: thm.from_pretrained(args.model, config, dtype=dtype)
        )
    device = next(model.parameters()).device
    ids = _prompt_ids(tokenizer, args.prompt, model.config.vocab_size)
    if args.prompt_tokens:  # the prompt's tokens repeated to this length: a prefill figure that means something
        ids = ids.repeat(1, -(-args.prompt_tokens // ids.shape[1]))[:, : args.prompt_tokens]
    ids = ids.to(device)
    with torch.no_grad():
        start = time.perf_counter()
        _timed(
            "warm-up generate (compiles the decode step)",
            lambda: thm.greedy_generate(model, ids, args.max_new_tokens),
        )
        compile_s = time.perf_counter() - start
        thm.reset_stats(model)
        streamer = _TimingStreamer(args.max_new_tokens)
        start = time.perf_counter()
        out = thm.greedy_generate(model, ids, args.max_new_tokens, streamer=streamer)
    times = streamer.times
    prefill_s = times[1] - start
    decode_s = times[-1] - times[1]
    new = out[0, ids.shape[1] :]
    text = tokenizer.decode(new, skip_special_tokens=True) if tokenizer else " ".join(map(str, new.tolist()))
    print(f"model {args.model}  budget {config.expert_budget}  device {device}  dtype {model.dtype}")
    print(f"output: {text}")
    steps = len(times) - 2  # decode steps after the first token (the prompt's pushed first)
    decode = f"{steps / max(decode_s, 1e-9):8.1f} tok/s" if steps else "none (an end token came first)"
    print(f"warm-up{' with decode compile' if steps else ''}: {compile_s:.1f} s")
    print(
        f"prefill: {ids.shape[1] / prefill_s:8.1f} tok/s ({ids.shape[1]}-token prompt; --prompt-tokens N for "
        f"another length)   decode: {decode}"
    )
    print(format_stats(thm.stats(model)))
    return 0


def build(args: argparse.Namespace) -> int:
    """Build (or find) the C++ CPU kernel and say which ISA level it runs at here."""
    from torch_hybrid_moe.ops import cpu_kernel, kernel_build

    _kernel_ready()
    ext = cpu_kernel.extension()
    if ext is None:
        raise InputError(
            "the C++ CPU kernel cannot be built here (see the warning above); the CPU experts will "
            "use the slower per-expert torch loop"
        )
    isa = kernel_build.ISA_NAMES[cpu_kernel.best_isa()]
    print(f"C++ CPU kernel ready: {ext.__file__} (ISA level {isa})")
    return 0


def eval_ppl(args: argparse.Namespace) -> int:
    """Perplexity of the unpatched model and of the patched model in the chosen mode, on the held-out text."""
    from torch_hybrid_moe.compile_passes.daop_precalc import precalc_stats
    from torch_hybrid_moe.embedded.corpus import heldout_text
    from torch_hybrid_moe.embedded.evaluation import SEQ, decode_perplexity, perplexity
    from torch_hybrid_moe.model_patches.base import check_precalc_start, moe_layer_indices

    if args.deferred_experts is not None and args.mode != "expert_deferral":
        raise InputError("--deferred-experts needs --mode expert_deferral")
    if args.precalc_from_layer is not None and args.mode != "daop_precalc":
        raise InputError("--precalc-from-layer needs --mode daop_precalc")
    model, tokenizer = _load_with_tokenizer(args.model, _DTYPES[args.dtype], "eval-ppl")
    config = _config(args)
    if args.mode == "expert_deferral":
        top_k = model.config.get_text_config().num_experts_per_tok
        # default: the paper's heuristic, defer as many as possible while keeping 2 immediate (1 at top-2)
        deferred = args.deferred_experts if args.deferred_experts is not None else max(1, top_k - 2)
        try:
            config = config.replace(mode="expert_deferral", deferred_experts=deferred)
            config.check_top_k(top_k)
        except ValueError as err:
            raise InputError(f"--deferred-experts: {err}") from None
    if args.mode == "daop_precalc":
        # the paper's first approximated block, or a shallower model's last MoE block
        moe_indices = moe_layer_indices(model)
        start = args.precalc_from_layer
        if start is None:
            start = min(PRECALC_FROM_LAYER, moe_indices[-1]) if moe_indices else PRECALC_FROM_LAYER
        try:
            config = config.replace(mode="daop_precalc", precalc_from_layer=start)
            check_precalc_start(config, moe_indices)  # before the reference's minutes, not after
        except (TypeError, ValueError) as err:
            raise InputError(f"--precalc-from-layer: {err}") from None
    # DAOP approximates decode steps only: both sides are then measured one token per step.
    measure = decode_perplexity if args.mode == "daop_precalc" else perplexity
    # the whole text at once (verbose=False: no "longer than the maximum" warning; the model sees windows of SEQ)
    ids = tokenizer(heldout_text(), add_special_tokens=False, return_tensors="pt", verbose=False).input_ids[0]
    tokens = min(args.max_tokens, ids.numel() - 1) // SEQ * SEQ  # whole windows: what is measured is what is shown
    if not tokens:
        raise InputError(f"--max-tokens {args.max_tokens}: perplexity is measured in windows of {SEQ} tokens")
    ids = ids[: tokens + 1]
    reference = measure(model, ids)
    thm.patch_model(model, config)
    # Expert Deferral and DAOP are passes of the hybrid_moe backend, so those modes measure the compiled forward
    # (compiling a Module gives a Module, an OptimizedModule).
    run = (
        cast(torch.nn.Module, torch.compile(model, backend="hybrid_moe", fullgraph=True, dynamic=False))
        if args.mode != "exact"
        else model
    )
    patched = measure(run, ids)
    mode = args.mode
    if mode == "expert_deferral":
        mode = f"expert_deferral ({top_k - config.deferred_experts} immediate + {config.deferred_experts} deferred)"
    if mode == "daop_precalc":
        stats = {idx: c for idx, c in precalc_stats(thm.runtime.model_layers(model)).items() if c.pairs}
        counts = list(stats.values())
        # the blocks it really approximated: a start at or before the first MoE block begins at the second
        blocks = ", ".join(map(str, sorted(stats))) or "none"
        mode = f"daop_precalc (--precalc-from-layer {start}: decoder blocks {blocks} approximated; decode steps)"
    dtype = str(model.dtype).removeprefix("torch.")  # what --dtype auto loaded: bf16 experts of a bf16 model are exact
    quantised = [f"{config.cpu_weight_dtype} experts"] if config.cpu_weight_dtype not in ("model", dtype) else []
    if config.dense_weight_dtype != "model":
        quantised.append(f"{config.dense_weight_dtype} dense layers")
    if quantised:
        mode = f"approximate ({', '.join(quantised)})" if mode == "exact" else f"{mode}, {', '.join(quantised)}"
    print(f"model {args.model}  held-out tokens {ids.numel() - 1}  mode {mode}  budget {config.expert_budget}")
    print(f"perplexity: unpatched {reference:.4f}   patched {patched:.4f}   ratio {patched / reference:.6f}")
    if args.mode == "daop_precalc":
        pairs = max(1, sum(c.pairs for c in counts))
        print(
            f"routed pairs of approximated layers: {sum(c.predicted_changed for c in counts) / pairs:.2%} changed by "
            f"prediction, {sum(c.degraded for c in counts) / pairs:.2%} by degradation, "
            f"{sum(c.early for c in counts) / pairs:.2%} computed on the earlier hidden state"
        )
    return 0


def trace(args: argparse.Namespace) -> int:
    from torch_hybrid_moe.embedded.corpus import heldout_text
    from torch_hybrid_moe.traces import record_trace

    model, tokenizer = _load_with_tokenizer(args.model, torch.float32, "trace")
    text = heldout_text()
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    if ids.numel() < args.prompts * (args.offset + args.prompt_tokens):
        raise InputError(
            f"the held-out text has {ids.numel()} tokens: too few for --prompts {args.prompts} x "
            f"(--offset {args.offset} + --prompt-tokens {args.prompt_tokens})"
        )
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if context and args.prompt_tokens + args.max_new_tokens > context:  # routing past it is not the model's
        raise InputError(
            f"--prompt-tokens {args.prompt_tokens} + --max-new-tokens {args.max_new_tokens} exceed the model's "
            f"{context} positions; pass at most {context} together"
        )
    stride = ids.numel() // args.prompts
    prompts = [
        ids[i * stride + args.offset : i * stride + args.offset + args.prompt_tokens] for i in range(args.prompts)
    ]
    result = record_trace(model, prompts, args.max_new_tokens, args.model, args.hidden_every)
    result.save(args.out)
    print(f"wrote {args.out}: {result.tokens.numel()} token rows x {len(result.layers)} MoE layers")
    return 0


def convert_trace(args: argparse.Namespace) -> int:
    """Routing recorded elsewhere (JSONL, see traces.trace_from_jsonl) into a trace file `simulate` reads."""
    from torch_hybrid_moe.traces import trace_from_jsonl

    result = trace_from_jsonl(args.jsonl, args.num_experts, args.model_name)
    result.save(args.out)
    print(
        f"wrote {args.out}: {result.tokens.numel()} token rows x {len(result.layers)} MoE layers, top-"
        f"{result.meta['top_k']} of {args.num_experts} experts"
    )
    return 0


def _local_profile(args: argparse.Namespace) -> HardwareProfile:
    """This machine's measured cost profile (profiling.py): from the disk cache, else measured now."""
    from torch_hybrid_moe.profiling import profile_hardware

    return profile_hardware(
        EXPERT_SHAPES[args.expert_shape], preset=args.gpu_preset, refresh=getattr(args, "refresh", False)
    )


def _ours_spec(text: str) -> tuple[int, int, float, int]:
    try:
        w, u, decay, prefetch = text.split(",")
        spec = int(w), int(u), float(decay), int(prefetch)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected W,U,DECAY,PREFETCH such as 4,1,0.5,0, got {text!r}") from None
    try:  # the window cache refuses its own values, before anything runs
        check_cache_values("dali_window", {"w_size": spec[0], "u_size": spec[1], "decay": spec[2]})
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: {err}") from None
    if spec[3] < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: PREFETCH must be >= 0 (0: none)")
    return spec


def _stack_spec(text: str) -> Stack:
    """A stack of registry names, SCHEDULER,CACHE[,PREFETCHER], named by them: a live configuration (gpu_decode.py's
    rows) replayed beside the papers' own stacks."""
    from torch_hybrid_moe.policies import CACHE_POLICIES, PREFETCHERS, SCHEDULERS
    from torch_hybrid_moe.simulator.stacks import Stack

    parts = text.split(",")
    if len(parts) not in (2, 3):
        raise argparse.ArgumentTypeError(f"expected SCHEDULER,CACHE[,PREFETCHER] such as dali_greedy,lru, got {text!r}")
    for registry, name in zip((SCHEDULERS, CACHE_POLICIES, PREFETCHERS), parts):
        if name not in registry.names():
            raise argparse.ArgumentTypeError(f"unknown {registry.kind} {name!r}; known: {', '.join(registry.names())}")
    prefetcher = parts[2] if len(parts) == 3 else "none"
    return Stack("+".join(parts), parts[0], parts[1], True, f"given by --stack {text}", prefetcher)


def _stack_fields(stack: Stack) -> dict[str, Any]:
    """The config fields (`STACK_FILE_FIELDS`) that run `stack` live."""
    return dict(zip(STACK_FILE_FIELDS, (stack.scheduler, stack.cache_policy, dict(stack.options))))


def simulate(args: argparse.Namespace) -> int:
    """Replay a trace through every policy stack on a hardware preset; one row per stack."""
    import json
    from dataclasses import asdict, replace

    from torch_hybrid_moe.cost_model import CostModel
    from torch_hybrid_moe.simulator import STACKS
    from torch_hybrid_moe.simulator.bound import bound
    from torch_hybrid_moe.simulator.calibration import Calibration, RouterUnavailable
    from torch_hybrid_moe.simulator.replay import GraphStep, simulate_runnable, slots_for
    from torch_hybrid_moe.simulator.stacks import PAPERS
    from torch_hybrid_moe.simulator.tuning import LIVE_CACHES, judged_rank, oracle, ours, tune
    from torch_hybrid_moe.traces import Trace

    if not args.graph and (args.graph_fill_us is not None or args.cpu_task_us is not None):
        raise InputError("--graph-fill-us and --cpu-task-us price the captured decode step: add --graph")
    if args.save_ours and args.ours and args.ours[3]:
        raise InputError(
            "--save-ours: ours with prefetch does not run live (DALI's residual prefetch needs residual vectors the "
            "runtime lacks): give --ours W,U,DECAY,0"
        )
    trace = Trace.load(args.trace)
    held = Trace.load(args.calibration) if args.calibration else None
    for loaded, path in ((trace, args.trace), (held, args.calibration)):
        if loaded is None:
            continue
        steps = len(set(loaded.step[loaded.step > 0].tolist()))
        if steps < 2:  # tuning replays each half of the decode steps; a rate needs tokens behind it
            raise InputError(f"{path} holds {steps} decode steps; simulate needs at least 2 (trace more new tokens)")
        sequences = len(set(loaded.sequence.tolist()))
        if args.batch > sequences:  # ours is tuned on the calibration trace at this batch too
            raise InputError(f"--batch {args.batch}: {path} holds {sequences} sequences; pass --batch <= {sequences}")
    if args.ours and args.ours[3] > trace.meta["num_experts"]:
        raise InputError(
            f"--ours: prefetch {args.ours[3]} experts a layer, but {args.trace}'s layers have "
            f"{trace.meta['num_experts']}; pass at most that"
        )
    source, source_path = (held, args.calibration) if held is not None else (trace, args.trace)
    if args.routers and not source.gate_inputs:
        raise InputError(
            f"--routers: {source_path} does not record every row's gate input, so no router is replayed; record a "
            "trace with them (hybrid-moe trace --hidden-every 1)"
        )
    try:
        calibration = Calibration.from_trace(trace, held, args.routers)
    except RouterUnavailable as err:
        hint = "" if args.routers else " (--routers DIR reads another)"
        raise InputError(f"the routers the gate prefetchers replay: {err}{hint}") from None
    profile = None
    if args.profile:
        from torch_hybrid_moe.profiling import load_profile

        profile = load_profile(args.profile, args.gpu_preset)
    elif args.hardware == "local":
        profile = _local_profile(args)
    costs = (
        profile.cost_model()
        if profile is not None
        else CostModel(HARDWARE[args.hardware], EXPERT_SHAPES[args.expert_shape])
    )
    if args.dense_us is not None:
        costs = replace(costs, dense_us=args.dense_us)
    placement = profile.measured.placement_s if profile is not None else None
    graph = (
        GraphStep(
            placement_s=placement or {},
            fill_s=None if args.graph_fill_us is None else args.graph_fill_us * 1e-6,
            cpu_task_s=(args.cpu_task_us or 0.0) * 1e-6,
        )
        if args.graph
        else None
    )
    ranked = None  # where a calibration trace tuned ours: its pick's rank on this trace among the candidates
    if args.ours:
        mine = ours(*args.ours)
    else:
        live = {"caches": LIVE_CACHES, "prefetch_sizes": ()} if args.save_ours else {}
        mine, tried = tune(held or trace, costs, args.batch, args.cache_ratio, calibration, graph=graph, **live)
        if held is not None:
            ranked = judged_rank(trace, mine, tried, costs, args.batch, args.cache_ratio, calibration, graph)
    ceiling = oracle(trace, mine, costs, args.batch, args.cache_ratio, calibration)
    limit, _ = bound(trace, costs, args.batch, args.cache_ratio, calibration, graph)
    events: dict[str, list] = {}
    results, ran, by_name = [], [], {}
    stacks = [*STACKS.values(), *dict.fromkeys(args.stack), mine, ceiling, limit]  # a --stack given twice runs once
    for stack in tqdm(stacks, desc="simulating", unit="stack", leave=False):
        timeline: list | None = [] if args.plot_dir else None
        # a stack whose prefetcher replays the router on gate inputs the trace lacks runs without it, renamed
        run, result = simulate_runnable(trace, stack, costs, args.batch, args.cache_ratio, calibration, timeline, graph)
        if timeline is not None:
            events[run.name] = timeline
        results.append(result)
        ran.append(run)
        by_name[stack.name] = result
    plots = _simulation_plots(args, trace, costs, calibration, ran, events, results, graph) if args.plot_dir else []
    if args.save_ours:  # last, once every stack ran and plotted: a refused or failed run leaves no file
        provenance = {
            "trace": str(source_path),
            "hardware": str(args.profile) if args.profile else args.hardware,
            "expert_shape": costs.expert.name,
            "batch": args.batch,
            "cache_ratio": args.cache_ratio,
            "graph": bool(args.graph),
            "stack": mine.description + (" (given by --ours, not tuned)" if args.ours else ""),
        }
        record = {"format": STACK_FILE_FORMAT, **_stack_fields(mine), "tuned_on": provenance}
        args.save_ours.write_text(json.dumps(record, indent=1) + "\n")
        _phase(f"wrote ours' settings to {args.save_ours} (HybridMoEConfig.from_stack_file, or generate --stack)")
    bound_tok_s = by_name["bound"].decode_tok_s

    def x_bound(tok_s: float) -> float | None:  # a trace without decode steps decodes nothing to compare
        return tok_s / bound_tok_s if bound_tok_s else None

    papers = [by_name[n] for n in PAPERS if n in by_name]
    best_paper = max(papers, key=lambda r: r.decode_tok_s)
    tuned_on = (
        "given by --ours"
        if args.ours
        else f"tuned on {args.calibration or 'the trace itself (pass --calibration)'}"
        + (" among what runs live" if args.save_ours else "")
    )
    if args.json:
        records = [  # each stack's description too: what ours was tuned to, which bound candidate won
            asdict(r) | {"description": s.description, "bound_tok_s": bound_tok_s, "x_bound": x_bound(r.decode_tok_s)}
            for r, s in zip(results, ran)
        ]
        records = [r | {"tuned_on": tuned_on} if r["stack"] == "ours" else r for r in records]
        if ranked is not None:
            rank, candidates, _, of_best = ranked
            records = [
                r | {"tuning_rank": rank, "tuning_candidates": candidates, "x_best_candidate": of_best}
                if r["stack"] == "ours"
                else r
                for r in records
            ]
        print(json.dumps(records, indent=1))
        for path in plots:
            print(f"wrote {path}", file=sys.stderr)
        return 0
    where = f"profile {args.profile}" if args.profile else f"hardware {args.hardware}"
    num_experts = trace.meta["num_experts"]
    slots = slots_for(args.cache_ratio, num_experts)
    print(f"trace {args.trace} ({trace.meta['model']}), {where}: {costs.hardware.description}")
    print(
        f"experts sized as {costs.expert.name}; batch {args.batch}; cache ratio {args.cache_ratio} ({slots} of "
        f"{num_experts} experts a layer in slots)"
        + (
            f"; calibrated on {args.calibration}"
            if args.calibration
            else "; calibrated on the trace itself (Fiddler's popularity, DALI's residuals: pass --calibration)"
        )
    )
    print(f"ours: {mine.description} ({tuned_on}); oracle: {ceiling.description}")
    if ranked is not None:
        rank, candidates, _, of_best = ranked
        print(f"ours' pick on this trace: rank {rank} of {candidates} candidates tuned, {of_best:.3f} x the fastest")
    print(f"bound: {limit.description} (the fastest future-aware stack of simulator/bound.py)")
    if graph is not None:
        uncaptured = ", ".join(r.stack for r in results if not r.captured)
        print(
            f"decode steps as the CUDA graph runs them: at most {graph.fills_per_step} fill(s) a layer step, joined at "
            "the step's end; each layer step after its own copies, its GPU share after its fetches; "
            + (
                "the schedulers' in-graph placement as measured ("
                + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in sorted(graph.placement_s.items()))
                + ")"
                if graph.placement_s
                else "no placement times (counted as 0: a cost profile taken on a GPU machine has them)"
            )
            + f". Replayed uncaptured, having no tensor form: {uncaptured or 'none'}; ours tuned as the graph runs"
        )
    width = max(len(r.stack) for r in results)  # "hybrimoe (no prefetch)" and the like
    print(
        f"{'stack':<{width}} {'decode tok/s':>12} {'x bound':>7} {'prefill tok/s':>13} {'hit rate':>8} "
        f"{'landed':>7} {'prefetch acc':>12} {'PCIe GB':>8} {'total s':>7} {'CPU busy':>8} {'GPU busy':>8}"
    )
    for r in results:
        acc = "-" if r.prefetch_accuracy is None else f"{r.prefetch_accuracy:.1%}"
        print(
            f"{r.stack:<{width}} {r.decode_tok_s:>12.1f} {_ratio(x_bound(r.decode_tok_s)):>7} {r.prefill_tok_s:>13.1f} "
            f"{r.hit_rate:>8.1%} {r.landed_hit_rate:>7.1%} {acc:>12} {r.pcie_gb:>8.2f} {r.replay_time_s:>7.3f} "
            f"{r.cpu_busy:>8.1%} {r.gpu_busy:>8.1%}"
        )
    if "ours" in by_name:
        mine_tok_s, paper_tok_s = by_name["ours"].decode_tok_s, best_paper.decode_tok_s
        print(
            f"ours / bound: {_ratio(x_bound(mine_tok_s))}; ours / best paper ({best_paper.stack}): "
            f"{_ratio(mine_tok_s / paper_tok_s if paper_tok_s else None)}"
        )
    print(
        "hit rate: routed experts in a slot when their layer started (as the live layer counts them); landed: those "
        "whose copy had arrived by then (the others waited for it, or ran on the CPU)"
    )
    for r in results:  # the bound is the best of a family, not a proof: say where something beat it
        if bound_tok_s and r.decode_tok_s > bound_tok_s * (1 + 1e-9):
            print(f"note: {r.stack} decodes {x_bound(r.decode_tok_s):.3f}x the bound, which is no proven optimum")
    for path in plots:
        print(f"wrote {path}")
    return 0


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _simulation_plots(
    args: argparse.Namespace,
    trace: Trace,
    costs: CostModel,
    calibration: Calibration | None,
    stacks: list,
    events: dict[str, list],
    results: list,
    graph: GraphStep | None,
) -> list[Path]:
    """Each stack's timeline of decode steps 1-3, and hit rate and decode speed against the cache ratio (replayed
    as the table's rows were: `graph`)."""
    from torch_hybrid_moe.simulator import plots

    where = f"{Path(args.trace).stem}, {costs.hardware.name}, batch {args.batch}"
    paths = [
        plots.plot_timeline(
            events[name],
            args.plot_dir / f"timeline-{name}.png",
            title=f"{name}: steps 1-3 at cache ratio {args.cache_ratio} ({where})",
        )
        for name in events
    ]
    ratios = sorted({*plots.DEFAULT_RATIOS, args.cache_ratio})
    sweep = plots.sweep_cache_ratio(
        trace, stacks, costs, ratios, args.batch, calibration, progress=True, done=results, graph=graph
    )
    # the bound is searched at --cache-ratio only: elsewhere the line is that pick's, not the bound there
    pick = f"bound's pick at ratio {args.cache_ratio:g}"
    sweep = {pick if name == "bound" else name: runs for name, runs in sweep.items()}
    paths.append(plots.plot_hit_rate(sweep, args.plot_dir / "hit-rate-vs-cache-ratio.png", title=where))
    paths.append(plots.plot_decode_speed(sweep, args.plot_dir / "decode-vs-cache-ratio.png", title=where))
    return paths


def profile(args: argparse.Namespace) -> int:
    """Measure (or read from the cache) this machine's expert costs; print them next to the presets'."""
    from torch_hybrid_moe.cost_model import CostModel
    from torch_hybrid_moe.ops import measured

    if args.refresh:  # the kernels' measured routes too (ops/measured.py): measured again by the next run
        measured.forget()
    p = _local_profile(args)
    m, shape = p.measured, p.expert
    cached = f"cached at {p.path}" if p.path else "not cached"
    source = f"read from {p.path}" if p.cached else f"measured in {m.seconds:.1f} s, {cached}"
    load = f"; load average {m.load:.1f} when measured" if m.load is not None else ""
    print(f"experts sized as {shape.name} ({shape.nbytes / 1e6:.1f} MB in bf16); {source}{load}")
    print(p.hardware.description)
    tokens = list(m.cpu_s)
    fitted = p.cost_model()
    print(f"{'ms per expert call':<22}" + "".join(f"{f'{n} tok':>10}" for n in tokens))
    rows = [("CPU measured", m.cpu_s), ("CPU fitted", {n: fitted.t_cpu(n) for n in tokens})]
    if m.gpu_s:
        rows += [("GPU measured", m.gpu_s), ("GPU fitted", {n: fitted.t_gpu(n) for n in tokens})]
    for label, times in rows:
        print(f"{label:<22}" + "".join(f"{times[n] * 1e3:>10.3f}" for n in tokens))
    if m.transfer_s is not None:
        print(f"{'PCIe copy measured':<22}{m.transfer_s * 1e3:>10.3f}   fitted {fitted.t_transfer() * 1e3:.3f}")
    print()
    print(
        f"{'hardware':<14} {'CPU GB/s':>9} {'CPU TFLOPS':>10} {'CPU us':>7} {'GPU GB/s':>9} {'GPU TFLOPS':>10} "
        f"{'PCIe GB/s':>9} {'t_cpu(1) ms':>11} {'t_cpu(64) ms':>12} {'t_gpu(1) ms':>11} {'copy ms':>8}"
    )
    for h in (p.hardware, *HARDWARE.values()):
        c = CostModel(h, shape)
        print(
            f"{h.name:<14} {h.cpu_bandwidth_gb_s:>9.1f} {h.cpu_tflops:>10.2f} {h.cpu_overhead_us:>7.1f} "
            f"{h.gpu_bandwidth_gb_s:>9.1f} {h.gpu_tflops:>10.1f} {h.pcie_gb_s:>9.1f} {c.t_cpu(1) * 1e3:>11.3f} "
            f"{c.t_cpu(64) * 1e3:>12.3f} {c.t_gpu(1) * 1e3:>11.3f} {c.t_transfer() * 1e3:>8.3f}"
        )
    print(
        "(peak figures: the cost model applies its efficiency factors; local ones are fitted so that it gives "
        "back the measured times)"
    )
    return 0


def prepare(args: argparse.Namespace) -> int:
    """Convert a checkpoint's experts to a host format once; later loads read them with no conversion."""
    from torch_hybrid_moe.loading import prepare as write

    config = thm.HybridMoEConfig(
        expert_budget=0.0,
        device="cpu",
        cpu_weight_dtype=args.cpu_weight_dtype,
        cpu_weight_group_size=_group_size(args),
    )
    out = _timed(f"preparing {args.model} as {args.cpu_weight_dtype}", lambda: write(args.model, args.out, config))
    print(f"wrote {out}: load it with thm.from_pretrained({str(out)!r}) or hybrid-moe generate --model {out}")
    return 0


def plan(args: argparse.Namespace) -> int:
    """Does the model fit, and how fast will it run: host memory per host format, the expert budget the GPU's
    memory leaves, and the simulator's expected tok/s per policy stack."""
    from torch_hybrid_moe import planning

    summary = planning.summarise(planning.load_config(args.model))
    costs_for = planning.hardware_costs(args.hardware)
    dense, kv, plans = planning.plan(
        summary,
        args.gpu_memory,
        args.host_memory,
        args.context,
        costs_for,
        args.cpu_weight_group_size,
        prompt=args.prompt,
    )

    def count(n: int) -> str:
        return f"{n / 1e9:.1f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"

    print(
        f"{args.model}: {summary.model_type}, {count(summary.expert_weights + summary.dense_weights)} weights "
        f"({count(summary.expert_weights)} in {summary.moe_layers} MoE layers of {summary.num_experts} experts, "
        f"top-{summary.top_k}); hardware {args.hardware}"
    )
    if args.gpu_memory > 0:
        budget = plans[0].expert_budget
        slots = round(budget * summary.num_experts)
        print(
            f"GPU {format_size(args.gpu_memory)}: dense weights {format_size(dense)} + KV cache of {args.context} "
            f"tokens {format_size(kv)} + 1 GiB reserve + a 2-expert staging ring; the rest holds {slots} of each "
            f"layer's {summary.num_experts} experts (expert_budget={budget:.4g})"
        )
        if not any(p.speeds for p in plans) and all(p.refused for p in plans):
            print("  the model cannot run on this GPU (below)")
        elif slots == 0:
            print("  no room for expert slots: every routed expert runs on the CPU")
    else:
        print("no GPU memory given (--gpu-memory): everything runs on the CPU")
    for p in plans:
        verdict = "fits" if p.fits_host else f"does not fit in {format_size(args.host_memory)}"
        if p.refused:
            verdict = f"not possible: {p.refused}"
        print(f"\ncpu_weight_dtype={p.fmt}: host memory {format_size(p.host_bytes)} ({verdict})")
        if p.speeds:
            print(f"  {'stack':<28} {'decode tok/s':>12} {f'prefill tok/s ({args.prompt})':>22}")
            for name, (decode, prefill) in p.speeds.items():
                print(f"  {name:<28} {decode:>12.1f} {prefill:>22.1f}")
    print(
        "\nSpeeds: the trace simulator on synthetic routing (a real model's skew and reuse) with this model's "
        "expert count and top-k, batch 1; `hybrid-moe simulate --trace` replays recorded routing instead."
    )
    return 0


def _size(text: str) -> int:
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"{text!r}: a size cannot be negative")
    size = parse_size(text)
    if size is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size with a unit, such as 24GiB or 512MB")
    return size


def format_stats(per_layer: dict[int, thm.LayerStats]) -> str:
    rows = [f"{'layer':>5} {'tokens':>7} {'hit rate':>8} {'on accel':>8} {'streamed':>8} {'on CPU':>7} {'MB moved':>9}"]
    for idx, s in per_layer.items():
        ran = max(1, s.accelerator_experts + s.streamed_experts + s.cpu_experts)
        rows.append(
            f"{idx:>5} {s.tokens:>7} {s.hit_rate:>8.1%} {s.accelerator_experts / ran:>8.1%} "
            f"{s.streamed_experts / ran:>8.1%} {s.cpu_experts / ran:>7.1%} {s.bytes_transferred / 1e6:>9.2f}"
        )
    return "\n".join(rows)


def bounded(kind: type, low: float, high: float = math.inf) -> Callable[[str], float]:
    """An argparse type: a finite `kind` number in [low, high], else a one-line usage error."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if not (low <= value <= high and math.isfinite(value)):  # NaN fails too
            span = f">= {low}" if high == math.inf else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be {span}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def writable(text: str) -> Path:
    """A new output file in a directory that exists and can be written: checked before any work, not after it (an
    existing file is refused, not overwritten: it may be the input, or hold what another run wrote)."""
    path = Path(text)
    parent = path.parent if str(path.parent) else Path(".")
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name")
    if path.exists():
        raise argparse.ArgumentTypeError(f"{text} exists; remove it or give another name (nothing was written)")
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}: its directory does not exist or is not writable")
    return path


def _writable_dir(text: str) -> Path:
    path = Path(text)
    if path.exists() and (not path.is_dir() or not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text} is not a writable directory")
    if not path.exists() and not os.access(_existing_ancestor(path), os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot create {text}: no write access to {_existing_ancestor(path)}")
    return path


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


_GROUP_HELP = "scale group of int8 / int4 weights, in columns; a weight with fewer columns gets one scale a row"


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line that says where help is, not a usage block."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # "-1GiB" or "-.5" is a value for its option's check to refuse with a reason, not an unknown option ("expected
        # one argument"): argparse before Python 3.14 (whose own matcher this is) let bare numbers only through
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(prog="hybrid-moe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    model_help = f"embedded model ({', '.join(embedded_models())}), local transformers directory or hub id"
    g = sub.add_parser("generate", help="patch, compile and generate; print speed and expert placement")
    e = sub.add_parser("eval-ppl", help="held-out perplexity, unpatched vs patched in a mode")
    t = sub.add_parser("trace", help="record per-token expert routing on held-out prompts to a trace file")
    s = sub.add_parser("simulate", help="replay a routing trace through every policy stack on a hardware model")
    c = sub.add_parser(
        "convert-trace",
        help="routing recorded elsewhere (per-token top-k ids and weights as JSONL) into a trace file for simulate",
    )
    pr = sub.add_parser("profile", help="measure this machine's per-expert CPU / GPU / PCIe times, next to the presets")
    sub.add_parser("build", help="build the C++ CPU kernel now (otherwise the first run does, for a minute or two)")
    pl = sub.add_parser("plan", help="does a model fit, and how fast will it run? from its config alone")
    pp = sub.add_parser("prepare", help="write a checkpoint with its experts in a host format, to load unconverted")
    for p in (e, t, pl):
        p.add_argument("--model", default=DEFAULT_MODEL, help=model_help)
    g.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"{model_help}, a llama.cpp .gguf file, or tiny:ARCH for random weights ({', '.join(TINY_ARCHITECTURES)})",
    )
    pp.add_argument("--model", type=_non_empty, required=True, help="local checkpoint directory or hub id")
    pp.add_argument("--cpu-weight-dtype", required=True, choices=[f for f in CPU_WEIGHT_DTYPES if f != "model"])
    pp.add_argument(
        "--cpu-weight-group-size",
        type=bounded(int, 32),
        help=f"{_GROUP_HELP} (default {DEFAULT_GROUP_SIZE})",
    )
    pp.add_argument("--out", type=Path, required=True, help="a new (or empty) directory")
    for p in (g, e):
        p.add_argument(
            "--expert-budget",
            type=bounded(float, 0.0, 1.0),
            default=None,
            help="fraction of each MoE layer's experts held in accelerator slots (default: 0.25 with CUDA, 0 without)",
        )
        p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
        p.add_argument(
            "--dtype",
            default="auto",
            choices=sorted(_DTYPES),
            help="compute dtype; auto: the checkpoint's own (float32 for generate's tiny:ARCH)",
        )
    for p in (g, e):
        p.add_argument(
            "--stack",
            type=Path,
            metavar="FILE",
            help="run the placement and cache a stack file names (hybrid-moe simulate --save-ours), costed by this "
            "machine's profile",
        )
        p.add_argument(
            "--cpu-weight-dtype",
            default="model",
            choices=CPU_WEIGHT_DTYPES,
            help="format of the experts' host copy; int8 / int4 are approximate",
        )
        p.add_argument(
            "--cpu-weight-group-size",
            type=bounded(int, 32),
            help=f"{_GROUP_HELP} (default {DEFAULT_GROUP_SIZE})",
        )
        p.add_argument(
            "--dense-weight-dtype",
            default="model",
            choices=DENSE_WEIGHT_DTYPES,
            help="format of the CPU's dense linears (attention, LM head); int8 / int4 are approximate",
        )
    g.add_argument("--prompt", type=_non_empty, default="def fibonacci(n):")
    g.add_argument(
        "--max-new-tokens", type=bounded(int, 2), default=32, help="at least 2 (one prefill token, one decode token)"
    )
    g.add_argument(
        "--prompt-tokens",
        type=bounded(int, 1),
        help="repeat the prompt's tokens to this length, for a prefill figure (default: the prompt as is)",
    )
    e.add_argument(
        "--mode",
        default="exact",
        choices=["exact", "expert_deferral", "daop_precalc"],
        help="exact, or an approximate mode: expert_deferral (KTransformers' Expert Deferral, compiled), "
        "daop_precalc (DAOP's predictive CPU pre-calculation, compiled decode steps)",
    )
    e.add_argument(
        "--deferred-experts",
        type=int,
        default=None,
        help="with --mode expert_deferral: experts deferred per token (default: top-k - 2, at least 1)",
    )
    e.add_argument(
        "--precalc-from-layer",
        type=int,
        default=None,
        help=f"with --mode daop_precalc: first decoder block approximated (default {PRECALC_FROM_LAYER}, or the "
        "model's last MoE block where it has fewer)",
    )
    e.add_argument("--max-tokens", type=bounded(int, 1), default=16384)
    s.add_argument("--trace", type=Path, required=True)
    pl.add_argument("--gpu-memory", type=_size, default=0, help="GPU memory to plan for, e.g. 24GiB (default: none)")
    pl.add_argument("--host-memory", type=_size, default=64 * 2**30, help="host memory to plan for (default 64GiB)")
    pl.add_argument("--context", type=bounded(int, 1), default=4096, help="tokens of KV cache to keep room for")
    pl.add_argument("--prompt", type=bounded(int, 1), default=512, help="prompt length of the prefill estimate")
    pl.add_argument(
        "--cpu-weight-group-size",
        type=bounded(int, 32),
        default=DEFAULT_GROUP_SIZE,
        help=f"{_GROUP_HELP} (default %(default)s)",
    )
    pl.add_argument(
        "--hardware",
        default="rtx4090",
        choices=[*sorted(HARDWARE), "local"],
        help="a preset, or local: this machine, measured (cached) by a short warm-up profile",
    )
    costs = s.add_mutually_exclusive_group()
    costs.add_argument(
        "--hardware",
        default="dali",
        choices=[*sorted(HARDWARE), "local"],
        help="a preset, or local: this machine, measured (cached) by a short warm-up profile",
    )
    costs.add_argument(
        "--profile",
        type=Path,
        metavar="FILE",
        help="a cost profile measured on another machine (a profile-*.json that `hybrid-moe profile` cached there, "
        "e.g. on the GPU machine a trace came from); its expert shape replaces --expert-shape",
    )
    for p in (s, pr):
        p.add_argument(
            "--expert-shape",
            default="deepseek-v2-lite",
            choices=sorted(EXPERT_SHAPES),
            help="expert size the costs assume (the trace gives only the routing)",
        )
        p.add_argument(
            "--gpu-preset",
            default="rtx4090",
            choices=sorted(HARDWARE),
            help="with local hardware or --profile, where no GPU was measured: the preset the GPU and link figures "
            "come from",
        )
    s.add_argument(
        "--dense-us",
        type=bounded(float, 0.0, 1e6),
        metavar="US",
        help="a decoder block's fixed non-MoE time at decode, measured on a real step (e.g. gpu_decode.py's whole-GPU "
        "row: its time per token over its layers); default: the estimate from the expert shape",
    )
    s.add_argument(
        "--graph",
        action="store_true",
        help="replay decode steps as the live CUDA graph runs them: fills capped per layer step and joined at the "
        "step's end, each layer's GPU share after its fetches, the schedulers' placement at the profile's measured "
        "device time",
    )
    for flag, what in (
        ("--graph-fill-us", "an expert's copy inside the graph (default: the profile's copy-engine transfer)"),
        ("--cpu-task-us", "the CPU task's host round trip, paid by every layer step at a partial budget (default 0)"),
    ):
        s.add_argument(
            flag,
            type=bounded(float, 0.0, 1e6),
            metavar="US",
            help=f"with --graph: microseconds of {what}, as benchmarks/graph_costs.py times them on the GPU machine",
        )
    s.add_argument("--batch", type=bounded(int, 1), default=1)
    s.add_argument("--cache-ratio", type=bounded(float, 0.0, 1.0), default=0.25)
    s.add_argument("--calibration", type=Path, help="trace the policies learn from beforehand (default: the trace)")
    s.add_argument(
        "--routers",
        type=Path,
        metavar="DIR",
        help="a model directory (config.json, safetensors) to read the routers from, which the gate-based prefetchers "
        "replay on the trace's gate inputs (default: the trace's model; a random model that was never saved leaves "
        "one: gpu_decode.py --trace writes PATH's stem + '-routers')",
    )
    s.add_argument(
        "--plot-dir", type=_writable_dir, help="write timelines and cache-ratio sweeps here as PNGs (matplotlib)"
    )
    s.add_argument(
        "--ours",
        type=_ours_spec,
        metavar="W,U,DECAY,PREFETCH",
        help="our stack's window size, update size, decay and prefetch size (0: none) instead of tuning "
        "them on the calibration trace, e.g. 4,1,0.5,0",
    )
    s.add_argument(
        "--save-ours",
        type=writable,
        metavar="FILE",
        help="write ours' settings here as a stack file for the live runtime (HybridMoEConfig.from_stack_file, "
        "generate --stack): as --ours gives them, or tuned among what runs in the decode graph (window, MRS, LFU, "
        "LRU and cost-aware caches; no prefetch)",
    )
    s.add_argument(
        "--stack",
        type=_stack_spec,
        action="append",
        default=[],
        metavar="SCHEDULER,CACHE[,PREFETCHER]",
        help="also replay this stack of registry names with their default options (repeatable), e.g. gpu_decode.py's "
        "dali row: dali_greedy,lru",
    )
    s.add_argument("--json", action="store_true")
    c.add_argument(
        "--jsonl",
        type=Path,
        required=True,
        help='one object per token row: {"sequence": 0, "step": 0, "ids": {"1": [3, 7]}, '
        '"weights": {"1": [0.6, 0.4]}} (layer index -> top-k)',
    )
    c.add_argument("--num-experts", type=bounded(int, 1, 2**15), required=True)
    c.add_argument("--model-name", default="external", help="recorded in the trace's metadata")
    c.add_argument("--out", type=writable, required=True)
    pr.add_argument(
        "--refresh",
        action="store_true",
        help="measure again even if a cached profile exists; forget the kernels' measured routes too",
    )
    t.add_argument("--out", type=writable, required=True)
    t.add_argument("--prompts", type=bounded(int, 1), default=16)
    t.add_argument("--prompt-tokens", type=bounded(int, 1), default=64)
    t.add_argument(
        "--offset", type=bounded(int, 0), default=0, help="token offset of each prompt in its held-out slice"
    )
    t.add_argument(
        "--max-new-tokens",
        type=bounded(int, 3),
        default=64,
        help="at least 3: the last token is never fed back, and simulate needs two decode steps",
    )
    t.add_argument(
        "--hidden-every",
        type=bounded(int, 0, 2**31),
        default=1,
        help="record the gate input of every N-th token row (0: none); the simulator replays the model's routers "
        "(gate-based prefetchers) only on traces of every row (1)",
    )
    args = parser.parse_args(argv)
    commands = {
        "generate": generate,
        "eval-ppl": eval_ppl,
        "trace": trace,
        "simulate": simulate,
        "profile": profile,
        "convert-trace": convert_trace,
        "build": build,
        "plan": plan,
        "prepare": prepare,
    }
    try:
        return commands[args.command](args)
    except InputError as err:
        print(f"hybrid-moe {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
