"""Where a decode token's time goes: torch.profiler over `generate` with ours (`from_pretrained` at expert budget 0),
per op, per token. Two generations of the same prompt, of 2 and of 2 + N new tokens, are profiled and subtracted,
so prefill and the first step cancel out and what is left is N decode steps. With --prefill it profiles one
generation of a single new token instead (the prompt's prefill and the LM head) and lists ops per input shape, which
tells one projection from another. The weights' bytes each op reads are
not known to the profiler: the op names say which part of the step it is (`hybrid_moe::linear`: the dense layers,
`hybrid_moe::dispatch`: the experts, `aten::bmm`: decode attention, the rest: the compiled graph's own kernels,
Dynamo's guards and the ops around them).

    python benchmarks/decode_profile.py [--shape qwen3-30b-a3b] [--layers 4] [--weights model|int8|int4] [--tokens 32]
        [--prefill]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from end_to_end import SHAPES, checkpoint


def profiled(
    model: torch.nn.Module, ids: torch.Tensor, new: int, shapes: bool = False
) -> tuple[float, dict[str, tuple[float, int]]]:
    """Seconds of one greedy generation of `new` tokens and {op: (self seconds, calls)} in it (after a warm-up);
    `shapes`: one entry per op and input shapes."""
    gen = dict(do_sample=False, max_new_tokens=new, min_new_tokens=new)
    model.generate(ids, **gen)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=shapes) as prof:
        start = time.perf_counter()
        model.generate(ids, **gen)
        seconds = time.perf_counter() - start
    return seconds, {
        e.key + (f" {e.input_shapes}" if shapes else ""): (e.self_cpu_time_total / 1e6, e.count)
        for e in prof.key_averages(group_by_input_shape=shapes)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--weights",
        choices=("model", "int8", "int4"),
        default="model",
        help="int8 / int4: experts and dense layers, as end_to_end.py's ours-int8-dense rows",
    )
    parser.add_argument("--tokens", type=int, default=32, help="decode steps profiled")
    parser.add_argument("--prefill", action="store_true", help="profile the prompt's prefill instead, per input shape")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--rows", type=int, default=25, help="ops listed")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "torch_hybrid_moe" / "checkpoints")
    args = parser.parse_args()
    if args.tokens < 1 or args.prompt < 1:
        parser.error("--tokens and --prompt must be at least 1")
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
        short_s, short = profiled(model, ids, 2)
        long_s, long = profiled(model, ids, 2 + args.tokens)
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
        print(f"{seconds * 1e3:13.3f} {calls:11.1f}  {name[:90]}")


if __name__ == "__main__":
    main()
