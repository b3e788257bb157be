"""Every CLI door with bad input: one line on stderr that says what is wrong, exit status 2, no table printed,
nothing computed; and a bad profile cache is measured again with a warning naming it."""

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import torch_hybrid_moe.embedded
from torch_hybrid_moe import profiling
from torch_hybrid_moe.cli import main
from torch_hybrid_moe.cost_model import EXPERT_SHAPES, HARDWARE, CostModel
from torch_hybrid_moe.embedded import resolve_model
from torch_hybrid_moe.errors import InputError
from torch_hybrid_moe.simulator import STACKS, simulate
from torch_hybrid_moe.simulator.stacks import PAPERS
from torch_hybrid_moe.simulator.synthetic import synthetic_trace
from torch_hybrid_moe.traces import Trace

from .conftest import stack_file

TRACE = Path(torch_hybrid_moe.embedded.__file__).parent / "traces" / "mixtral-tiny-heldout-at0.safetensors"
DEEPSEEK_TRACE = TRACE.with_name("deepseek-tiny-heldout-at0.safetensors")


def one_line_error(capsys, argv, match):
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's usage errors
        code = exit_.code
    out, err = capsys.readouterr()
    assert code == 2 and not out, (code, out)
    lines = [line for line in err.splitlines() if "error" in line]  # progress bars may come before it
    assert len(lines) == 1 and "Traceback" not in err, err
    assert match in lines[0], lines[0]


def edited_trace(tmp_path, edit):
    """The embedded trace with `edit(tensors, meta)` applied, saved as a new file."""
    from safetensors import safe_open

    with safe_open(str(TRACE), "pt") as f:
        meta = json.loads(f.metadata()["hybrid_moe_trace"])
    tensors = load_file(str(TRACE))
    edit(tensors, meta)
    path = tmp_path / "edited.safetensors"
    save_file(tensors, str(path), metadata={"hybrid_moe_trace": json.dumps(meta)})
    return path


def nan_at(name):
    def edit(tensors, meta):
        tensors[name] = tensors[name].clone()
        tensors[name][3, 0] = math.nan

    return edit


TRACE_EDITS = {
    "nan scores": (nan_at("L0.scores"), "L0.scores holds NaN"),
    "nan gate inputs": (nan_at("L1.hidden"), "L1.hidden holds NaN"),
    "huge num_experts": (lambda t, m: m.update(num_experts=10**9), "'num_experts' must be an int in [1, 32768]"),
    "num_experts below the ids": (lambda t, m: m.update(num_experts=4), "outside [0, num_experts=4)"),
    "id out of range": (lambda t, m: t["L2.topk_ids"].__setitem__((0, 0), 99), "L2.topk_ids holds expert ids"),
    "missing tensor": (lambda t, m: t.pop("L3.scores"), "'L3.scores' is missing"),
    "rows disagree": (lambda t, m: t.__setitem__("step", t["step"][:-1].clone()), "step must be an integer tensor"),
    "scores not probabilities": (lambda t, m: t["L0.scores"].mul_(3), "router probabilities in [0, 1]"),
    "layers not a list": (lambda t, m: m.update(layers="0,1"), "'layers' must be a non-empty list"),
    "layers out of order": (lambda t, m: m.update(layers=m["layers"][::-1]), "decoder indices in ascending order"),
    "an expert twice in a row": (
        lambda t, m: t["L1.topk_ids"][0].fill_(int(t["L1.topk_ids"][0, 0])),
        "L1.topk_ids lists an expert twice in one row",
    ),
    "prefill counted as a decode step": (lambda t, m: t["step"].add_(1), "has two rows for one decode step"),
    "steps reversed": (lambda t, m: t["step"].copy_(t["step"].max() - t["step"]), "goes back a step"),
    "a decode step twice": (
        lambda t, m: t["step"].copy_(torch.where(t["step"] == 2, 1, t["step"])),
        "has two rows for one decode step",
    ),
    "positions repeat": (lambda t, m: t["position"].zero_(), "has two rows at one position"),
    "gate-input rows repeat": (
        lambda t, m: [t[f"L{i}.hidden_rows"].__setitem__(1, 0) for i in m["layers"]],
        "hidden_rows must be ascending without repeats",
    ),
    "gate-input rows differ": (
        lambda t, m: t.update(
            {"L2.hidden_rows": t["L2.hidden_rows"][:1].clone(), "L2.hidden": t["L2.hidden"][:1].clone()}
        ),
        "L2.hidden_rows differ from the first layer's",
    ),
}


def test_saving_ours_with_prefetch_is_refused_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "ours.json"
    argv = ["simulate", "--trace", str(TRACE), "--ours", "4,1,0.5,1", "--save-ours", str(out)]
    one_line_error(capsys, argv, "give --ours W,U,DECAY,0")
    assert not out.exists()


def test_no_command_writes_over_an_existing_file(tmp_path, capsys):
    """Outputs are new files: an existing one (the command's own input, another run's result) is refused before
    any work, and keeps its bytes (convert-trace turned its JSONL input into safetensors; trace and --save-ours
    overwrote what was there)."""
    copy = tmp_path / "trace.safetensors"
    copy.write_bytes(TRACE.read_bytes())
    jsonl = tmp_path / "routing.jsonl"
    jsonl.write_text('{"seq": 0, "step": 0, "pos": 0, "ids": {"0": [1, 2]}, "weights": {"0": [0.6, 0.4]}}\n')
    before = jsonl.read_bytes()
    for argv in (
        ["simulate", "--trace", str(copy), "--save-ours", str(copy)],
        ["convert-trace", "--jsonl", str(jsonl), "--num-experts", "8", "--out", str(jsonl)],
        ["trace", "--out", str(copy)],
    ):
        one_line_error(capsys, argv, f"{argv[-1]} exists; remove it or give another name")
    assert copy.read_bytes() == TRACE.read_bytes() and jsonl.read_bytes() == before


@pytest.mark.parametrize("keep, steps", [("prefill", 0), ("one decode step", 1)])
def test_simulate_refuses_a_trace_with_too_few_decode_steps(keep, steps, tmp_path, capsys):
    trace = Trace.load(TRACE)
    short = trace.select(trace.step <= (0 if keep == "prefill" else 1))
    short.save(tmp_path / "short.safetensors")
    argv = ["simulate", "--trace", str(tmp_path / "short.safetensors")]
    one_line_error(capsys, argv, f"holds {steps} decode steps; simulate needs at least 2")


@pytest.mark.parametrize("spec, match", [("0,1,0.5,0", "w_size"), ("4,1,1.0,0", "decay"), ("4,1,0.5,-1", ">= 0")])
def test_ours_settings_are_checked_before_anything_runs(spec, match, tmp_path, capsys):
    out = tmp_path / "ours.json"
    one_line_error(capsys, ["simulate", "--trace", str(TRACE), "--ours", spec, "--save-ours", str(out)], match)
    assert not out.exists()


def test_generate_with_an_unusable_stack_file_is_one_line(tmp_path, capsys):
    missing = tmp_path / "none.json"
    argv = ["generate", "--stack", str(missing), "--expert-budget", "0.25"]
    one_line_error(capsys, argv, f"stack file {missing}: cannot read it")
    # CPU's default budget 0: no slots for the stack's placement and cache to act on, so it would do nothing
    one_line_error(capsys, ["generate", "--stack", str(stack_file(tmp_path))], "expert_budget 0.0 gives none")


@pytest.mark.parametrize("case", list(TRACE_EDITS))
def test_simulate_refuses_a_malformed_trace(case, tmp_path, capsys):
    edit, match = TRACE_EDITS[case]
    path = edited_trace(tmp_path, edit)
    one_line_error(capsys, ["simulate", "--trace", str(path)], f"{path}: ")
    one_line_error(capsys, ["simulate", "--trace", str(path)], match)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["simulate", "--trace", "{tmp}"], "is a directory, not a trace file"),
        (["simulate", "--trace", "{tmp}/nothing.safetensors"], "no such file"),
        (["simulate", "--trace", "{json}"], "is not a safetensors trace file"),
        (["simulate", "--trace", str(TRACE), "--batch", "-3"], "--batch: must be >= 1, got -3"),
        (["simulate", "--trace", str(TRACE), "--cache-ratio", "1.5"], "--cache-ratio: must be in [0.0, 1.0], got 1.5"),
        (["simulate", "--trace", str(TRACE), "--cache-ratio", "nan"], "--cache-ratio: must be in [0.0, 1.0]"),
        (["simulate", "--trace", str(TRACE), "--plot-dir", "{json}"], "is not a writable directory"),
        (["simulate", "--trace", str(TRACE), "--dense-us", "-1"], "--dense-us: must be in [0.0, 1000000.0], got -1"),
        (["simulate", "--trace", str(TRACE), "--dense-us", "inf"], "--dense-us: must be in [0.0, 1000000.0], got inf"),
        (["simulate", "--trace", str(TRACE), "--dense-us", "1e308"], "--dense-us: must be in"),
        (["simulate", "--trace", str(TRACE), "--graph", "--cpu-task-us", "inf"], "--cpu-task-us: must be in"),
        (["simulate", "--trace", str(TRACE), "--routers", "{tmp}"], "prefetchers replay: model directory"),
        (["simulate", "--trace", str(TRACE), "--stack", "lru"], "expected SCHEDULER,CACHE[,PREFETCHER]"),
        (["simulate", "--trace", str(TRACE), "--cpu-task-us", "30"], "price the captured decode step: add --graph"),
        (["simulate", "--trace", str(TRACE), "--graph", "--graph-fill-us", "-2"], "--graph-fill-us: must be in [0"),
        (["simulate", "--trace", str(TRACE), "--stack", "dali_greedy,nope"], "unknown cache policy 'nope'"),
        (["trace", "--out", "{tmp}/missing/dir/t.safetensors"], "cannot write"),
        (["trace", "--out", "{tmp}"], "is a directory; give a file name"),
        (["trace", "--out", "{tmp}/t.safetensors", "--prompts", "0"], "--prompts: must be >= 1, got 0"),
        (["trace", "--out", "{tmp}/t.safetensors", "--max-new-tokens", "2"], "--max-new-tokens: must be >= 3"),
        (["trace", "--out", "{tmp}/t.safetensors", "--prompts", "1000", "--prompt-tokens", "1000"], "too few"),
        (
            ["trace", "--out", "{tmp}/t.safetensors", "--prompts", "1", "--prompt-tokens", "1000"],
            "--prompt-tokens 1000 + --max-new-tokens 64 exceed the model's 1024 positions",
        ),
        (["eval-ppl", "--max-tokens", "-5"], "--max-tokens: must be >= 1, got -5"),
        # a minus before a unit was taken for an unknown option: "expected one argument"
        (["plan", "--gpu-memory", "-1GiB"], "--gpu-memory: '-1GiB': a size cannot be negative"),
        (["plan", "--host-memory", "-.5GiB"], "--host-memory: '-.5GiB': a size cannot be negative"),
        (["eval-ppl", "--max-tokens", "16"], "perplexity is measured in windows of 256 tokens"),
        (["eval-ppl", "--mode", "daop_precalc", "--precalc-from-layer", "9"], "approximates nothing in this model"),
        (["generate", "--prompt", ""], "--prompt: must not be empty"),
        (["generate", "--max-new-tokens", "1"], "--max-new-tokens: must be >= 2"),
        (["generate", "--expert-budget", "2"], "--expert-budget: must be in [0.0, 1.0]"),
        (["generate", "--model", "{tmp}/no/such/model"], "not an embedded model"),
        (["generate", "--model", "{json}"], "is a file; pass the checkpoint's directory"),
        (["eval-ppl", "--model", ""], "the model name is empty"),
        (["plan", "--model", " "], "the model name is empty"),
        (["generate", "--model", "{tmp}"], "has no config.json"),
        (["generate", "--model", "tiny:llama"], "unknown tiny model 'llama'"),
        (["generate", "--cpu-weight-group-size", "0"], "--cpu-weight-group-size: must be >= 32"),
        (
            ["generate", "--cpu-weight-dtype", "int8", "--cpu-weight-group-size", "48"],
            "cpu_weight_group_size must be a positive multiple of 32",
        ),
        # a group where nothing is int8 / int4 would group nothing
        (["generate", "--cpu-weight-group-size", "32"], "--cpu-weight-group-size 32 groups int8 / int4 weights"),
        (["eval-ppl", "--cpu-weight-dtype", "bfloat16", "--cpu-weight-group-size", "32"], "and none are asked for"),
        (
            ["prepare", "--model", "deepseek-tiny", "--cpu-weight-dtype", "bfloat16", "--cpu-weight-group-size", "32"]
            + ["--out", "{tmp}/s"],
            "--cpu-weight-group-size 32 groups int8 / int4 weights",
        ),
        (["generate", "--model", "tiny:mixtral", "--cpu-weight-dtype", "int8"], "experts.down_proj"),
        (["eval-ppl", "--model", "tiny:mixtral"], "needs a model with a tokenizer"),
        (["simulate", "--trace", str(TRACE), "--batch", "999"], "--batch 999: "),
        (["simulate", "--trace", str(TRACE), "--ours", "2,1,0.5,99"], "--ours: prefetch 99 experts a layer"),
        (["prepare", "--model", "deepseek-tiny", "--cpu-weight-dtype", "int8", "--out", "{json}/s"], "is a file"),
        (["simulate", "--trace", str(TRACE), "--calibration", str(DEEPSEEK_TRACE)], "must come from the same model"),
    ],
)
def test_cli_user_errors_are_one_line(argv, match, tmp_path, capsys):
    (tmp_path / "x.json").write_text("{}")
    argv = [a.format(tmp=tmp_path, json=tmp_path / "x.json") for a in argv]
    one_line_error(capsys, argv, match)
    assert not (tmp_path / "t.safetensors").exists()


def test_a_model_that_is_not_there_is_refused_before_the_kernel_build(tmp_path, capsys, monkeypatch):
    """On a fresh machine the kernel's first build takes minutes: a mistyped model must not wait for it."""
    from torch_hybrid_moe.ops import cpu_kernel

    def build() -> None:
        raise AssertionError("the kernel was built before the model was looked for")

    monkeypatch.setattr(cpu_kernel, "extension", build)
    one_line_error(capsys, ["generate", "--model", str(tmp_path / "no" / "such")], "not an embedded model")


def test_simulate_runs_every_stack_it_can_without_gate_inputs(tmp_path, capsys):
    """A multi-layer trace without gate inputs (synthetic.py's, other tools'): the router-replaying stacks run
    without their prefetch, named so, and count among the papers ours is compared with (they were skipped, and
    "ours / best paper" left out the fastest paper's stack)."""
    path = tmp_path / "synthetic.safetensors"
    synthetic_trace(1.0, 0.4, num_experts=16, top_k=2, sequences=3, prompt_tokens=16, new_tokens=16).save(path)
    assert main(["simulate", "--trace", str(path), "--ours", "2,1,0.5,0", "--json"]) == 0
    records = {r["stack"]: r for r in json.loads(capsys.readouterr().out)}
    # residual and impact prefetch replay the router
    assert {"dali (no prefetch)", "hybrimoe (no prefetch)"} <= records.keys()
    assert not {"dali", "hybrimoe"} & records.keys()
    assert all(r["decode_tok_s"] > 0 for r in records.values())
    assert {"ours", "oracle", "ktransformers", "lru-cache"} <= records.keys()
    costs = CostModel(HARDWARE["dali"], EXPERT_SHAPES["deepseek-v2-lite"])
    trace = Trace.load(path)
    hybrimoe = replace(STACKS["hybrimoe"], prefetcher="none")
    assert records["hybrimoe (no prefetch)"]["decode_tok_s"] == simulate(trace, hybrimoe, costs).decode_tok_s
    assert main(["simulate", "--trace", str(path), "--ours", "2,1,0.5,0"]) == 0
    papers = {name: records[name]["decode_tok_s"] for name in records if name.split(" ")[0] in PAPERS}
    assert len(papers) == len(PAPERS)
    assert f"ours / best paper ({max(papers, key=papers.__getitem__)})" in capsys.readouterr().out
    one_line_error(
        capsys, ["simulate", "--trace", str(path), "--routers", str(tmp_path)], "does not record every row's gate input"
    )


def test_simulate_reads_the_routers_from_the_directory_given(tmp_path, capsys):
    """A trace whose model was never saved (gpu_decode.py's random model) replays DALI's and HybriMoE's
    prefetchers on the routers of `--routers`: the same figures as from the model the trace names, and without
    the flag, one line saying where it looked. A live row's stack (`--stack`) replays beside them."""
    trace = Trace.load(TRACE)
    trace = trace.select(trace.sequence < 2)
    named, unsaved = tmp_path / "named.safetensors", tmp_path / "unsaved.safetensors"
    trace.save(named)
    trace.meta["model"] = str(tmp_path / "never-saved")
    trace.save(unsaved)
    argv = ["--ours", "2,1,0.5,0", "--json"]
    figures = []
    for path, routers in ((named, []), (unsaved, ["--routers", str(resolve_model("mixtral-tiny"))])):
        assert main(["simulate", "--trace", str(path), *argv, *routers]) == 0
        records = {r["stack"]: r for r in json.loads(capsys.readouterr().out)}
        figures.append({name: records[name]["decode_tok_s"] for name in ("dali", "hybrimoe")})
    assert figures[0] == figures[1] and all(v > 0 for v in figures[0].values())
    # a stack given by registry names plays as the named stack of the same names
    assert main(["simulate", "--trace", str(named), *argv, "--stack", "cached_on_accelerator,lru"]) == 0
    records = {r["stack"]: r for r in json.loads(capsys.readouterr().out)}
    assert records["cached_on_accelerator+lru"]["decode_tok_s"] == records["lru-cache"]["decode_tok_s"] > 0
    one_line_error(capsys, ["simulate", "--trace", str(unsaved), *argv], "never-saved")


def synthetic_measurements(expert, tokens, placement_s=None):
    """What a machine like the `dali` preset would measure; with `placement_s`, a GPU machine's profile (GPU, link
    and the schedulers' placement times)."""
    c = CostModel(HARDWARE["dali"], expert)
    m = profiling.Measurements(profiling.profile_key(expert, tokens), {n: c.t_cpu(n) for n in tokens})
    m.cpu_overhead_s = HARDWARE["dali"].cpu_overhead_us * 1e-6
    if placement_s is not None:
        m.gpu_s, m.transfer_s, m.small_transfer_s = {n: c.t_gpu(n) for n in tokens}, c.t_transfer(), 1e-5
        m.placement_s, m.gpu_overhead_s = placement_s, HARDWARE["dali"].gpu_overhead_us * 1e-6
    return m


BAD_CPU_TIMES = {
    "empty": {},
    "zero": 0.0,
    "negative": -1e-3,
    "nan": math.nan,
    "null": None,
    "inf": math.inf,
    "huge": 1e300,
    "tiny": 1e-300,  # overflowed the fit (OverflowError) where it was accepted
}


@pytest.mark.parametrize("case", list(BAD_CPU_TIMES))
def test_a_bad_profile_cache_is_measured_again_with_a_warning(case, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    expert = EXPERT_SHAPES["qwen3-30b-a3b"]
    monkeypatch.setattr(profiling, "measure", lambda e, tokens, *a, **k: synthetic_measurements(e, tokens))
    good = profiling.profile_hardware(expert)
    data = json.loads(good.path.read_text())
    value = BAD_CPU_TIMES[case]
    data["cpu_s"] = value if isinstance(value, dict) else dict.fromkeys(data["cpu_s"], value)
    good.path.write_text(json.dumps(data))  # json writes NaN / Infinity, as a hand edit might
    with pytest.warns(UserWarning, match=f"cached profile {good.path} is unusable"):
        again = profiling.profile_hardware(expert)
    assert not again.cached and again.measured.cpu_s == good.measured.cpu_s
    assert profiling.profile_hardware(expert).cached  # and the cache was repaired


def test_profile_cache_path_that_cannot_be_used(tmp_path, monkeypatch):
    expert = EXPERT_SHAPES["qwen3-30b-a3b"]
    monkeypatch.setattr(profiling, "measure", lambda e, tokens, *a, **k: synthetic_measurements(e, tokens))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = profiling.profile_hardware(expert).path
    path.unlink()
    path.mkdir()  # a directory where the cache file should be
    with pytest.warns(UserWarning, match=f"cached profile {path} is unusable"):
        assert not profiling.profile_hardware(expert).cached
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # the cache's parent is a file
    with pytest.warns(UserWarning, match="profile not cached: cannot write"):
        p = profiling.profile_hardware(expert)
    assert p.path is None and p.cost_model().t_cpu(1) > 0


def test_a_profile_measured_on_a_loaded_machine_is_not_cached(tmp_path, monkeypatch):
    expert = EXPERT_SHAPES["qwen3-30b-a3b"]

    def busy(e, tokens, *a, **k):
        m = synthetic_measurements(e, tokens)
        m.load = 100.0 * (profiling.os.cpu_count() or 1)
        return m

    monkeypatch.setattr(profiling, "measure", busy)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.warns(UserWarning, match="profile not cached: load average"):
        p = profiling.profile_hardware(expert)
    assert p.path is None and not list(tmp_path.rglob("*.json"))

    def disturbed(e, tokens, *a, **k):  # one point far off any curve of the model's form
        m = synthetic_measurements(e, tokens)
        m.cpu_s[tokens[1]] *= 3
        return m

    monkeypatch.setattr(profiling, "measure", disturbed)
    with pytest.warns(UserWarning, match="profile not cached: the fitted cpu curve misses") as said:
        profiling.profile_hardware(expert)
    assert not list(tmp_path.rglob("*.json"))
    times = synthetic_measurements(expert, profiling.DEFAULT_TOKENS).cpu_s
    times[profiling.DEFAULT_TOKENS[1]] *= 3
    shown = ", ".join(f"{n}: {s * 1e3:.3g}" for n, s in times.items())
    assert f"(ms an expert by tokens: {shown})" in str(said[0].message)  # what was measured: the miss can be read


def test_convert_trace_from_jsonl_round_trips_the_routing(tmp_path, capsys):
    """Routing written as JSONL by another tool converts into a trace simulate runs on."""
    from torch_hybrid_moe.traces import Trace

    original = Trace.load(TRACE)
    rows = (original.sequence == 0).nonzero().flatten()  # one sequence: its prompt, then its decode steps
    assert int(original.step[rows].max()) >= 2
    with (tmp_path / "routing.jsonl").open("w") as f:
        for r in rows.tolist():
            layers = original.layers.items()
            f.write(
                json.dumps(
                    {
                        "sequence": int(original.sequence[r]),
                        "step": int(original.step[r]),
                        "token": int(original.tokens[r]),
                        "ids": {str(i): t.topk_ids[r].tolist() for i, t in layers},
                        "weights": {str(i): t.scores[r, : t.topk_ids.shape[1]].tolist() for i, t in layers},
                    }
                )
                + "\n"
            )
    out = tmp_path / "converted.safetensors"
    assert (
        main(
            [
                "convert-trace",
                "--jsonl",
                str(tmp_path / "routing.jsonl"),
                "--num-experts",
                str(original.meta["num_experts"]),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    converted = Trace.load(out)
    for idx, layer in original.layers.items():
        assert torch.equal(converted.layers[idx].topk_ids, layer.topk_ids[rows])
        k = layer.topk_ids.shape[1]
        assert torch.equal(converted.layers[idx].scores[:, :k], layer.scores[rows, :k])
        assert not converted.layers[idx].scores[:, k:].any()  # beyond the top-k nothing is known
    assert torch.equal(converted.position, original.position[rows])
    capsys.readouterr()
    assert main(["simulate", "--trace", str(out), "--ours", "2,1,0.5,0", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    without = {r["stack"] for r in records if "no prefetch" in r["stack"]}
    assert without == {"dali (no prefetch)", "hybrimoe (no prefetch)"}


@pytest.mark.parametrize(
    "line, match",
    [
        ("not json", "line 1 is not JSON"),
        (
            '{"sequence": 0, "step": -1, "ids": {"0": [1]}, "weights": {"0": [1.0]}}',
            "'step' must be an int in [0, 2**31)",
        ),
        ('{"sequence": 0, "step": 0, "token": "abc", "ids": {"0": [1]}, "weights": {"0": [1.0]}}', "'token' must"),
        ('{"sequence": 0, "step": 0, "token": 1.7, "ids": {"0": [1]}, "weights": {"0": [1.0]}}', "'token' must"),
        ('{"sequence": 1099511627776, "step": 0, "ids": {"0": [1]}, "weights": {"0": [1.0]}}', "'sequence' must"),
        (
            '{"sequence": 0, "step": 0, "ids": {"0": [3, 3]}, "weights": {"0": [0.5, 0.5]}}',
            "must list distinct expert ids",
        ),
        ('{"sequence": 0, "step": 0, "ids": {"0": [1000000000000000000000000000000]}, "weights": {"0": [1.0]}}', "ids"),
        (
            '{"sequence": 0, "step": 1, "ids": {"0": [1]}, "weights": {"0": [1.0]}}\n'
            '{"sequence": 0, "step": 1, "ids": {"0": [2]}, "weights": {"0": [1.0]}}',
            "sequence 0 has a second row for decode step 1",
        ),
        (
            '{"sequence": 0, "step": 0, "ids": {"0": [9]}, "weights": {"0": [1.0]}}',
            "expert ids outside [0, num_experts=4)",
        ),
        (
            '{"sequence": 0, "step": 0, "ids": {"0": [1]}, "weights": {"0": ["x"]}}',
            "weights['0'] must be a list of numbers",
        ),
        ('{"sequence": 0, "step": 0, "ids": {"0": [1]}, "weights": {"0": [NaN]}}', "router probabilities in [0, 1]"),
        ('{"sequence": 0, "step": 0, "ids": {"0": [1]}, "weights": {"0": [1e6]}}', "router probabilities in [0, 1]"),
        (
            '{"sequence": 0, "step": 0, "ids": {"70000": [1]}, "weights": {"70000": [1]}}',
            "layer 70000 is no decoder index",
        ),
        ('{"sequence": 0, "step": 0, "ids": {"\u00b2": [1]}, "weights": {"\u00b2": [1.0]}}', "must be a list of"),
        (
            '{"sequence": 0, "step": 0, "ids": {"1": [1]}, "weights": {"2": [1.0]}}',
            "weights of layers ['2'] differ from the first row's layers ['1']",
        ),
        (
            '{"sequence": 0, "step": 1, "ids": {"0": [1]}, "weights": {"0": [1.0]}}\n'
            '{"sequence": 0, "step": 0, "ids": {"0": [2]}, "weights": {"0": [1.0]}}',
            "goes back to step 0 after step 1",
        ),
    ],
)
def test_convert_trace_refuses_bad_rows(line, match, tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text(line + "\n")
    one_line_error(
        capsys,
        [
            "convert-trace",
            "--jsonl",
            str(tmp_path / "bad.jsonl"),
            "--num-experts",
            "4",
            "--out",
            str(tmp_path / "t.safetensors"),
        ],
        match,
    )
    assert not (tmp_path / "t.safetensors").exists()


def test_simulate_with_a_profile_from_another_machine(tmp_path, monkeypatch, capsys):
    """A profile cached on another machine (the GPU box a trace came from) replays that machine's costs for its own
    expert shape, as `--hardware local` does there; a file that is not such a profile, one of another format, or
    --profile beside --hardware is refused in one line."""
    expert = EXPERT_SHAPES["mixtral-8x7b"]
    monkeypatch.setattr(profiling, "measure", lambda e, tokens, *a, **k: synthetic_measurements(e, tokens))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = profiling.profile_hardware(expert).path
    trace = tmp_path / "synthetic.safetensors"
    synthetic_trace(1.0, 0.4, num_experts=8, top_k=2, sequences=1, prompt_tokens=8, new_tokens=8).save(trace)
    argv = ["simulate", "--trace", str(trace), "--ours", "2,1,0.5,0"]
    assert main([*argv, "--profile", str(path), "--json"]) == 0
    elsewhere = {r["stack"]: r["decode_tok_s"] for r in json.loads(capsys.readouterr().out)}
    assert main([*argv, "--hardware", "local", "--expert-shape", "mixtral-8x7b", "--json"]) == 0
    local = {r["stack"]: r["decode_tok_s"] for r in json.loads(capsys.readouterr().out)}
    assert elsewhere == local and elsewhere["ours"] > 0
    assert main([*argv, "--profile", str(path), "--cache-ratio", "0.3"]) == 0
    out = capsys.readouterr().out
    assert f"profile {path}" in out and "cache ratio 0.3 (2 of 8 experts a layer in slots)" in out
    old = tmp_path / "old.json"
    data = json.loads(path.read_text())
    data["key"]["format"] = profiling.FORMAT - 1
    old.write_text(json.dumps(data))
    (tmp_path / "x.json").write_text("{}")
    one_line_error(capsys, [*argv, "--profile", str(tmp_path / "x.json")], "is not a readable cost profile")
    one_line_error(capsys, [*argv, "--profile", str(tmp_path / "missing.json")], "is not a readable cost profile")
    one_line_error(capsys, [*argv, "--profile", str(old)], f"is a cost profile of format {profiling.FORMAT - 1}")
    for field, value, match in [
        ("hidden", -4096, "is not sizes in [1, 1048576]"),
        ("hidden", 10**12, "is not sizes in [1, 1048576]"),  # every stack decoded 0.0 tok/s, "x bound 1.000"
        ("inter", 1.5, "is not sizes in [1, 1048576]"),
        ("dense", float("inf"), "finite shares"),
        ("slot_bytes_per_weight", -2.0, "finite shares"),
        ("bytes_per_weight", 0.7, "no host format has 0.7 bytes"),
    ]:
        tampered = json.loads(path.read_text())
        tampered["key"]["expert"][field] = value
        old.write_text(json.dumps(tampered))
        one_line_error(capsys, [*argv, "--profile", str(old)], match)
    gpu = tmp_path / "gpu.json"  # a small copy timed slower than a whole expert's: stacks decoded 0.0 tok/s
    timed = synthetic_measurements(expert, profiling.DEFAULT_TOKENS, {"all_cpu": 1e-3}).to_json()
    gpu.write_text(json.dumps({**timed, "small_transfer_s": 9.0}))
    one_line_error(capsys, [*argv, "--profile", str(gpu)], "a small copy (9.0 s) is timed slower than a whole")
    for edit, match in [
        (lambda d: d["key"].pop("cpu"), "KeyError('cpu')"),  # what the fitted machine's description names
        (lambda d: d["cpu_s"].update({"0": 1e-3}), "count '0' is not positive"),
        (lambda d: d["cpu_s"].update({"-4": 1e-3}), "count '-4' is not positive"),
    ]:
        tampered = json.loads(path.read_text())
        edit(tampered)
        old.write_text(json.dumps(tampered))
        one_line_error(capsys, [*argv, "--profile", str(old)], match)
    tampered = json.loads(path.read_text())
    tampered["key"]["weights"] = "int4 (groups of 64)"  # times of int4 experts, read as bf16 ones
    old.write_text(json.dumps(tampered))
    one_line_error(capsys, [*argv, "--profile", str(old)], "was measured with int4 (groups of 64) weights")
    one_line_error(capsys, [*argv, "--profile", str(path), "--hardware", "rtx4090"], "not allowed with argument")


def test_simulate_with_a_measured_dense_time(tmp_path, capsys):
    """--dense-us prices every decoder block's non-MoE work at a measured time: the all-CPU stack's decode steps,
    which have nothing to overlap it with, each grow by exactly that much per layer over the estimate."""
    path = tmp_path / "synthetic.safetensors"
    trace = synthetic_trace(1.0, 0.4, num_experts=8, top_k=2, sequences=1, prompt_tokens=8, new_tokens=8)
    trace.save(path)
    argv = ["simulate", "--trace", str(path), "--ours", "2,1,0.5,0", "--json"]
    rates = []
    for extra in ([], ["--dense-us", "500"]):
        assert main([*argv, *extra]) == 0
        rates.append({r["stack"]: r["decode_tok_s"] for r in json.loads(capsys.readouterr().out)})
    costs = CostModel(HARDWARE["dali"], EXPERT_SHAPES["deepseek-v2-lite"])
    grown = len(trace.layers) * (500e-6 - costs.t_dense(1))  # per decode step (one token at batch 1)
    assert 1 / rates[1]["ktransformers"] == pytest.approx(1 / rates[0]["ktransformers"] + grown)


def test_simulate_graph_mode_prices_the_measured_placement(tmp_path, capsys):
    """--graph replays decode steps as the CUDA graph runs them, each scheduler's tensor form at the profile's
    measured device time: the all-CPU stack (no fills, no fetches, so nothing else changes) decodes exactly 1 ms a
    layer step slower when its placement measured 1 ms. A profile with placement times but none of the GPU's is
    refused in one line."""
    expert = EXPERT_SHAPES["mixtral-8x7b"]
    m = synthetic_measurements(expert, profiling.DEFAULT_TOKENS, {"all_cpu": 1e-3})
    profile = tmp_path / "gpu-profile.json"
    profile.write_text(json.dumps(m.to_json()))
    path = tmp_path / "synthetic.safetensors"
    trace = synthetic_trace(1.0, 0.4, num_experts=8, top_k=2, sequences=1, prompt_tokens=8, new_tokens=8)
    trace.save(path)
    argv = ["simulate", "--trace", str(path), "--ours", "2,1,0.5,0", "--profile", str(profile)]
    rates = []
    for extra in ([], ["--graph"]):
        assert main([*argv, *extra, "--json"]) == 0
        rates.append({r["stack"]: r["decode_tok_s"] for r in json.loads(capsys.readouterr().out)})
    assert 1 / rates[1]["ktransformers"] == pytest.approx(1 / rates[0]["ktransformers"] + len(trace.layers) * 1e-3)
    assert main([*argv, "--graph"]) == 0
    assert "placement as measured (all_cpu 1000 us)" in capsys.readouterr().out
    m.gpu_s = m.transfer_s = m.small_transfer_s = None
    profile.write_text(json.dumps(m.to_json()))
    one_line_error(capsys, argv, "placement times without GPU times")


@pytest.mark.parametrize("field", ["placement_s", "gpu_overhead_s", "cpu_overhead_s"])
def test_a_cached_profile_without_a_figure_measured_now_is_measured_again(field, tmp_path, monkeypatch):
    """Profiles cached before the schedulers' placement or a call's fixed cost was timed lack it: measured again
    (their fit would guess the overhead's split from the read time)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    expert = EXPERT_SHAPES["qwen3-30b-a3b"]

    monkeypatch.setattr(
        profiling, "measure", lambda e, tokens, *a, **k: synthetic_measurements(e, tokens, {"all_cpu": 2e-5})
    )
    first = profiling.profile_hardware(expert)
    assert profiling.profile_hardware(expert).cached
    data = json.loads(first.path.read_text())
    del data[field]
    first.path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="before the schedulers' placement or a call's overhead was timed"):
        again = profiling.profile_hardware(expert)
    assert not again.cached and getattr(again.measured, field) is not None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where no CUDA device exists")
def test_generate_on_cuda_without_one_is_one_line(capsys):
    one_line_error(capsys, ["generate", "--device", "cuda"], "no CUDA device is available")


@pytest.mark.parametrize("command", ["generate", "eval-ppl"])
def test_a_checkpoint_saved_without_its_tokenizer_is_one_line(command, tmp_path, capsys):
    """`save_pretrained` of a model alone writes no tokenizer: transformers' ValueError went up as a traceback."""
    from torch_hybrid_moe.tiny_models import tiny_model

    tiny_model("mixtral").save_pretrained(tmp_path)
    one_line_error(capsys, [command, "--model", str(tmp_path)], "put the model's tokenizer files")


def test_simulate_refuses_a_batch_the_calibration_trace_cannot_fill(tmp_path, capsys):
    """Ours is tuned on the calibration trace at --batch: a calibration of fewer sequences would be replayed at a
    smaller batch under this one's label (simulate() refuses that too)."""
    judged, held = tmp_path / "judged.safetensors", tmp_path / "held.safetensors"
    shape = dict(num_experts=8, top_k=2, prompt_tokens=8, new_tokens=8)
    synthetic_trace(1.0, 0.4, sequences=4, **shape).save(judged)
    synthetic_trace(1.0, 0.4, sequences=2, seed=1, **shape).save(held)
    argv = ["simulate", "--trace", str(judged), "--calibration", str(held), "--batch", "4"]
    one_line_error(capsys, argv, f"--batch 4: {held} holds 2 sequences; pass --batch <= 2")
    with pytest.raises(ValueError, match="batch 3: the trace holds 2 sequences"):
        simulate(Trace.load(held), STACKS["lru-cache"], CostModel(HARDWARE["dali"], EXPERT_SHAPES["mixtral-8x7b"]), 3)


def test_gguf_paths_that_are_not_files_fail_in_one_line(tmp_path, capsys, monkeypatch):
    """A .gguf path that does not exist is not tried as a hub id (a minute of retries), a directory named so is
    called one, and a file cut short inside its header fails in one line (struct.error's traceback before)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    one_line_error(capsys, ["generate", "--model", str(tmp_path / "no" / "model.gguf")], "does not exist; pass the")
    (tmp_path / "dir.gguf").mkdir()
    one_line_error(capsys, ["generate", "--model", str(tmp_path / "dir.gguf")], "is a directory; pass the path")
    (tmp_path / "cut.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    one_line_error(capsys, ["generate", "--model", str(tmp_path / "cut.gguf")], "if it is a whole GGUF file")


def test_simulate_refuses_a_sequence_without_its_prefill(tmp_path, capsys):
    """One-token prompts, every step moved one on: no two rows share a step, but no sequence has a prefill (every
    stack printed a prefill of 0 tok/s)."""
    trace = synthetic_trace(1.0, 0.4, num_experts=8, top_k=2, sequences=2, prompt_tokens=1, new_tokens=8)
    shifted = Trace(trace.meta, trace.tokens, trace.sequence, trace.step + 1, trace.position, trace.layers)
    with pytest.raises(InputError, match="sequence 0 starts without a prefill row"):
        shifted.check()


def test_a_calibration_from_another_model_is_not_called_a_router_problem(capsys):
    """It was wrapped as "the routers the gate prefetchers replay: ... (--routers DIR reads another)", which cannot
    mend it."""
    one_line_error(
        capsys, ["simulate", "--trace", str(TRACE), "--calibration", str(DEEPSEEK_TRACE)], "the calibration trace ("
    )
    assert main(["simulate", "--trace", str(TRACE), "--calibration", str(DEEPSEEK_TRACE)]) == 2
    assert "routers" not in capsys.readouterr().err
