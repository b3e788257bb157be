"""Decode and prefill throughput on a GPU: the hybrid path (decode step as one CUDA graph, and uncaptured)
against the baselines the accelerator issue names, side by side in one run, with a physical floor.

Rows, each on a freshly built model (patching moves its experts into pinned host memory):
- hybrid: our patch at each expert budget with the default stack (on CUDA ours since 2026-11-28: `queue_aware`
  placement over the window cache, local costs), decode graph on and off;
- lru: the same with the LRU stack (`cached_on_accelerator` + `lru`), the default before 2026-11-28: the "hybrid"
  rows of earlier sections of benchmarks/RESULTS.md;
  (prefetch, prefetch-1, deferral, no-stream and stream-8 vary the default stack too: ours with the graph on since
  2026-11-28, the LRU stack in earlier sections);
- prefetch: the same with the gate prefetcher (layer l+1's router on layer l's input, decided on the device),
  4 experts per layer step (its default for top-6); prefetch-1: at most 1 (`prefetch_size=1`);
- deferral: the same with KTransformers' Expert Deferral (approximate: 2 of the 6 experts deferred), whose
  deferred CPU experts overlap the next block inside the graph;
- dali: the same with DALI's greedy placement (`dali_greedy`, costs profiled on this machine): a missing expert
  is fetched and run on the GPU when that finishes the layer sooner, decided on the device inside the graph;
- hybrimoe: HybriMoE's placement and MRS cache (`hybrimoe` + `mrs`, local costs), inside the graph;
- ours: our stack named explicitly (`queue_aware` placement + window cache with decay, local costs), inside the graph;
- all-cpu: budget 0, every routed expert on the CPU (the Fiddler / KTransformers layout), graph on and off;
- on-demand: every missing expert fetched into a slot before it runs (MoE-Infinity's GPU-centric placement),
  graph on and off;
- no-stream: the hybrid row with the prefill staging ring off (`staging_slots=0`): every expert not in a slot is
  computed on the CPU at prefill; the other rows stream the heaviest through the ring (runtime/staging_ring.py);
- stream-8, stream-16: the hybrid row with a ring of 8 (16) buffers, computed 4 (8) experts at a time (grouped
  GEMMs) while the other half fills;
- accelerate: transformers + accelerate `device_map` offload (the routed experts' modules on "cpu", their
  weights streamed to the GPU at every forward);
- gpu: the whole model on the GPU, no offload, compiled by transformers' own generate (static cache): the
  ceiling a budget of 1.0 is held to.

Every row's model has the same weights (one seeded pool), so greedy decoding routes alike in every exact row.
`--trace PATH` records that routing (the unpatched model on the GPU, the decode run's prompt and length) for
`hybrid-moe simulate --trace PATH --profile FILE`, with FILE the cost profile the rows measured here (in the
cache folder, `profile-deepseek-v2-lite-*.json`): the simulator's prediction for each live row, next to what the
row measured.

The model is DeepSeek-V2-Lite-shaped with random bf16 weights at full size by default (27 layers, 64 routed
experts of 2048 x 1408, top-6, 2 shared experts, MLA attention; ~16 B parameters, ~31 GiB in host memory).
Each row warms up (compilation, graph capture) with both prompt lengths, then times generate(): prefill = the
prompt's tokens over the time of a 1-token generate; decode = the extra tokens over the extra time of a longer
generate. Medians of --repeats. The floor is the time to stream the experts the CPU computed per token (measured:
the layers' `cpu_experts` counts) at the host's measured copy rate (bytes read plus written, an upper bound on what
reads alone reach): a ceiling on tok/s for any layout that computes those experts on this CPU. The prefill floor is the
better of two: every routed expert copied to the GPU once at the measured pinned copy rate (PCIe), or read once by
the CPU at the host's copy rate; the prefill column's share of it is printed beside it.

    python benchmarks/gpu_decode.py [--layers 27] [--budgets 0.25 0.5]
        [--rows hybrid lru prefetch prefetch-1 deferral dali hybrimoe ours all-cpu on-demand no-stream stream-8
                stream-16 accelerate gpu]
        [--graph off on] [--tokens 32] [--prompt 512 [4096 ...]] [--cpu-threads N] [--json] [--profile DIR]
        [--trace PATH] [--stack-file FILE]

`--stack-file FILE` adds a "tuned" row at each budget: the stack `hybrid-moe simulate --save-ours FILE` picked (for
instance on this script's --trace and profile), run as `HybridMoEConfig.from_stack_file` loads it.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import platform
import statistics
import time
import traceback
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DeepseekV2Config, StaticCache

import torch_hybrid_moe as thm
from torch_hybrid_moe.cli import bounded
from torch_hybrid_moe.config import STACK_FILE_FIELDS
from torch_hybrid_moe.errors import InputError
from torch_hybrid_moe.generation import ForwardNames

ROWS = (
    "hybrid",
    "lru",
    "prefetch",
    "prefetch-1",
    "deferral",
    "dali",
    "hybrimoe",
    "ours",
    "all-cpu",
    "on-demand",
    "no-stream",
    "stream-8",
    "stream-16",
    "accelerate",
    "gpu",
)
VARIANTS = {
    "hybrid": {},
    "lru": {"scheduler": "cached_on_accelerator", "cache_policy": "lru"},
    "prefetch": {"prefetcher": "gate"},
    "prefetch-1": {"prefetcher": "gate", "prefetch_size": 1},
    "deferral": {"mode": "expert_deferral", "deferred_experts": 2},
    "dali": {"scheduler": "dali_greedy", "hardware": "local"},
    "hybrimoe": {"scheduler": "hybrimoe", "cache_policy": "mrs", "hardware": "local"},
    "ours": {
        "scheduler": "queue_aware",
        "cache_policy": "dali_window",
        "cache_options": {"w_size": 8, "u_size": 1, "decay": 0.8},
        "hardware": "local",
    },
    "on-demand": {"scheduler": "on_demand"},
    "no-stream": {"staging_slots": 0},
    "stream-8": {"staging_slots": 8},
    "stream-16": {"staging_slots": 16},
}


def lite_config(layers: int) -> DeepseekV2Config:
    """DeepSeek-V2-Lite's published shape."""
    return DeepseekV2Config(
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_shared_experts=2,
        n_routed_experts=64,
        num_experts_per_tok=6,
        first_k_dense_replace=1,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        head_dim=64,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=False,
        max_position_embeddings=8192,  # room for a 4096-token prefill and its decode
    )


def random_model(config: DeepseekV2Config) -> torch.nn.Module:
    """bf16 weights drawn cheaply: every tensor is filled from one seeded random pool at its own offset, so every
    call gives the same weights."""
    with torch.device("meta"):  # a config of its own: patching marks the model's config as patched
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    pool = torch.randn(1 << 24, generator=torch.Generator().manual_seed(0), dtype=torch.bfloat16) * 0.02
    for i, t in enumerate([*model.parameters(), *model.buffers()]):
        if not t.is_floating_point():
            continue
        flat = t.data.view(-1)
        start = (i * 7919) % pool.numel()
        for off in range(0, flat.numel(), pool.numel()):
            n = min(pool.numel(), flat.numel() - off)
            src = torch.cat((pool[start:], pool[:start]))[:n]
            flat[off : off + n].copy_(src)
    for module in model.modules():  # norms at 1, rotary tables recomputed
        if "RMSNorm" in type(module).__name__:
            module.weight.data.fill_(1.0)
        if hasattr(module, "inv_freq") and hasattr(module, "rope_init_fn"):
            inv_freq, _ = module.rope_init_fn(module.config, "cpu")
            module.inv_freq.copy_(inv_freq)
            module.original_inv_freq = inv_freq
    return model.eval()


def host_bandwidth_gb_s() -> float:
    """Copy bandwidth of host memory (bytes read + written), the CPU experts' ceiling."""
    a = torch.empty(1 << 28, dtype=torch.float32)
    b = torch.empty_like(a)
    a.fill_(1.0)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - start)
    return 2 * a.nbytes / statistics.median(times) / 1e9


def pcie_gb_s() -> float:
    """Pinned host-to-GPU copy rate, the staging ring's ceiling."""
    a = torch.empty(1 << 28, dtype=torch.uint8, pin_memory=True)
    b = torch.empty_like(a, device="cuda")
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        b.copy_(a, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return a.nbytes / statistics.median(times) / 1e9


def generate_s(model: torch.nn.Module, ids: torch.Tensor, tokens: int, cache: StaticCache | None) -> float:
    """Seconds of one greedy generate() into `cache`: one cache (one shape, one address) for every call, so
    no call recompiles or recaptures the decode step (None: generate's own dynamic cache)."""
    if cache is not None:
        cache.reset()
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(
        ids,
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        do_sample=False,
        cache_implementation=None,
        **{ForwardNames(model).cache: cache},  # transformers 5.24 renamed past_key_values to cache
    )
    torch.cuda.synchronize()
    return time.perf_counter() - start


def expert_counts(model: torch.nn.Module) -> tuple[int, int, int]:
    """Activated experts found in slots, not found there, and computed on the CPU (a cost-aware scheduler may send
    a slot's expert to the CPU and fetch a missing one), summed over layers since the last reset."""
    stats = thm.stats(model).values()
    return sum(s.hits for s in stats), sum(s.misses for s in stats), sum(s.cpu_experts for s in stats)


def accelerate_offload(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """transformers + accelerate's CPU offload: routed experts' modules on "cpu" (their weights streamed to
    `device` at every forward), everything else on `device`."""
    from accelerate import dispatch_model

    def is_experts(module: torch.nn.Module) -> bool:
        return type(module).__name__.endswith("Experts")

    def place(module: torch.nn.Module, prefix: str) -> dict[str, object]:
        if is_experts(module):
            return {prefix: "cpu"}
        if not any(is_experts(m) for m in module.modules()):
            return {prefix: device}
        assert not list(module.named_parameters(recurse=False)), prefix  # children cover the whole module
        return {k: v for name, child in module.named_children() for k, v in place(child, f"{prefix}{name}.").items()}

    device_map = {name.rstrip("."): where for name, where in place(model, "").items()}
    return dispatch_model(model, device_map=device_map, main_device=device)


def build(row: dict, config: DeepseekV2Config) -> torch.nn.Module:
    model = random_model(config)
    if row["row"] == "accelerate":
        return accelerate_offload(model, torch.device("cuda", 0))
    if row["row"] == "gpu":
        return model.cuda()
    # one expert shape for every cost the patch measures (placement, staging): the profile simulate reads
    settings = {"expert_shape": "deepseek-v2-lite"} | {k: v for k, v in row.items() if k != "row"}
    return thm.patch_model(model, device="cuda", **settings)


def record(config: DeepseekV2Config, prompt: torch.Tensor, tokens: int, path: Path) -> None:
    """The routing every exact row's decode run follows, recorded on the unpatched model on the GPU (on the CPU
    where there is none: bf16 rounds differently there and may flip a routing decision, so that trace stands in
    for the GPU's), with every row's gate input. The layers' routers go beside it (PATH's stem + `-routers`:
    config.json and the gate weights), for `simulate --routers`: the random model is never saved, and the
    gate-based prefetchers (DALI's, HybriMoE's) replay its routers on those inputs."""
    from safetensors.torch import save_file

    from torch_hybrid_moe.traces import record_trace

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = random_model(config).to(device)
    with torch.no_grad():
        name = f"deepseek-v2-lite-random-{config.num_hidden_layers}l"
        trace = record_trace(model, [prompt[0].to(device)], tokens + 1, name, hidden_every=1)
    trace.save(path)
    routers = path.with_name(path.stem + "-routers")
    routers.mkdir(parents=True, exist_ok=True)
    config.to_json_file(routers / "config.json")
    gates = {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if n.endswith(".mlp.gate.weight")}
    save_file(gates, routers / "routers.safetensors")
    del model
    release()
    print(f"wrote {path} ({device}): {trace.tokens.numel()} token rows x {len(trace.layers)} MoE layers; {routers}")


def measure(row: dict, args: argparse.Namespace, config: DeepseekV2Config, bandwidth: float, pcie: float) -> dict:
    model = build(row, config)
    patched = row["row"] not in ("accelerate", "gpu")
    prompts = [prompt_ids(config, n).cuda() for n in args.prompt]
    short = prompts[0][:, :16]
    # Offloaded models are not auto-compiled by transformers: the others (patched, or all on the GPU) get the static
    # caches that compile them. Decode runs in a cache of its own length (SDPA reads every slot of a static cache,
    # masked or not), the prefills (one token each: no decode step) in one as long as the longest prompt.
    static = row["row"] != "accelerate"
    cache = StaticCache(config=model.config, max_cache_len=max(args.prompt) + 2) if static else None
    decode_cache = StaticCache(config=model.config, max_cache_len=16 + args.tokens + 2) if static else None
    with torch.no_grad():
        generate_s(model, short, args.tokens, decode_cache)  # compile and capture the decode step
        for ids in prompts:  # every prefill shape
            generate_s(model, ids, 1, cache)
        prefill, decode, hits, misses, on_cpu = {n: [] for n in args.prompt}, [], [], [], []
        for _ in range(args.repeats):
            counts = []
            for tokens in (1, args.tokens + 1):
                if patched:
                    thm.reset_stats(model)
                seconds = generate_s(model, short, tokens, decode_cache)
                counts.append((seconds, *(expert_counts(model) if patched else (0, 0, 0))))
            (one, *one_counts), (many, *many_counts) = counts
            decode.append((many - one) / args.tokens)
            for kept, a, b in zip((hits, misses, on_cpu), one_counts, many_counts):
                kept.append(b - a)  # the decode steps' own
            for n, ids in zip(args.prompt, prompts):
                prefill[n].append(n / generate_s(model, ids, 1, cache))
        if args.profile:
            profile(model, short, prompts, args.tokens, (decode_cache, cache), args.profile / label(row))
    expert_bytes = 2 * 3 * config.hidden_size * config.moe_intermediate_size
    # (on-demand fetching computes no expert on the CPU: its bound is PCIe, which this floor does not model)
    cpu_bytes_per_token = statistics.median(on_cpu) / args.tokens * expert_bytes
    all_experts = (config.num_hidden_layers - config.first_k_dense_replace) * config.n_routed_experts * expert_bytes
    del model, cache, decode_cache
    release()
    return {
        **row,
        "decode_tok_s": 1 / statistics.median(decode),
        "prefill_tok_s": {n: statistics.median(p) for n, p in prefill.items()},
        "hit_rate": sum(hits) / max(1, sum(hits) + sum(misses)) if patched else None,
        "cpu_experts_per_token": statistics.median(on_cpu) / args.tokens if patched else None,
        "floor_tok_s": bandwidth * 1e9 / cpu_bytes_per_token if cpu_bytes_per_token else None,
        "prefill_floor_tok_s": {n: n * max(pcie, bandwidth) * 1e9 / all_experts for n in args.prompt},
        # the whole-GPU row's time a token over its layers: `hybrid-moe simulate --dense-us` (an upper estimate of a
        # block's non-MoE time: it includes the routed experts and the head)
        "block_us": 1e6 * statistics.median(decode) / config.num_hidden_layers if row["row"] == "gpu" else None,
    }


def prompt_ids(config: DeepseekV2Config, n: int) -> torch.Tensor:
    """The first n tokens of one seeded random prompt: every row and prompt length starts alike."""
    return torch.randint(3, config.vocab_size, (1, n), generator=torch.Generator().manual_seed(1))


def label(row: dict) -> str:
    """A file-name-safe name for one row's settings (a dict of options as its name=value pairs)."""
    values = [
        "-".join(f"{n}={x}" for n, x in v.items()) if isinstance(v, dict) else f"{v}"
        for k, v in row.items()
        if k != "hardware"
    ]
    return "-".join(values).replace("/", "_")


def profile(
    model: torch.nn.Module,
    short: torch.Tensor,
    prompts: list[torch.Tensor],
    tokens: int,
    caches: tuple[StaticCache | None, StaticCache | None],
    path: Path,
) -> None:
    """Chrome traces of one decode run and of a prefill of each prompt, with the top ops printed: device time for
    decode (graph replays are traced kernel by kernel), host time for prefill (what queues the GPU's work)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    path.parent.mkdir(parents=True, exist_ok=True)
    decode_cache, prefill_cache = caches
    runs = [("decode", short, tokens, "self_device_time_total", decode_cache)]
    runs += [(f"prefill-{p.shape[1]}", p, 1, "self_cpu_time_total", prefill_cache) for p in prompts]
    for what, ids, n, key, cache in runs:
        thm.reset_stats(model)
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            generate_s(model, ids, n, cache)
        prof.export_chrome_trace(f"{path}-{what}.json")
        stats = thm.stats(model).values()
        where = {k: sum(getattr(s, f"{k}_experts") for s in stats) for k in ("accelerator", "cpu", "streamed")}
        print(f"--- {path.name} {what}: {n} token(s); trace {path}-{what}.json; experts in the layers' steps: {where}")
        averages = prof.key_averages()
        print(averages.table(sort_by=key, row_limit=15), flush=True)
        for event in averages:  # the dispatch's named ranges (runtime/layer.py), host time with what they call
            if event.key.startswith("hybrid_moe::") and event.device_type == DeviceType.CPU:
                print(f"{event.key:34s} {event.count:5d} calls {event.cpu_time_total / 1e3:9.2f} ms", flush=True)


def release() -> None:
    """Free the last row's model before the next is built: ~31 GiB of pinned host memory each at full size
    (model and decode graphs reference each other, and compiled code holds the model)."""
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


def stack_file(text: str) -> thm.HybridMoEConfig:
    """--stack-file's config, refused as a usage error where the file cannot be used."""
    try:
        return thm.HybridMoEConfig.from_stack_file(text)
    except InputError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def rows_of(args: argparse.Namespace) -> list[dict]:
    """The settings to measure, in table order."""
    rows = []
    for name in args.rows:
        if name in VARIANTS:
            rows += [
                dict(row=name, expert_budget=b, cuda_graph=g, **VARIANTS[name])
                for b in args.budgets
                for g in args.graph
            ]
        elif name == "all-cpu":
            rows += [  # no slots: the stack decides nothing; named, so that the row is the earlier leases' one
                dict(row=name, expert_budget=0.0, cuda_graph=g, scheduler="cached_on_accelerator", cache_policy="lru")
                for g in args.graph
            ]
        else:
            rows.append(dict(row=name))
    if args.stack_file is not None:
        stack = {k: getattr(args.stack_file, k) for k in (*STACK_FILE_FIELDS, "hardware")}
        rows += [dict(row="tuned", expert_budget=b, cuda_graph=g, **stack) for b in args.budgets for g in args.graph]
    if args.cpu_threads:
        rows = [{**r, "cpu_threads": args.cpu_threads} if r.get("cuda_graph") else r for r in rows]
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked before anything is built (the test suite parses gpu_checks.sh's lines with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=bounded(int, 2), default=27)
    p.add_argument(
        "--budgets", type=bounded(float, 0, 1), nargs="+", default=[0.25, 0.5], help="expert budgets of the hybrid rows"
    )
    p.add_argument("--rows", nargs="*", default=list(ROWS), choices=ROWS, help="none: only --stack-file's rows")
    p.add_argument(
        "--graph",
        nargs="+",
        default=["off", "on"],
        choices=["off", "on"],
        help="decode step uncaptured, as one CUDA graph, or both (rows other than accelerate)",
    )
    p.add_argument("--tokens", type=bounded(int, 1), default=32)
    p.add_argument(
        "--prompt",
        type=bounded(int, 16),
        nargs="+",
        default=[512],
        help="prefill lengths timed (each >= 16: the decode run's prompt is the first 16 tokens)",
    )
    p.add_argument("--repeats", type=bounded(int, 1), default=3)
    p.add_argument("--json", action="store_true", help="also print each row's record as a JSON line when it ends")
    p.add_argument(
        "--trace",
        type=Path,
        metavar="PATH",
        help="first record the routing of the decode run (on the unpatched model) to PATH, and its routers beside it "
        "(without a GPU: only this, on the CPU)",
    )
    p.add_argument(
        "--cpu-threads",
        type=bounded(int, 0),
        default=0,
        help="HybridMoEConfig.cpu_threads of the rows with the "
        "graph on (the only ones that use it; 0: the library's default, torch's thread count)",
    )
    p.add_argument(
        "--stack-file",
        type=stack_file,
        metavar="FILE",
        help="also run the stack this file names (hybrid-moe simulate --save-ours) as the 'tuned' row",
    )
    p.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="also write a decode and a prefill profiler trace per row into DIR and print each one's top ops",
    )
    args = p.parse_args(argv)
    args.graph = [g == "on" for g in args.graph]
    if not args.rows and args.stack_file is None:
        raise SystemExit("--rows names none and no --stack-file gives one: nothing to measure")
    return args


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available() and not args.trace:
        raise SystemExit("gpu_decode.py needs a CUDA GPU (without one it only records --trace)")
    config = lite_config(args.layers)
    if args.trace:
        record(config, prompt_ids(config, 16), args.tokens, args.trace)
        if not torch.cuda.is_available():
            print("no CUDA GPU: the trace only, no rows")
            return
    bandwidth, pcie = host_bandwidth_gb_s(), pcie_gb_s()
    for row in rows_of(args):
        try:
            r = measure(row, args, config, bandwidth, pcie)
        except Exception:
            print(f"\n{row}: failed:\n{traceback.format_exc()}", flush=True)
            r = None
        if r is None:  # released outside the handler: the traceback's frames hold the failed row's model
            release()
            continue
        extra = {k: v for k, v in row.items() if k not in ("row", "cuda_graph")}
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        print(
            f"{row['row']:10s} {extra!s:45s} graph {'on ' if row.get('cuda_graph') else 'off'}  decode "
            f"{r['decode_tok_s']:7.2f} tok/s  prefill "
            + "  ".join(
                f"{n}: {v:8.1f} tok/s ({v / r['prefill_floor_tok_s'][n]:4.0%} of {r['prefill_floor_tok_s'][n]:.0f})"
                for n, v in r["prefill_tok_s"].items()
            )
            + f"  hit {fmt(r['hit_rate'], '.3f')}  CPU experts/token {fmt(r['cpu_experts_per_token'], '.1f')}"
            + f"  floor {fmt(r['floor_tok_s'], '7.2f')} tok/s"
            + (f"  {r['block_us']:.0f} us a layer (simulate --dense-us)" if r["block_us"] else ""),
            flush=True,
        )
        if args.json:
            print(json.dumps(r), flush=True)
    meta = {
        "device": torch.cuda.get_device_name(),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "host_copy_gb_s": round(bandwidth, 1),
        "pcie_gb_s": round(pcie, 1),
        "layers": args.layers,
        "tokens": args.tokens,
        "prompt": args.prompt,
        "repeats": args.repeats,
    }
    if args.json:
        print(json.dumps({"meta": meta}))
    print(meta)


if __name__ == "__main__":
    main()
