"""The shipped trained models: offline loading, quality, routing, hybrid generate, perplexity, traces."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import torch_hybrid_moe as thm
from torch_hybrid_moe.embedded import embedded_models
from torch_hybrid_moe.embedded.evaluation import decode_perplexity, perplexity, windows
from torch_hybrid_moe.tiny_models import tiny_model
from torch_hybrid_moe.traces import Trace, record_trace

NAMES = ["deepseek-tiny", "mixtral-tiny"]


@pytest.fixture(scope="module")
def loaded():
    return {
        name: (
            AutoModelForCausalLM.from_pretrained(embedded_models()[name]).eval(),
            AutoTokenizer.from_pretrained(embedded_models()[name]),
        )
        for name in NAMES
    }


@pytest.mark.parametrize("name", NAMES)
def test_shipped_model_loads_offline_and_is_small(name, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = embedded_models()[name]
    assert (path / "model.safetensors").stat().st_size <= 10 * 2**20
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = "def add(a, b):\n    return a + b\n"
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    assert model.config.model_type == {"deepseek-tiny": "deepseek_v3", "mixtral-tiny": "mixtral"}[name]


@pytest.mark.parametrize("name", NAMES)
def test_training_report_shows_learning_and_specialised_routing(name):
    report = json.loads((embedded_models()[name] / "training_report.json").read_text())
    assert report["heldout_ppl"] < 0.25 * report["unigram_ppl"]
    for layer in report["routing"].values():
        assert layer["load_entropy"] < 0.995  # not uniform
        assert layer["temporal_reuse"] > 1.2 * layer["random_reuse"]  # neighbouring tokens share experts


@pytest.mark.slow
def test_hybrid_generate_equals_transformers_generate(loaded):
    model, tokenizer = loaded["deepseek-tiny"]
    ids = tokenizer("import os\n\ndef main(", return_tensors="pt").input_ids
    want = model.generate(ids, max_new_tokens=12, do_sample=False)
    import copy

    patched = thm.patch_model(copy.deepcopy(model), expert_budget=0.25)
    got = patched.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, want)
    assert hasattr(patched, "_compiled_call")


class BigramTable(torch.nn.Module):
    """A 'model' whose next-token logits depend only on the current token: a fixed table."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(table)

    def forward(self, input_ids):
        return type("Out", (), {"logits": self.table[input_ids]})


def test_perplexity_harness_against_hand_computation():
    torch.manual_seed(0)
    table = torch.randn(5, 5)
    ids = torch.randint(0, 5, (2 * 3 + 1,))
    logp = table.double().log_softmax(-1)
    by_hand = math.exp(-sum(logp[ids[i], ids[i + 1]].item() for i in range(len(ids) - 1)) / (len(ids) - 1))
    assert perplexity(BigramTable(table), ids, seq=3, batch=1) == pytest.approx(by_hand, rel=1e-6)
    assert windows(ids, 3).tolist() == [ids[0:4].tolist(), ids[3:7].tolist()]


@pytest.mark.filterwarnings("error::FutureWarning")
def test_decode_perplexity_equals_the_full_forwards_with_a_smaller_last_batch():
    """Three windows in batches of two: the last batch holds one window (its KV cache was sized for two, and the
    step failed), and token-by-token decoding scores each token as one forward over the window does, handing the
    cache under the name this transformers gives it (5.24 deprecates past_key_values)."""
    model = tiny_model("mixtral").float()
    ids = torch.randint(3, 96, (3 * 8 + 1,), generator=torch.Generator().manual_seed(0))
    want = perplexity(model, ids, seq=8, batch=2)
    assert decode_perplexity(model, ids, seq=8, batch=2) == pytest.approx(want, rel=1e-4)
    with pytest.raises(ValueError, match="5 tokens make no window of 8 predictions: give at least 9"):
        perplexity(model, ids[:5], seq=8)


@pytest.mark.filterwarnings("error::FutureWarning")
def test_decode_perplexity_of_a_compiled_model_hands_the_cache_by_its_models_name():
    """torch.compile's wrapper takes any argument: the cache's name was read off the wrapper (past_key_values, which
    transformers 5.24 deprecates for cache and will drop, leaving every step without its context)."""
    from torch_hybrid_moe.generation import ForwardNames

    model = tiny_model("mixtral").float()
    compiled = torch.compile(model, backend="eager")
    names = ForwardNames(compiled)
    assert (names.cache, names.cache_position) == (ForwardNames(model).cache, ForwardNames(model).cache_position)
    ids = torch.randint(3, 96, (8 + 1,), generator=torch.Generator().manual_seed(0))
    assert decode_perplexity(compiled, ids, seq=8) == pytest.approx(perplexity(model, ids, seq=8), rel=1e-4)


def test_trace_of_routing_alone(tmp_path):
    """hidden_every=0 records no gate inputs: the same routing as a trace with them, and a calibration learnt from it
    needs no routers (so none is loaded by the model name, which need not exist)."""
    from torch_hybrid_moe.simulator.calibration import Calibration

    model = tiny_model("deepseek_v3")
    prompts = [torch.randint(3, 96, (7,), generator=torch.Generator().manual_seed(0))]
    full = record_trace(model, prompts, max_new_tokens=4, model_name="tiny:deepseek_v3", hidden_every=1)
    bare = record_trace(model, prompts, max_new_tokens=4, model_name="no-such-model", hidden_every=0)
    bare.save(tmp_path / "t.safetensors")
    back = Trace.load(tmp_path / "t.safetensors")
    for idx, layer in full.layers.items():
        assert torch.equal(back.layers[idx].topk_ids, layer.topk_ids)
        assert layer.hidden.shape[0] == layer.topk_ids.shape[0]  # every row's gate input where asked for
        assert back.layers[idx].hidden.shape[0] == back.layers[idx].hidden_rows.numel() == 0
    assert Calibration.from_trace(back).routers == {}


def test_a_trace_of_every_other_row_replays_no_router(tmp_path, capsys):
    """Gate inputs of every 2nd row leave decode steps with nothing for a router to route: such a trace replays no
    router (DeepSeek's grouped ones crashed on the empty steps, the others were scored as missing them), and
    `--routers` on it says how to record one that does."""
    from torch_hybrid_moe.cli import main

    from .test_cli_errors import one_line_error

    model = tiny_model("deepseek_v2")
    prompts = [torch.randint(3, 96, (7,), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    sparse = record_trace(model, prompts, max_new_tokens=6, model_name="tiny:deepseek_v2", hidden_every=2)
    full = record_trace(model, prompts, max_new_tokens=6, model_name="tiny:deepseek_v2", hidden_every=1)
    assert full.gate_inputs and not sparse.gate_inputs
    sparse.save(tmp_path / "sparse.safetensors")
    assert main(["simulate", "--trace", str(tmp_path / "sparse.safetensors"), "--json"]) == 0
    capsys.readouterr()
    one_line_error(
        capsys,
        ["simulate", "--trace", str(tmp_path / "sparse.safetensors"), "--routers", "tiny:deepseek_v2"],
        "--hidden-every 1",
    )


def test_tracing_a_model_without_routing_is_one_line():
    """An architecture the package does not patch (a dense Llama), or one of its MoE models configured with no MoE
    layer, is refused with what to do (it was a KeyError)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from torch_hybrid_moe.errors import InputError

    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    )
    prompt = [torch.randint(3, 96, (4,))]
    with pytest.raises(InputError, match="model type 'llama' is not supported; supported: "):
        record_trace(llama, prompt, max_new_tokens=2, model_name="llama")
    config = tiny_model("qwen3_moe").config
    config.mlp_only_layers = list(range(config.num_hidden_layers))
    dense = type(tiny_model("qwen3_moe"))(config)
    with pytest.raises(InputError, match="has no MoE layers"):
        record_trace(dense, prompt, max_new_tokens=2, model_name="dense")


def test_trace_round_trip_and_matches_direct_routing(tmp_path):
    model = tiny_model("deepseek_v3")
    prompts = [torch.randint(3, 96, (7,), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    trace = record_trace(model, prompts, max_new_tokens=4, model_name="tiny:deepseek_v3", hidden_every=2)
    trace.save(tmp_path / "t.safetensors")
    back = Trace.load(tmp_path / "t.safetensors")
    assert back.meta == trace.meta and back.meta["layers"] == [1, 2]
    assert back.tokens.numel() == 2 * (7 + 4 - 1)
    for name in ("tokens", "sequence", "step", "position"):
        assert torch.equal(getattr(back, name), getattr(trace, name))
    for idx, layer in trace.layers.items():
        for field in ("topk_ids", "score_ids", "scores", "hidden_rows", "hidden"):
            assert torch.equal(getattr(back.layers[idx], field), getattr(layer, field))
    # independent check: the prefill rows of prompt 0 are what the gate picks on a plain forward
    seen = {}

    def keep_first(idx):
        def hook(module, args, output):
            seen.setdefault(idx, output[2])

        return hook

    hooks = [model.model.layers[i].mlp.gate.register_forward_hook(keep_first(i)) for i in (1, 2)]
    with torch.no_grad():
        model(prompts[0].view(1, -1))
    for h in hooks:
        h.remove()
    for idx in (1, 2):
        assert torch.equal(back.layers[idx].topk_ids[:7].long(), seen[idx])


def test_trace_rejects_foreign_files(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(ValueError, match="not a hybrid_moe trace"):
        Trace.load(tmp_path / "x.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_shipped_models_generate_at_any_batch_size(name, loaded):
    """Shipped configs are inference configs (no router aux loss): a padded batch of 3 generates unpatched, and
    a patched model follows batch size changes (1, then 2) with the unpatched model's tokens."""
    import copy

    model, tokenizer = loaded[name]
    assert not model.config.output_router_logits
    tokenizer = copy.copy(tokenizer)
    tokenizer.padding_side = "left"
    texts = ["def add(a, b):", "import os\nimport", "class Stack:\n    def"]
    gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        model.generate(**batch, **gen)  # a padded batch of 3, unpatched
        patched = thm.patch_model(copy.deepcopy(model), expert_budget=0.5)
        for size in (1, 2):
            inputs = tokenizer(texts[:size], return_tensors="pt", padding=True)
            want = model.generate(**inputs, **gen)
            assert torch.equal(patched.generate(**inputs, **gen), want)


def test_a_local_directory_wins_over_an_embedded_model_of_its_name(tmp_path, monkeypatch):
    """`./mixtral-tiny` holding another checkpoint loads as transformers would load it: the directory."""
    from torch_hybrid_moe.embedded import resolve_model

    tiny_model("qwen3_moe").save_pretrained(tmp_path / "mixtral-tiny")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("mixtral-tiny") == "mixtral-tiny"
    assert thm.from_pretrained("mixtral-tiny", device="cpu").config.model_type == "qwen3_moe"
    assert resolve_model("deepseek-tiny") == str(embedded_models()["deepseek-tiny"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--out", "PACKAGE"], "--replace-shipped"),
        (["--replace-shipped", "--out", "elsewhere"], "drop --out"),
        (["--steps", "0"], "--steps"),
    ],
)
def test_training_refuses_to_overwrite_the_shipped_models_unasked(argv, message, monkeypatch, capsys):
    """Retraining lands beside the user, not over the shipped models and held-out text (which the shipped traces
    and README figures rest on); a bad count is refused before the corpus is read."""
    from torch_hybrid_moe.embedded import MODELS_DIR, corpus, train

    heldout = corpus.SHIPPED_HELDOUT.read_bytes()
    read = []

    def split_corpus(*args):  # stops the run there: a regression must not write over the shipped text
        read.append(args)
        raise AssertionError("the corpus was read")

    monkeypatch.setattr(train, "split_corpus", split_corpus)
    argv = [str(MODELS_DIR / "x") if a == "PACKAGE" else a for a in argv]
    monkeypatch.setattr("sys.argv", ["train", *argv])
    with pytest.raises(SystemExit):
        train.main()
    assert message in capsys.readouterr().err
    assert read == [] and corpus.SHIPPED_HELDOUT.read_bytes() == heldout


def test_training_on_too_little_text_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    """1000 characters, less than the corpus's first file: it wrote the held-out text, then failed with a traceback
    inside transformers' tokenizer."""
    from torch_hybrid_moe.embedded import train

    monkeypatch.setattr("sys.argv", ["train", "--out", str(tmp_path / "out"), "--max-train-chars", "1000"])
    with pytest.raises(SystemExit):
        train.main()
    assert "leaves too little text to train on" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
