"""Decode and prefill throughput on a GPU: the hybrid path with its decode step as one CUDA graph, against the
same path uncaptured and against the all-experts-on-CPU layout, side by side in one run, with a physical floor.

The model is DeepSeek-V2-Lite-shaped with random bf16 weights at full size by default (27 layers, 64 routed
experts of 2048 x 1408, top-6, 2 shared experts, MLA attention; ~16 B parameters, ~31 GiB in host memory).
Each setting patches a freshly built model (patching moves its experts into pinned host memory), warms up
(compilation, graph capture), then times generate(): prefill = the prompt's tokens over the time of a
1-token generate; decode = the extra tokens over the extra time of a longer generate. Medians of --repeats.
The floor is the time to stream the experts the CPU computed per token (measured misses) at the host's
measured copy rate (bytes read plus written, an upper bound on what reads alone reach): a ceiling on tok/s for
any layout that computes those experts on this CPU.

    python benchmarks/gpu_decode.py [--layers 27] [--budgets 0.25 0.5] [--tokens 32] [--prompt 512] [--json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, DeepseekV2Config, StaticCache

import torch_hybrid_moe as thm


def lite_config(layers: int) -> DeepseekV2Config:
    """DeepSeek-V2-Lite's published shape."""
    return DeepseekV2Config(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
        n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, head_dim=64, topk_method="greedy",
        n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False, max_position_embeddings=4096,
    )


def random_model(config: DeepseekV2Config) -> torch.nn.Module:
    """bf16 weights drawn cheaply: every tensor is filled from one random pool at its own offset."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    pool = torch.randn(1 << 24, dtype=torch.bfloat16) * 0.02
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


def generate_s(model: torch.nn.Module, ids: torch.Tensor, tokens: int, cache: StaticCache) -> float:
    """Seconds of one greedy generate() into `cache`: one cache (one shape, one address) for every call, so
    no call recompiles or recaptures the decode step."""
    cache.reset()
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, past_key_values=cache,
                   cache_implementation=None)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def expert_counts(model: torch.nn.Module) -> tuple[int, int]:
    """Activated experts found in slots and computed on the CPU, summed over layers since the last reset."""
    stats = thm.stats(model).values()
    return sum(s.hits for s in stats), sum(s.misses for s in stats)


def measure(setting: dict, args: argparse.Namespace, config: DeepseekV2Config, bandwidth: float) -> dict:
    model = thm.patch_model(random_model(config), device="cuda", **setting)
    prompt = torch.randint(3, config.vocab_size, (1, args.prompt), device="cuda")
    short = prompt[:, :16]
    cache = StaticCache(config=model.config, max_cache_len=args.prompt + args.tokens + 2)
    with torch.no_grad():
        generate_s(model, short, args.tokens, cache)  # compile and capture
        prefill, decode, hits, misses = [], [], [], []
        for _ in range(args.repeats):
            thm.reset_stats(model)
            one = generate_s(model, short, 1, cache)
            one_hits, one_misses = expert_counts(model)
            thm.reset_stats(model)
            many = generate_s(model, short, args.tokens + 1, cache)
            many_hits, many_misses = expert_counts(model)
            decode.append((many - one) / args.tokens)
            hits.append(many_hits - one_hits)
            misses.append(many_misses - one_misses)  # the decode steps' experts computed on the CPU
            prefill.append(args.prompt / generate_s(model, prompt, 1, cache))
    expert_bytes = next(iter(thm.runtime.model_layers(model).values())).store.expert_bytes
    cpu_bytes_per_token = statistics.median(misses) / args.tokens * expert_bytes
    hit_rate = sum(hits) / max(1, sum(hits) + sum(misses))
    del model
    torch.cuda.empty_cache()
    return {
        **setting, "decode_tok_s": 1 / statistics.median(decode), "prefill_tok_s": statistics.median(prefill),
        "hit_rate": hit_rate,
        "floor_tok_s": bandwidth * 1e9 / cpu_bytes_per_token if cpu_bytes_per_token else float("inf"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=27)
    p.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.5, 0.0],
                   help="expert budgets; 0 is the all-routed-experts-on-CPU layout (Fiddler / KTransformers)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_decode.py needs a CUDA GPU")
    config = lite_config(args.layers)
    bandwidth = host_bandwidth_gb_s()
    settings = [dict(expert_budget=budget, cuda_graph=graph) for budget in args.budgets for graph in (False, True)]
    rows = []
    for setting in settings:
        row = measure(setting, args, config, bandwidth)
        rows.append(row)
        print(f"budget {row['expert_budget']:.2f} graph {'on ' if row['cuda_graph'] else 'off'}  decode "
              f"{row['decode_tok_s']:7.2f} tok/s  prefill {row['prefill_tok_s']:8.1f} tok/s  hit {row['hit_rate']:.3f}"
              f"  floor {row['floor_tok_s']:7.2f} tok/s", flush=True)
    meta = {"device": torch.cuda.get_device_name(), "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "host_copy_gb_s": round(bandwidth, 1), "layers": args.layers}
    if args.json:
        print(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(meta)


if __name__ == "__main__":
    main()
