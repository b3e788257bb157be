"""Where a decode token's time goes: torch.profiler over `thm.greedy_generate` (the package's decode loop) with ours
(`from_pretrained` at expert budget 0), per op, per token. Two generations of the same prompt, of 3 and of 3 + N new
tokens, are profiled and subtracted, so prefill and the first two decode steps (through Dynamo, before the step is
called directly) cancel out and what is left is N decode steps. With --prefill it profiles one generation of a single
new token instead (the prompt's prefill and the LM head) and lists ops per input shape, which tells one projection
from another. The weights' bytes each op reads are not known to the profiler: the op names say which part of the step
it is (`hybrid_moe::matvecs` / `hybrid_moe::linear`: the dense layers, `hybrid_moe::cpu_moe` /
`hybrid_moe::dispatch`: the experts, `hybrid_moe::decode_attention` / `hybrid_moe::latent_attention`: attention,
`hybrid_moe::greedy_tokens`: the argmax; the rest: the compiled graph's own kernels and wrapper, and the ops around
them). With --replay it times, without the profiler, each decode step's forward called both ways on alternate steps:
the graph called directly (runtime/decode_replay.py, the default) and through Dynamo's frame evaluation, so that both
see the same moments of a noisy host. With --loop it times whole decode tokens of `generate()` against
`thm.greedy_generate` (the same tokens, without generate()'s per-token Python), in alternating rounds: each round's
median gap between two tokens reaching a streamer, then the medians over rounds and of the paired differences. With
--wrapper it times, in the same way, `thm.greedy_generate` with its decode step's graph wrapper in Python against in
C++ (the CPU default).

    python benchmarks/decode_profile.py [--shape qwen3-30b-a3b] [--layers 4] [--weights model|int8|int4] [--tokens 32]
        [--shapes | --prefill | --replay [--rounds 4] | --loop [--rounds 4] | --wrapper [--rounds 4]]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from end_to_end import SHAPES, _Stamps, checkpoint

from torch_hybrid_moe.cli import bounded


def profiled(
    model: torch.nn.Module, ids: torch.Tensor, new: int, shapes: bool = False
) -> tuple[float, dict[str, tuple[float, int]]]:
    """Seconds of one greedy generation of `new` tokens (no end token) and {op: (self seconds, calls)} in it (after a
    warm-up); `shapes`: one entry per op and input shapes."""
    import torch_hybrid_moe as thm

    thm.greedy_generate(model, ids, new, eos_token_id=[])
    with profile(activities=[ProfilerActivity.CPU], record_shapes=shapes) as prof:
        start = time.perf_counter()
        thm.greedy_generate(model, ids, new, eos_token_id=[])
        seconds = time.perf_counter() - start
    return seconds, {
        e.key + (f" {e.input_shapes}" if shapes else ""): (e.self_cpu_time_total / 1e6, e.count)
        for e in prof.key_averages(group_by_input_shape=shapes)
    }


class Alternating:
    """A `generate()` call's compiled forward (a `DecodeReplay`): once it has settled on a graph to call directly,
    every other step goes through Dynamo instead; the forward's seconds are kept per way."""

    def __init__(self, replay) -> None:
        self.replay = replay
        self.seconds: dict[str, list[float]] = {"direct": [], "dynamo": []}

    def __call__(self, **kwargs: object) -> object:
        settled = any(s.plan is not None for s in self.replay.signatures.values())
        way = "dynamo" if settled and len(self.seconds["direct"]) > len(self.seconds["dynamo"]) else "direct"
        start = time.perf_counter()
        out = self.replay.compiled(**kwargs) if way == "dynamo" else self.replay(**kwargs)
        if settled:
            self.seconds[way].append(time.perf_counter() - start)
        return out


def spread(values: list[float], scale: float, digits: int) -> str:
    """Median [quartiles] of `values` times `scale`, as the tables print them (one value: itself for all three)."""
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3  # within the data
    mid, low, high = (v * scale for v in (statistics.median(values), q[0], q[2]))
    return f"{mid:.{digits}f} [{low:.{digits}f}-{high:.{digits}f}]"


def replay_table(model: torch.nn.Module, ids: torch.Tensor, tokens: int, rounds: int) -> str:
    """Medians and quartiles of a decode step's forward each way over `rounds` generations, and of the paired
    differences (a Dynamo step less the direct step before it)."""
    made: list[Alternating] = []
    get_compiled_call = model.get_compiled_call
    model.get_compiled_call = lambda config: made.append(Alternating(get_compiled_call(config))) or made[-1]
    gen = dict(do_sample=False, max_new_tokens=tokens + 3, min_new_tokens=tokens + 3)
    model.generate(ids, **gen)  # compiles
    made.clear()
    for _ in range(rounds):
        model.generate(ids, **gen)
    ways = {w: [s for a in made for s in a.seconds[w]] for w in ("direct", "dynamo")}
    pairs = [d - r for a in made for r, d in zip(a.seconds["direct"], a.seconds["dynamo"])]
    if min(len(v) for v in ways.values()) < 2:
        sys.exit(
            "decode_profile: the decode step was never called directly (a graph break, or Python state it "
            "changes each step); nothing to compare"
        )

    return "\n".join(
        [
            f"{'forward ms: median [quartiles]':>34}  steps",
            f"{'graph called directly':>34}  {spread(ways['direct'], 1e3, 3)}  {len(ways['direct'])}",
            f"{'through Dynamo':>34}  {spread(ways['dynamo'], 1e3, 3)}  {len(ways['dynamo'])}",
            f"{'paired: Dynamo less direct':>34}  {spread(pairs, 1e3, 3)}  {len(pairs)}",
        ]
    )


def loop_table(model: torch.nn.Module, ids: torch.Tensor, tokens: int, rounds: int) -> str:
    """Per round, generate() then greedy_generate: the median time between two decode tokens of each (the prompt's
    push, prefill and the first decode step left out), and the paired difference; medians [quartiles] over rounds."""
    import torch_hybrid_moe as thm

    model.generation_config.eos_token_id = None  # both make every token, with no per-step work for an end token
    ways = {
        "generate()": lambda streamer: model.generate(
            ids, do_sample=False, max_new_tokens=tokens + 2, streamer=streamer
        ),
        "thm.greedy_generate": lambda streamer: thm.greedy_generate(model, ids, tokens + 2, streamer=streamer),
    }
    return alternated(ways, rounds)


def wrapper_table(model: torch.nn.Module, ids: torch.Tensor, tokens: int, rounds: int) -> str:
    """Per round, thm.greedy_generate with its decode step's graph wrapper in Python, then in C++ (the package's
    CPU default, compile_passes/backend.py's CPU_DECODE_OPTIONS): as loop_table measures them."""
    import torch_hybrid_moe as thm
    from torch_hybrid_moe import generation

    steps = {
        "Python wrapper": torch.compile(generation.next_tokens, backend="hybrid_moe", fullgraph=True, dynamic=False),
        "C++ wrapper": generation._compiled_step(),
    }

    def run(step: object, streamer: object) -> torch.Tensor:
        default = generation._compiled_step
        generation._compiled_step = lambda: step  # the step greedy_generate calls, for this run only
        try:
            return thm.greedy_generate(model, ids, tokens + 2, eos_token_id=[], streamer=streamer)
        finally:
            generation._compiled_step = default

    return alternated({way: functools.partial(run, step) for way, step in steps.items()}, rounds)


def alternated(ways: dict[str, Callable[[object], torch.Tensor]], rounds: int) -> str:
    """Rounds of each way in turn (a generation given a streamer): per round, each way's median time between two
    decode tokens (the prompt's push, prefill and the first decode step left out), and the first way's less the
    second's; medians [quartiles] over rounds, and whether both gave the same tokens."""
    same = torch.equal(*(run(None) for run in ways.values()))  # also compiles each
    ms: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(rounds):
        for way, run in ways.items():
            stamps = _Stamps()
            run(stamps)
            gaps = [b - a for a, b in zip(stamps.times[2:], stamps.times[3:])]
            ms[way].append(statistics.median(gaps) * 1e3)
    pairs = [a - b for a, b in zip(*ms.values())]
    first, second = ways
    labels = {"head": "ms a decode token: median [quartiles]", "paired": f"paired: {first} less {second}"}
    width = max(map(len, [*labels.values(), *ways]))
    return "\n".join(
        [
            f"{labels['head']:>{width}}  rounds",
            *(f"{way:>{width}}  {spread(v, 1, 2)}  {len(v)}" for way, v in ms.items()),
            f"{labels['paired']:>{width}}  {spread(pairs, 1, 2)}  {len(pairs)}",
            f"{'same tokens':>{width}}  {same}",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=bounded(int, 1), default=4)
    parser.add_argument(
        "--weights",
        choices=("model", "int8", "int4"),
        default="model",
        help="int8 / int4: experts and dense layers, as end_to_end.py's ours-int8-dense rows",
    )
    parser.add_argument("--tokens", type=bounded(int, 1), default=32, help="decode steps profiled")
    parser.add_argument("--prefill", action="store_true", help="profile the prompt's prefill instead, per input shape")
    parser.add_argument(
        "--shapes", action="store_true", help="decode ops per input shape (which projection, what cache length)"
    )
    parser.add_argument(
        "--replay", action="store_true", help="time decode steps called directly against through Dynamo instead"
    )
    parser.add_argument(
        "--loop", action="store_true", help="time decode tokens of generate() against thm.greedy_generate instead"
    )
    parser.add_argument(
        "--wrapper",
        action="store_true",
        help="time decode tokens of thm.greedy_generate with the step's wrapper in Python against in C++ instead",
    )
    parser.add_argument(
        "--rounds",
        type=bounded(int, 1),
        default=4,
        help="--replay, --loop, --wrapper: generations of --tokens steps (each)",
    )
    parser.add_argument("--prompt", type=bounded(int, 1), default=128)
    parser.add_argument("--rows", type=bounded(int, 1), default=25, help="ops listed")
    parser.add_argument("--threads", type=bounded(int, 1), default=2)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "torch_hybrid_moe" / "checkpoints")
    args = parser.parse_args()
    if args.tokens < 1 or args.prompt < 1 or args.rounds < 1:
        parser.error("--tokens, --prompt and --rounds must be at least 1")
    if args.shapes + args.prefill + args.replay + args.loop + args.wrapper > 1:
        parser.error("--shapes, --prefill, --replay, --loop and --wrapper measure different things: give one")
    import torch_hybrid_moe as thm

    torch.set_num_threads(args.threads)
    path = checkpoint(args.shape, args.layers, args.cache)
    model = thm.from_pretrained(
        path,
        thm.HybridMoEConfig(
            expert_budget=0.0,
            cpu_weight_dtype=args.weights,
            dense_weight_dtype="model" if args.weights == "model" else args.weights,
        ),
        dtype=torch.bfloat16,
    )
    ids = torch.randint(100, 2000, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    if args.replay or args.loop or args.wrapper:
        table_of = replay_table if args.replay else loop_table if args.loop else wrapper_table
        with torch.no_grad():
            table = table_of(model, ids, args.tokens, args.rounds)
        print(
            f"{args.shape}, {args.layers} layers, {args.weights} weights, {args.threads} threads, "
            f"a {args.prompt}-token prompt, {args.rounds} x {args.tokens} decode steps alternating, "
            f"{time.strftime('%Y-%m-%d')}"
        )
        print(table)
        return
    if args.prefill:
        with torch.no_grad():
            seconds, ops = profiled(model, ids, 1, shapes=True)
        print(
            f"{args.shape}, {args.layers} layers, {args.weights} weights, {args.threads} threads: "
            f"{seconds * 1e3:.1f} ms for a {args.prompt}-token prefill and one new token under the profiler, "
            f"{time.strftime('%Y-%m-%d')}"
        )
        print(f"{'self ms':>9} {'calls':>5} {'ms/call':>8}  op [input shapes]")
        for name, (op_s, calls) in sorted(ops.items(), key=lambda kv: -kv[1][0])[: args.rows]:
            print(f"{op_s * 1e3:9.2f} {calls:5d} {op_s * 1e3 / calls:8.2f}  {name[:120]}")
        return
    with torch.no_grad():
        # the longer first: its static cache length is kept for the shorter run, so both prefill the same cache
        long_s, long = profiled(model, ids, 3 + args.tokens, shapes=args.shapes)
        short_s, short = profiled(model, ids, 3, shapes=args.shapes)
    per_token = (long_s - short_s) / args.tokens
    if per_token <= 0:  # the prompt's prefill, in both runs, varied by more than the decode steps took
        sys.exit(
            f"decode_profile: {args.tokens} decode steps took no measurable time beside the prefill's noise "
            f"({(long_s - short_s) * 1e3:.1f} ms); rerun with more --tokens (32 or more)"
        )
    rows = sorted(
        (
            (long[k][0] - short.get(k, (0.0, 0))[0]) / args.tokens,
            (long[k][1] - short.get(k, (0.0, 0))[1]) / args.tokens,
            k,
        )
        for k in long
    )[::-1]
    print(
        f"{args.shape}, {args.layers} layers, {args.weights} weights, {args.threads} threads: "
        f"{per_token * 1e3:.2f} ms a decode token under the profiler ({1 / per_token:.1f} tok/s), "
        f"{time.strftime('%Y-%m-%d')}"
    )
    print(f"{'self ms/token':>13} {'calls/token':>11}  op")
    for seconds, calls, name in rows[: args.rows]:
        print(f"{seconds * 1e3:13.3f} {calls:11.1f}  {name[: 150 if args.shapes else 90]}")


if __name__ == "__main__":
    main()
