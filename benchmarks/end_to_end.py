"""End-to-end decode and prefill on one CPU, side by side on the same weights: ours, unpatched transformers
(eager and Inductor) and llama.cpp, interleaved and repeated; medians with spread, peak RSS, greedy-token
agreement with transformers, and the memory floor of a decode token. Ours generates with `thm.greedy_generate` (the
package's greedy loop: generate()'s tokens, less its per-token Python), transformers with `generate()`.

Checkpoints are generated once (random bf16 weights at a real model's layer shape, `save_pretrained`, the
embedded tokenizer) under --cache. llama.cpp rows need a llama.cpp source tree built with CMake (--llama-cpp,
holding build/bin/llama-bench and build/bin/llama-quantize; `pip download --no-deps --no-binary :all:
llama-cpp-python` gives one under vendor/llama.cpp) and the `gguf` package; without them those rows are
skipped and said so. On CPUs with AMX, build it with -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
(and the AVX-512 options named: benchmarks/RESULTS.md, 2026-11-26): the 0.3.36 source's AMX path died with SIGILL on
q8_0 / q4_0 there. Each measurement runs in a fresh process, so peak RSS is that row's alone.

    python benchmarks/end_to_end.py --shape qwen3-30b-a3b --layers 4 --rows ours,ours-int8,eager,llama-bf16
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from torch_hybrid_moe.cli import bounded, writable

ROWS = (
    "ours",
    "ours-sdpa",
    "ours-int8",
    "ours-int4",
    "ours-int8-dense",
    "ours-int4-dense",
    "ours-b0.25",
    "eager",
    "inductor",
    "llama-bf16",
    "llama-q8_0",
    "llama-q4_0",
    "llama-q4_0-pure",
)
SHAPES = {  # (transformers config class, its arguments per layer shape); vocabularies are the real models'
    "qwen3-30b-a3b": (
        "Qwen3MoeConfig",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
    ),
    # the first layer a dense MLP, as the real model's (first_k_dense_replace); queries through DeepSeek-V2's LoRA of
    # rank 1536 (Lite's have none: +1.5M weights a layer), since llama.cpp reads a deepseek2 model of other than 26
    # or 27 layers as the full V2 and refuses one without it
    "deepseek-v2-lite": (
        "DeepseekV2Config",
        dict(
            vocab_size=102400,
            hidden_size=2048,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            num_attention_heads=16,
            num_key_value_heads=16,
            first_k_dense_replace=1,
            n_routed_experts=64,
            n_shared_experts=2,
            num_experts_per_tok=6,
            kv_lora_rank=512,
            q_lora_rank=1536,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            topk_method="greedy",
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
    ),
    "mixtral-8x7b": (
        "MixtralConfig",
        dict(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_local_experts=8,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        ),
    ),
}


def checkpoint(shape: str, layers: int, cache: Path) -> Path:
    """The generated checkpoint for (shape, layers), made on first use."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from torch_hybrid_moe.embedded import embedded_models

    path = cache / f"{shape}-{layers}l"
    if path.exists():
        return path
    cls, kwargs = SHAPES[shape]
    config = getattr(transformers, cls)(**kwargs, num_hidden_layers=layers, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
    partial = path.with_name(path.name + ".partial")  # renamed when whole: an interrupted save is never reused
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    AutoTokenizer.from_pretrained(embedded_models()["deepseek-tiny"]).save_pretrained(partial)
    partial.rename(path)
    return path


BYTES_PER_WEIGHT = {"bf16": 2.0, "int8": 34 / 32, "int4": 18 / 32}  # an fp16 scale per 32: ours, q8_0 and q4_0


def decode_bytes(path: Path, row: str = "ours") -> float:
    """Bytes one decode token of `row` reads: every weight but the embedding table (a row of it), routed experts
    counted top-k of E. Ours: in the row's weight type (int8 / int4 rows: experts, and the dense linears where
    quantised; routers and norms stay bf16). llama.cpp rows: each tensor's own bytes in the row's GGUF file, since
    llama-quantize keeps some in other types (q4_0 files: the LM head as Q6_K, the routers in F32)."""
    config = json.loads((path / "config.json").read_text())
    experts = config.get("num_experts") or config.get("num_local_experts") or config["n_routed_experts"]
    share = config["num_experts_per_tok"] / experts
    if row.startswith("llama-"):
        import gguf

        reader = gguf.GGUFReader(path / f"model-{row.removeprefix('llama-')}.gguf")
        read = [t for t in reader.tensors if t.name != "token_embd.weight"]
        return sum(int(t.n_bytes) * (share if "_exps" in t.name else 1) for t in read)
    from safetensors import safe_open

    kind = next((k for k in ("int8", "int4") if k in row), "bf16")
    dense_kind = kind if row.endswith("-dense") else "bf16"
    total = 0.0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                if "embed_tokens" in name:
                    continue
                shape = f.get_slice(name).get_shape()
                weights = math.prod(shape)
                if ".experts." in name:
                    total += weights * BYTES_PER_WEIGHT[kind] * share
                else:  # routers (mlp.gate / block_sparse_moe.gate) are no nn.Linear: never quantised
                    linear = len(shape) == 2 and not name.endswith(".gate.weight")
                    total += weights * (BYTES_PER_WEIGHT[dense_kind] if linear else 2.0)
    return total


def read_bandwidth(threads: int) -> float:
    """GB/s of a summing pass over 1 GiB with `threads` threads, best of 5."""
    import torch

    torch.set_num_threads(threads)
    a = torch.ones(2**28)
    best = min(_timed(a.sum) for _ in range(5))
    return a.nbytes / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_torch_row(row: str, path: Path, prompt: int, tokens: int, threads: int) -> dict:
    """One measurement of a transformers-based row in this process: prefill tok/s at `prompt` tokens, decode
    tok/s over `tokens` new tokens, and the greedy tokens."""
    import torch
    from transformers import AutoModelForCausalLM, CompileConfig

    import torch_hybrid_moe as thm

    torch.set_num_threads(threads)
    gen = dict(do_sample=False)
    if row.startswith("ours"):
        # ours-int8: int8 routed experts; ours-int8-dense: every linear int8 too, like llama.cpp's q8_0 files.
        # Experts stream from the checkpoint into the store (thm.from_pretrained): no second resident copy.
        dtype = next((d for d in ("int8", "int4") if d in row), "model")
        budget = 0.25 if row == "ours-b0.25" else 0.0
        model = thm.from_pretrained(
            path,
            thm.HybridMoEConfig(
                expert_budget=budget,
                cpu_weight_dtype=dtype,
                dense_weight_dtype=dtype if row.endswith("-dense") else "model",
            ),
            dtype=torch.bfloat16,
        )
        if row == "ours-sdpa":  # ours with torch's SDPA for decode attention too (model_patches/cpu_attention.py)
            model.config._attn_implementation = "sdpa"
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    if row == "inductor":
        gen["cache_implementation"] = "static"
        config = CompileConfig(fullgraph=True, mode="default")
        config._compile_all_devices = True
        model.generation_config.compile_config = config
    ids = torch.randint(100, 2000, (1, prompt), generator=torch.Generator().manual_seed(prompt))
    gen.update(max_new_tokens=tokens)  # one static-cache size: warm-up compiles for it
    model.generation_config.eos_token_id = None  # every row makes all its tokens, with no per-step work for it

    def run(**kw: object) -> torch.Tensor:
        if row.startswith("ours"):  # greedy tokens as the package gives them (generate()'s)
            return thm.greedy_generate(model, ids, tokens, **kw)
        return model.generate(ids, **gen, **kw)

    with torch.no_grad():
        run()
        stamps = _Stamps()
        start = time.perf_counter()
        out = run(streamer=stamps)
    times = stamps.times  # the prompt's push, then one per new token: the first ends prefill
    return dict(
        prefill_tok_s=prompt / (times[1] - start),
        decode_tok_s=(len(times) - 2) / (times[-1] - times[1]),
        tokens=out[0, prompt:].tolist(),
    )


class _Stamps:
    """A generate() streamer that only timestamps each push."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: object) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_llama_row(row: str, path: Path, prompt: int, tokens: int, threads: int, llama: Path) -> dict:
    """One llama-bench measurement of the GGUF of `path` in the row's weight type: the prompt from an empty
    context, then the new tokens after `prompt` tokens of context (--n-depth), as ours and transformers decode."""
    gguf = gguf_file(path, row.removeprefix("llama-"), llama)

    def bench(p: int, n: int, depth: int) -> float:
        argv = ["-m", str(gguf), "-t", str(threads), "-p", str(p), "-n", str(n), "-d", str(depth), "-r", "1"]
        out = subprocess.run(
            [str(llama / "build" / "bin" / "llama-bench"), *argv, "-o", "json"],
            capture_output=True,
            text=True,
            check=True,
        )
        (test,) = json.loads(out.stdout)
        return test["avg_ts"]

    return dict(prefill_tok_s=bench(prompt, 0, 0), decode_tok_s=bench(0, tokens, prompt), tokens=None)


def gguf_file(path: Path, kind: str, llama: Path) -> Path:
    """The checkpoint converted to GGUF (bf16, q8_0 by the converter; q4_0 by llama-quantize from bf16, which keeps
    the LM head in Q6_K; q4_0-pure: every quantisable tensor in q4_0, as ours-int4-dense)."""
    target = path / f"model-{kind}.gguf"
    partial = target.with_suffix(".partial")  # renamed when whole: an interrupted conversion is never reused
    if target.exists():
        return target
    if kind.startswith("q4_0"):
        pure = ["--pure"] if kind.endswith("-pure") else []
        source = str(gguf_file(path, "bf16", llama))
        subprocess.run(
            [str(llama / "build" / "bin" / "llama-quantize"), *pure, source, str(partial), "q4_0"],
            check=True,
            capture_output=True,
        )
        return partial.rename(target)
    # The embedded tokenizer's pre-tokenizer is unknown to the converter: treat it as GPT-2's (byte-level BPE). Its
    # Llama-family models (Mixtral) try a SentencePiece tokenizer.model first and fall back on FileNotFoundError, but
    # import sentencepiece before looking for the file: without the package that is an ImportError, not the fallback.
    code = (
        "import sys, runpy; sys.path.insert(0, sys.argv[1] + '/gguf-py'); sys.path.insert(0, sys.argv[1]);"
        "import conversion.base as b; orig = b.TextModel.get_vocab_base_pre\n"
        "def pre(self, tok):\n"
        "    try: return orig(self, tok)\n"
        "    except NotImplementedError: return 'gpt-2'\n"
        "sp = b.TextModel._create_vocab_sentencepiece\n"
        "def spm(self):\n"
        "    if not (self.dir_model / 'tokenizer.model').is_file(): raise FileNotFoundError('no tokenizer.model')\n"
        "    return sp(self)\n"
        "b.TextModel.get_vocab_base_pre = pre; b.TextModel._create_vocab_sentencepiece = spm;"
        "sys.argv = sys.argv[1:2] + sys.argv[2:];"
        "runpy.run_path(sys.argv[0] + '/convert_hf_to_gguf.py', run_name='__main__')"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(llama), str(path), "--outtype", kind, "--outfile", str(partial)],
        check=True,
        capture_output=True,
    )
    return partial.rename(target)


def converted(rows: list[str], path: Path, llama: Path | None) -> list[str]:
    """`rows` less the llama.cpp rows whose GGUF file this llama.cpp fails to make (each said in one line): the
    other rows still run."""
    kept = []
    for row in rows:
        try:
            if row.startswith("llama-"):
                assert llama is not None  # main() drops llama.cpp rows without a source tree
                gguf_file(path, row.removeprefix("llama-"), llama)
            kept.append(row)
        except subprocess.CalledProcessError as err:
            said = (err.stderr or b"").decode(errors="replace").strip().splitlines()
            print(f"{row} skipped: its GGUF conversion failed: {said[-1] if said else f'exit {err.returncode}'}")
    return kept


def own_kib(field: str) -> int:
    """A memory figure of this process from /proc/self/status (VmRSS now, VmHWM its peak), in KiB. VmHWM is the
    process's own: ru_maxrss would carry over the peak of the parent that started it."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(args: argparse.Namespace) -> None:
    """Measure one row once and print its record as JSON (peak RSS of this process and its children)."""
    path = Path(args.child_path)
    if args.child.startswith("llama-"):
        record = run_llama_row(args.child, path, args.prompt, args.tokens, args.threads, args.llama_cpp)
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    else:
        record = run_torch_row(args.child, path, args.prompt, args.tokens, args.threads)
        record["triton_imported"] = "triton" in sys.modules  # see `report`'s note on peak RSS
        peak = own_kib("VmHWM")
    print(json.dumps({**record, "peak_rss_gb": peak * 1024 / 1e9}))


def common_prefix(tokens: list[int], reference: list[int]) -> int:
    """How many leading tokens agree: after the first difference each run continues its own context, and later
    matches are chance."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


def llama_ready(llama: Path | None) -> str:
    """Why llama.cpp rows cannot run, or ""."""
    if llama is None:
        return "no --llama-cpp source tree given"
    missing = [b for b in ("llama-bench", "llama-quantize") if not (llama / "build" / "bin" / b).exists()]
    if missing:
        return f"{llama}/build/bin lacks {', '.join(missing)} (cmake --build build --target llama-bench llama-quantize)"
    try:
        import gguf  # noqa: F401
    except ImportError:
        return "the gguf package is not installed (pip install gguf)"
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=bounded(int, 1), default=4)
    parser.add_argument("--rows", default="ours,ours-int8,ours-int4,eager,inductor,llama-bf16,llama-q8_0,llama-q4_0")
    parser.add_argument("--prompt", type=bounded(int, 1), default=128)
    parser.add_argument("--tokens", type=bounded(int, 2), default=32)
    parser.add_argument("--repeats", type=bounded(int, 1), default=3)
    parser.add_argument("--threads", type=bounded(int, 1), default=2)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "torch_hybrid_moe" / "checkpoints")
    parser.add_argument("--llama-cpp", type=Path, help="llama.cpp source tree with a CMake build/ directory")
    parser.add_argument("--json", type=writable, help="also write every record here (a new file)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    rows = args.rows.split(",")
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    if len(set(rows)) < len(rows):  # a row named twice would be measured twice a round and pooled
        parser.error(f"--rows names {sorted({r for r in rows if rows.count(r) > 1})} more than once")
    why = llama_ready(args.llama_cpp)
    if why and any(r.startswith("llama-") for r in rows):
        rows = [r for r in rows if not r.startswith("llama-")]
        if not rows:
            parser.error(f"no row left to run: llama.cpp's need what is missing: {why}")
        print(f"llama.cpp rows skipped: {why}")
    path = checkpoint(args.shape, args.layers, args.cache)
    rows = converted(rows, path, args.llama_cpp)  # before timing anything: a converter's memory is no row's
    if not rows:
        parser.error("no row left to run: each GGUF conversion failed (said above); add a row of ours or eager")
    records: dict[str, list[dict]] = {r: [] for r in rows}
    for _ in range(args.repeats):  # interleaved: each round measures every row once
        for row in rows:
            cmd = [
                sys.executable,
                __file__,
                "--child",
                row,
                "--child-path",
                str(path),
                "--prompt",
                str(args.prompt),
                "--tokens",
                str(args.tokens),
                "--threads",
                str(args.threads),
            ]
            if args.llama_cpp:
                cmd += ["--llama-cpp", str(args.llama_cpp)]
            before = read_bandwidth(args.threads)
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
                print(f"{row}: failed: {last}")
                continue
            # the read bandwidth of this moment, on both sides of the measurement: another tenant's load comes and goes
            # (with a read after it alone, one run's rounds came to 48-124% of the floor, the VM's read at 33-75 GB/s)
            after = read_bandwidth(args.threads)
            records[row].append(
                {
                    **json.loads(done.stdout.strip().splitlines()[-1]),
                    "bandwidth_gb_s": (before + after) / 2,
                    "bandwidth_reads_gb_s": [before, after],
                }
            )
    floor_gb = decode_bytes(path) / 1e9
    reads = [r["bandwidth_gb_s"] for recs in records.values() for r in recs]
    bandwidth = statistics.median(reads) if reads else read_bandwidth(args.threads)
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    flags = sorted(
        {
            f
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
            for f in line.split()
            if f.startswith(("avx", "amx"))
        }
    )
    print(
        f"{args.shape}, {args.layers} layers, bf16 checkpoint {path}; {cpu} ({' '.join(flags)}), {args.threads} "
        f"threads; prompt {args.prompt}, {args.tokens} new tokens; medians of {args.repeats} [min-max]; "
        f"{time.strftime('%Y-%m-%d')}"
    )
    print(
        f"decode floor: {floor_gb:.3f} GB per token at {bandwidth:.1f} GB/s read (median over the measurements of the "
        f"mean of the reads taken right before and after each) = {bandwidth / floor_gb:.1f} tok/s (bf16 weights); "
        "'% floor': each decode rate over the floor of its row's weight type at its own mean read"
    )
    if any(r.get("triton_imported") for rs in records.values() for r in rs):
        print(
            "peak RSS: this Python has triton installed (the test extra), which torch's Dynamo imports: ~75 MB in "
            "the torch rows that a plain `pip install -e .` does not hold (benchmarks/RESULTS.md, 2026-12-01)"
        )
    reference = next((r["tokens"] for r in records.get("eager", []) if r["tokens"]), None)
    print(
        "'eager prefix': how many of the first new tokens equal unpatched eager transformers' (greedy); after the "
        "first difference the two continue from different contexts"
    )
    print(
        f"{'row':<12} {'decode tok/s':>22} {'% floor':>8} {'prefill tok/s':>22} {'peak RSS GB':>11} "
        f"{'eager prefix':>14}"
    )
    per_row: dict[str, dict] = {}
    for row, recs in records.items():
        if not recs:
            continue
        cells = []
        for key in ("decode_tok_s", "prefill_tok_s", "peak_rss_gb"):
            values = [r[key] for r in recs]
            cells.append(f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]")
        row_gb = decode_bytes(path, row) / 1e9
        floor = statistics.median(100 * r["decode_tok_s"] * row_gb / r["bandwidth_gb_s"] for r in recs)
        prefix = None if reference is None or recs[0]["tokens"] is None else common_prefix(recs[0]["tokens"], reference)
        agree = "-" if prefix is None else f"{prefix}/{len(reference)}"
        per_row[row] = {"row_gb": row_gb, "pct_floor": floor, "eager_prefix": prefix}
        print(f"{row:<12} {cells[0]:>22} {floor:>8.0f} {cells[1]:>22} {cells[2]:>11} {agree:>14}")
    if args.json:
        args.json.write_text(
            json.dumps(
                dict(
                    shape=args.shape,
                    layers=args.layers,
                    cpu=cpu,
                    flags=flags,
                    threads=args.threads,
                    floor_gb=floor_gb,
                    bandwidth_gb_s=bandwidth,
                    rows=per_row,
                    records=records,
                ),
                indent=1,
            )
        )


if __name__ == "__main__":
    sys.exit(main())
