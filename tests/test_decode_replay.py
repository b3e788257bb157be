"""Uncaptured decode steps called past Dynamo (runtime/decode_replay.py): replayed only where the recorded steps
and the checks made at every step say Dynamo would run the same graph, checked against eager calls and the
unpatched model's logits."""

import threading
from collections.abc import Callable

import pytest
import torch

from torch_hybrid_moe.runtime import decode_replay
from torch_hybrid_moe.runtime.decode_replay import DecodeReplay, recordable, recording

from .conftest import patched_copy


def _recording_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    """The graph as Dynamo traced it, recordable as the hybrid_moe backend's result is."""
    return recordable(gm.forward)


class Box:
    def __init__(self) -> None:
        self.value: torch.Tensor | None = None


class Step(torch.nn.Module):
    """A decode step in miniature: a weight, a tensor attribute the caller may rebind, a dict output."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)))
        self.shift = torch.ones(4)
        self.scale = 1.5
        self.keep_input = False
        self.last_input: torch.Tensor | None = None
        self.box = Box()  # not a module: its attributes are two levels down
        self.fill_box = False

    def forward(
        self, x: torch.Tensor, state: "State", flag: bool = True, bias: torch.Tensor | None = None
    ) -> dict[str, object]:
        if self.keep_input:
            self.last_input = x  # a Python side effect, not guarded on: Dynamo applies it after the graph
        y = (x @ self.weight + self.shift) * self.scale + state.offset
        if bias is not None:
            y = y + bias
        if self.fill_box:
            self.box.value = y * 2  # a tensor the graph computes for Dynamo's bytecode to store
        return {"y": y if flag else -y, "state": state, "total": y.sum()}


class State:
    """Stands in for the cache: an object leaf, with Python state a step may be specialised on."""

    def __init__(self) -> None:
        self.offset = 0


def _fresh() -> tuple[Step, State, DecodeReplay]:
    """A step, its state and its replay, compiled afresh whatever earlier tests compiled."""
    torch._dynamo.reset()
    step = Step()
    return step, State(), DecodeReplay(step, torch.compile(step, backend=_recording_backend, fullgraph=True))


def _check(replay: DecodeReplay, step: Step, state: State, calls: int, **kwargs: object) -> None:
    """`calls` steps on fresh inputs through `replay`, each against the eager module."""
    for i in range(calls):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(i))
        got, want = replay(x=x, state=state, **kwargs), step(x=x, state=state, **kwargs)
        assert torch.equal(got["y"], want["y"]) and torch.equal(got["total"], want["total"])
        assert got["state"] is state


def test_steps_replay_once_two_agree_and_match_eager() -> None:
    step, state, replay = _fresh()
    _check(replay, step, state, 5)
    assert replay.replays == 3  # two steps through Dynamo, then the graph
    _check(replay, step, state, 3, flag=False)  # a new signature: recorded on its own
    assert replay.replays == 4
    with torch.no_grad():  # the grad mode is part of the signature too
        _check(replay, step, state, 3)
    assert replay.replays == 5


@pytest.mark.parametrize(
    ("flag", "seen"),
    [
        ("keep_input", lambda step, x, out: step.last_input is x),  # a module attribute rebound
        ("fill_box", lambda step, x, out: torch.equal(step.box.value, out["y"] * 2)),  # a tensor two levels down
    ],
)
def test_a_python_side_effect_is_never_replayed(flag: str, seen: Callable) -> None:
    step, state, replay = _fresh()
    setattr(step, flag, True)
    for i in range(5):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(i))
        assert seen(step, x, replay(x=x, state=state))
    assert replay.replays == 0


def test_a_rebound_tensor_attribute_is_never_replayed() -> None:
    step, state, replay = _fresh()
    for i in range(5):
        step.shift = torch.full((4,), float(i))  # a new object each step: the recorded steps disagree
        _check(replay, step, state, 1)
    assert replay.replays == 0


def test_an_object_leafs_changed_state_is_recorded_again() -> None:
    step, state, replay = _fresh()
    for i in range(6):
        state.offset = i // 3  # steps 0-2 and 3-5: two states, each recorded, then replayed once
        _check(replay, step, state, 1)
    assert replay.replays == 2


def test_a_hook_is_never_replayed() -> None:
    step, state, replay = _fresh()
    seen: list[int] = []
    handle = step.register_forward_hook(lambda module, args, out: seen.append(1))
    try:
        _check(replay, step, state, 5)
    finally:
        handle.remove()
    assert replay.replays == 0
    assert len(seen) == 10  # each step once through Dynamo, once eagerly


def test_a_global_state_change_records_again() -> None:
    step, state, replay = _fresh()
    _check(replay, step, state, 3)
    assert replay.replays == 1
    torch.use_deterministic_algorithms(True)  # a flag Dynamo guards on, as it does autocast and the default dtype
    try:
        _check(replay, step, state, 3)
    finally:
        torch.use_deterministic_algorithms(False)
    assert replay.replays == 2  # the flag's first two steps through Dynamo, then the graph again


def test_inputs_aliased_when_recorded_are_not_replayed_apart() -> None:
    step, state, replay = _fresh()
    for i in range(3):  # recorded and replayed with bias the same tensor as x: the graph may read one input
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(i))
        assert torch.equal(replay(x=x, state=state, bias=x)["y"], step(x=x, state=state, bias=x)["y"])
    assert replay.replays == 1
    x, bias = torch.randn(2, 4), torch.randn(2, 4)
    assert torch.equal(replay(x=x, state=state, bias=bias)["y"], step(x=x, state=state, bias=bias)["y"])
    assert replay.replays == 1  # a new signature, through Dynamo


def test_recording_sees_only_its_own_thread() -> None:
    fn = recordable(lambda x: [x + 1])
    other: list = []
    with recording() as calls:
        fn(torch.zeros(1))
        thread = threading.Thread(target=lambda: other.append(fn(torch.zeros(1))))
        thread.start()
        thread.join()
    assert len(calls) == 1 and len(other) == 1
    fn(torch.zeros(1))
    assert len(calls) == 1  # not recording any more


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        (torch.tensor(2.0, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64), True),  # a module's float
        (torch.tensor(2.0, dtype=torch.float64), torch.tensor(3.0, dtype=torch.float64), False),
        (torch.tensor(2.0), torch.tensor(2.0, dtype=torch.float64), False),
        (torch.tensor(2.0), torch.tensor(2.0), False),  # not what Dynamo makes of a float: must be the same object
        (torch.ones(2), torch.ones(2), False),  # not a number: must be the same object
        (7, 7, True),
        (7, 8, False),
    ],
)
def test_fixed_arguments_agree_only_when_equal_numbers_or_identical(a: object, b: object, same: bool) -> None:
    assert decode_replay._same(a, b) is same


def _rebind(step: Step, name: str, value: object) -> None:
    setattr(step, name, value)


@pytest.mark.parametrize(
    ("change", "same"),
    [
        (lambda step: _rebind(step, "scale", float("1.5")), True),  # an equal float, another object
        (lambda step: _rebind(step, "whole", 2.0), False),  # an equal number of another type: a change too
        (lambda step: _rebind(step, "scale", 2.5), False),
        (lambda step: _rebind(step, "shift", step.shift.clone()), False),  # an equal tensor, another object
        (lambda step: _rebind(step, "extra", None), False),  # an attribute added
        (lambda step: delattr(step, "keep_input"), False),
        (lambda step: setattr(step.box, "other", step.box.__dict__.pop("value")), False),  # renamed, as it was
        (lambda step: step.register_buffer("b", torch.ones(1)), False),  # a dict attribute's item added
        (lambda step: step._parameters.update(weight=torch.nn.Parameter(step.weight.clone())), False),
        (lambda step: step._parameters.pop("weight"), False),
        (lambda step: step._parameters.update(w=step._parameters.pop("weight")), False),  # an item renamed
        (lambda step: step.items.__setitem__(0, 9), False),  # a list attribute's item replaced in place
    ],
)
def test_a_snapshot_sees_every_rebinding_and_nothing_else(change: Callable, same: bool) -> None:
    """What a recorded step compares before and after its graph, against a copy of the objects' attribute values."""
    step = Step()
    step.items, step.whole = [1, 2, 3], 2
    before = decode_replay._python_state([step, step.box])
    assert decode_replay._same_state(decode_replay._python_state([step, step.box]), before)
    change(step)
    assert decode_replay._same_state(decode_replay._python_state([step, step.box]), before) is same


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_generate_replays_decode_steps_with_reference_logits(reference_models, arch) -> None:
    ref = reference_models[arch]
    model = patched_copy(ref, expert_budget=0.0)
    made: list[DecodeReplay] = []
    get_compiled_call = model.get_compiled_call
    model.get_compiled_call = lambda config: made.append(get_compiled_call(config)) or made[-1]
    x = torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(3))
    gen = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_logits=True)
    want = ref.generate(x, **gen)
    for _ in range(2):  # the second generate() call checks its first steps through Dynamo again
        got = model.generate(x, **gen)
        assert torch.equal(got.sequences, want.sequences)
        for mine, theirs in zip(got.logits, want.logits, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    assert len(made) == 2 and made[0] is not made[1]
    assert [r.replays for r in made] == [7, 7]  # 9 decode steps: 2 through Dynamo, 7 replayed
