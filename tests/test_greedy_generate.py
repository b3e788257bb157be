"""`thm.greedy_generate` gives `generate(do_sample=False)`'s tokens, and `hybrid_moe::greedy_tokens` torch.argmax's."""

import copy

import pytest
import torch

import torch_hybrid_moe as thm
from torch_hybrid_moe import generation
from torch_hybrid_moe.errors import InputError
from torch_hybrid_moe.runtime.decode_replay import DecodeReplay
from torch_hybrid_moe.tiny_models import TINY_ARCHITECTURES

from .conftest import patched_copy


def prompts(batch: int = 2, length: int = 6) -> torch.Tensor:
    return torch.randint(3, 96, (batch, length), generator=torch.Generator().manual_seed(batch * length))


class Recorder:
    """A streamer that keeps what it is given."""

    def __init__(self) -> None:
        self.put_values: list[torch.Tensor] = []
        self.ended = 0

    def put(self, value: torch.Tensor) -> None:
        self.put_values.append(value)

    def end(self) -> None:
        self.ended += 1


@pytest.mark.slow
@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_tokens_are_the_unpatched_models_greedy_tokens(reference_models, arch, monkeypatch) -> None:
    ref = reference_models[arch]
    x = prompts()
    want = ref.generate(x, max_new_tokens=10, do_sample=False)
    model = patched_copy(ref, expert_budget=0.0)
    made: list[DecodeReplay] = []
    monkeypatch.setattr(generation, "DecodeReplay", lambda *a: made.append(DecodeReplay(*a)) or made[-1])
    for _ in range(2):  # the second call reuses the compiled step
        assert torch.equal(thm.greedy_generate(model, x, 10), want)
    assert [r.replays for r in made] == [7, 7]  # 9 decode steps a call: 2 through Dynamo, 7 past it


@pytest.mark.slow
def test_a_bf16_model_gives_its_reference_tokens(reference_models) -> None:
    ref = copy.deepcopy(reference_models["qwen3_moe"]).to(torch.bfloat16)
    x = prompts()
    assert torch.equal(
        thm.greedy_generate(patched_copy(ref, expert_budget=0.0), x, 10),
        ref.generate(x, max_new_tokens=10, do_sample=False),
    )


@pytest.mark.slow
def test_slots_and_a_shorter_prompt_after_a_longer_one(reference_models) -> None:
    ref = reference_models["qwen3_moe"]
    model = patched_copy(ref, expert_budget=0.25)  # the general dispatch, with slots
    for length, new in ((9, 12), (4, 5)):  # the second reuses the first's longer static cache
        x = prompts(batch=1, length=length)
        assert torch.equal(thm.greedy_generate(model, x, new), ref.generate(x, max_new_tokens=new, do_sample=False))


@pytest.mark.slow
def test_end_tokens_pad_finished_rows_and_end_the_call_as_generate_does(reference_models) -> None:
    ref = reference_models["mixtral"]
    x = prompts()
    free = ref.generate(x, max_new_tokens=12, do_sample=False)
    ends = [int(free[0, x.shape[1] + 2]), int(free[1, x.shape[1] + 5])]  # each row's, by its sixth new token
    want = ref.generate(x, max_new_tokens=12, do_sample=False, eos_token_id=ends, pad_token_id=1)
    assert want.shape[1] < x.shape[1] + 12  # the call ends early: every row has ended
    model = patched_copy(ref, expert_budget=0.0)
    streamer = Recorder()
    got = thm.greedy_generate(model, x, 12, eos_token_id=ends, pad_token_id=1, streamer=streamer)
    assert torch.equal(got, want)
    assert torch.equal(streamer.put_values[0], x) and streamer.ended == 1
    assert torch.equal(torch.stack(streamer.put_values[1:], dim=1), got[:, x.shape[1] :])
    assert torch.equal(thm.greedy_generate(model, x, 1), free[:, : x.shape[1] + 1])  # the prompt's token alone


@pytest.mark.slow
@pytest.mark.parametrize("case", ["repetition_penalty", "pad_in_prompt"])
def test_what_generate_does_beyond_an_argmax_is_generates(reference_models, case, monkeypatch) -> None:
    """A generation config with a logits processor, or a prompt whose pad tokens generate() masks: generate()'s
    tokens, which a plain argmax over an unmasked prompt would not give."""
    ref = copy.deepcopy(reference_models["qwen3_moe"])
    x = prompts()
    if case == "repetition_penalty":
        ref.generation_config.repetition_penalty = 1.5
    else:
        x[0, :3] = ref.generation_config.pad_token_id  # left padding
    want = ref.generate(x, max_new_tokens=10, do_sample=False)
    model = patched_copy(ref, expert_budget=0.0)
    assert torch.equal(thm.greedy_generate(model, x, 10), want)
    monkeypatch.setattr(generation, "_beyond_argmax", lambda *args: False)  # the plain loop would differ
    assert not torch.equal(thm.greedy_generate(model, x, 10), want)


@pytest.mark.slow
def test_left_padding_whose_pad_token_ends_sequences_needs_the_mask(reference_models) -> None:
    """A pad token that is an end token too (Qwen's, the embedded models'): generate() cannot infer a mask from it,
    so the plain loop ran over the left padding unmasked and silently gave other tokens than the masked reference.
    With the tokenizer's attention_mask the tokens are the reference's; without it, such a batch is refused."""
    ref = copy.deepcopy(reference_models["mixtral"])
    pad = ref.generation_config.eos_token_id = ref.generation_config.pad_token_id = 2
    x, mask = prompts(3), torch.ones(3, 6, dtype=torch.long)
    x[1, :2], mask[1, :2] = pad, 0
    x[2, :4], mask[2, :4] = pad, 0
    want = ref.generate(x, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert not torch.equal(
        want, ref.generate(x, attention_mask=torch.ones_like(mask), max_new_tokens=8, do_sample=False)
    )
    model = patched_copy(ref, expert_budget=0.0)
    assert torch.equal(thm.greedy_generate(model, x, 8, attention_mask=mask), want)
    with pytest.raises(InputError, match="different numbers of the pad token 2, which is an end token too"):
        thm.greedy_generate(model, x, 8)
    same = prompts(3)
    same[:, 0] = pad  # one leading pad token in every row (a bos that is the pad token): no padding to see
    thm.greedy_generate(model, same, 2)


@pytest.mark.slow
def test_no_end_tokens_stay_none_when_generate_takes_the_call(reference_models) -> None:
    """eos_token_id=[] means none; handed to generate() (a padded batch) it became None, and generate() took the
    model's own end token back, stopping a row the reference (eos_token_id=[]) continues."""
    ref = copy.deepcopy(reference_models["mixtral"])
    x, mask = prompts(2), torch.ones(2, 6, dtype=torch.long)
    x[1, :2], mask[1, :2] = 1, 0
    free = ref.generate(x, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=[], pad_token_id=1)
    ref.generation_config.eos_token_id = int(free[1, 6 + 2])  # row 1's third new token ends it under the model's
    want = ref.generate(x, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=[], pad_token_id=1)
    assert torch.equal(want, free)
    model = patched_copy(ref, expert_budget=0.0)
    assert torch.equal(thm.greedy_generate(model, x, 10, eos_token_id=[], pad_token_id=1, attention_mask=mask), want)


@pytest.mark.slow
def test_more_batch_sizes_than_the_step_keeps_graphs_for_compile_afresh(reference_models, monkeypatch) -> None:
    """Each batch size is a graph of the compiled step; past the number it keeps (Dynamo's default limit, 8, failed
    a ninth batch size in one process) it drops them and compiles again, with the same tokens."""
    ref = reference_models["mixtral"]
    model = patched_copy(ref, expert_budget=0.0)
    monkeypatch.setattr(generation, "_STEP_GRAPHS", 1)
    for batch in (1, 3, 1):
        x = prompts(batch=batch)
        assert torch.equal(thm.greedy_generate(model, x, 3), ref.generate(x, max_new_tokens=3, do_sample=False))


@pytest.mark.parametrize(("field", "value"), [("max_time", 60.0), ("stop_strings", ["def"])])
def test_stopping_criteria_beyond_the_end_tokens_take_generate(reference_models, field, value) -> None:
    """generate() stops on a time limit or a stop string; the plain loop knows neither, so it hands them over."""
    config = copy.deepcopy(reference_models["qwen3_moe"].generation_config)
    assert not generation._beyond_argmax(config, prompts(), (), None)
    setattr(config, field, value)
    assert generation._beyond_argmax(config, prompts(), (), None)


def test_the_static_cache_stops_at_the_models_positions_and_long_calls_are_not_kept(
    reference_models, monkeypatch
) -> None:
    """A static cache is allocated whole: it is not doubled past the model's maximum position, and a long call's
    size is not kept for the short calls after it. The tokens stay generate()'s."""
    ref = copy.deepcopy(reference_models["qwen3_moe"])
    ref.config.max_position_embeddings = 100
    model = patched_copy(ref, expert_budget=0.0)
    x = prompts(batch=1, length=9)
    assert torch.equal(thm.greedy_generate(model, x, 5), ref.generate(x, max_new_tokens=5, do_sample=False))
    assert generation._CACHE_LENGTHS[model] == 100  # not the 256 of the first power-of-two size
    monkeypatch.setattr(generation, "_KEPT_CACHE", 64)
    model = patched_copy(reference_models["qwen3_moe"], expert_budget=0.0)
    thm.greedy_generate(model, x, 5)
    assert model not in generation._CACHE_LENGTHS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("vocab", [1, 5, 17, 8191, 16385, 151936])
def test_greedy_tokens_is_torch_argmax(kernel, dtype, vocab) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(8, vocab, generator=gen).to(dtype)
    logits[1] = logits[1].round()  # ties: the first index wins
    logits[2] = float("-inf")
    if vocab > 3:
        logits[3, vocab // 2] = logits[3, vocab - 1] = float("nan")  # the first NaN wins
        logits[4, vocab - 1] = logits[4].max() + 1  # the largest at the very end
    # With 4 threads a 151,936-entry row is 4 chunks of `per`: ties and NaNs on both sides of a boundary.
    per = -(-vocab // 4)
    if vocab == 151936:
        logits[5, per - 1] = logits[5, per] = logits[5].max() + 1
        logits[6, per] = logits[6, per + 5] = float("nan")
        logits[7, per - 1] = logits[7, per] = float("nan")
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        got = torch.ops.hybrid_moe.greedy_tokens(logits)
        strided = torch.ops.hybrid_moe.greedy_tokens(logits[:, 1:]) if vocab > 1 else None
    finally:
        torch.set_num_threads(threads)
    assert got.dtype == torch.long
    assert torch.equal(got, logits.argmax(-1))
    if vocab == 151936:
        assert got[5:].tolist() == [per - 1, per, per - 1]
    if strided is not None:
        assert torch.equal(strided, logits[:, 1:].argmax(-1))


@pytest.mark.parametrize("logits", [torch.zeros(4), torch.zeros(2, 0), torch.zeros(1, 2, 3)])
def test_greedy_tokens_refuses_what_is_not_rows_of_logits(kernel, logits) -> None:
    with pytest.raises((RuntimeError, ValueError), match="greedy_tokens: logits must be"):
        torch.ops.hybrid_moe.greedy_tokens(logits)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m: thm.greedy_generate(m, prompts()[0], 4), "input_ids must be an int64 / int32"),
        (lambda m: thm.greedy_generate(m, prompts().float(), 4), "input_ids must be an int64 / int32"),
        (lambda m: thm.greedy_generate(m, prompts()[:, :0], 4), "input_ids must be an int64 / int32"),
        (lambda m: thm.greedy_generate(m, prompts(), 0), "max_new_tokens must be a positive int"),
        (lambda m: thm.greedy_generate(m, prompts(), True), "max_new_tokens must be a positive int"),
        (lambda m: thm.greedy_generate(m, prompts(), 2.0), "max_new_tokens must be a positive int"),
        (  # positions past the model's are not what it was trained on (the CLI's generate ran there silently)
            lambda m: thm.greedy_generate(m, prompts(), m.config.max_position_embeddings - 4),
            "a 6-token prompt and .* new tokens exceed the model's",
        ),
        (lambda m: thm.greedy_generate(m, prompts(), 4, eos_token_id=10**6), "eos_token_id must be token ids"),
        (lambda m: thm.greedy_generate(m, prompts(), 4, eos_token_id=[-1]), "eos_token_id must be token ids"),
        (lambda m: thm.greedy_generate(m, prompts(), 4, pad_token_id=10**6), "pad_token_id must be a token id"),
        (lambda m: thm.greedy_generate(m, prompts(), 4, pad_token_id=True), "pad_token_id must be a token id"),
        (lambda m: thm.greedy_generate(m, prompts().to(torch.int8), 4), "input_ids must be an int64 / int32"),
        (lambda m: thm.greedy_generate(m, prompts(), 4, attention_mask=torch.ones(2, 5)), "of input_ids' shape"),
        (lambda m: thm.greedy_generate(m, prompts(), 4, attention_mask=torch.full((2, 6), 2)), "hold 0 \\(padding\\)"),
    ],
)
def test_bad_input_is_refused_before_anything_runs(reference_models, call, message) -> None:
    model = patched_copy(reference_models["qwen3_moe"], expert_budget=0.0)
    with pytest.raises(InputError, match=message):
        call(model)
    assert model not in generation._CACHE_LENGTHS  # nothing ran: no cache was sized for it
    assert all(s.steps == 0 for s in thm.stats(model).values())


def test_an_unpatched_model_is_refused(reference_models) -> None:
    with pytest.raises(InputError, match="patched by torch_hybrid_moe: patch it first"):
        thm.greedy_generate(reference_models["qwen3_moe"], prompts(), 4)


def test_step_positions_cross_their_blocks_unchanged() -> None:
    """The positions made ahead in blocks are each step's own: the prompt's, then length + i - 1 at step i, across
    block boundaries, with the cache positions as their first row."""
    from torch_hybrid_moe.generation import _POSITION_BLOCK, _positions

    batch, length, steps = 2, 5, 2 * _POSITION_BLOCK + 3
    made = list(_positions(batch, length, steps))
    assert len(made) == steps
    assert torch.equal(made[0][0], torch.arange(length).expand(batch, length))
    for i, (positions, cache_position) in enumerate(made[1:], start=1):
        assert positions.shape == (batch, 1) and positions.is_contiguous()
        assert (positions == length + i - 1).all() and torch.equal(cache_position, positions[0])
