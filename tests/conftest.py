import copy
from types import ModuleType

import pytest
import torch

import torch_hybrid_moe as thm
from torch_hybrid_moe.ops import cpu_kernel, kernel_build
from torch_hybrid_moe.ops.quantize import quantize_activations
from torch_hybrid_moe.tiny_models import TINY_ARCHITECTURES, tiny_model

torch.set_num_threads(2)

ISA_LEVELS = tuple(kernel_build.ISA_NAMES)  # every level the C++ kernel has, whichever this CPU runs


@pytest.fixture(scope="session")
def kernel() -> ModuleType:
    """The C++ CPU kernel, built (or loaded from torch's cache) by the first test that needs it, not while collecting:
    a cold build takes about a minute on 2 cores. Its tests skip where it cannot be built."""
    if cpu_kernel.best_isa() < 0:
        pytest.skip("the C++ kernel could not be built here")
    return cpu_kernel.extension()


@pytest.fixture(params=ISA_LEVELS)
def isa(request: pytest.FixtureRequest, kernel: ModuleType) -> int:
    """Each ISA level the kernel runs at on this CPU. Parametrised over all levels, since this CPU's best is known only
    once the kernel is built; the levels above it skip."""
    if request.param > cpu_kernel.best_isa():
        pytest.skip(f"this CPU does not run the kernel at ISA level {request.param}")
    return request.param


@pytest.fixture(scope="session")
def reference_models() -> dict[str, torch.nn.Module]:
    """One unpatched fp32 model per architecture; tests patch deep copies, never these."""
    return {arch: tiny_model(arch) for arch in TINY_ARCHITECTURES}


def patched_copy(model: torch.nn.Module, **config) -> torch.nn.Module:
    return thm.patch_model(copy.deepcopy(model), **config)


def float64_experts(hidden, ids, weights, gate_up, down, rounded=False, bf16_h=False):
    """The per-pair float64 loop every expert implementation is checked against; `rounded`: both projections' inputs
    rounded per 32 columns (int8 / int4 layers); `bf16_h`: the down projection's input rounded to bf16 (a bf16 model's
    bf16 experts)."""

    def inputs(x):
        return quantize_activations(x.float()).double() if rounded else x.double()

    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t, k in zip(*torch.nonzero(ids >= 0, as_tuple=True)):
        e = int(ids[t, k])
        gate, up = (gate_up[e] @ inputs(hidden[t])).chunk(2)
        h = torch.nn.functional.silu(gate) * up
        out[t] += float(weights[t, k]) * (down[e] @ inputs(h.bfloat16() if bf16_h else h))
    return out


class DeepcopySafeCounter:
    """Counts Dynamo frames compiled through the hybrid_moe backend.

    transformers deep-copies CompileConfig, so the counter must survive a deepcopy as itself.
    """

    def __init__(self) -> None:
        from torch._dynamo.testing import CompileCounterWithBackend

        self.counter = CompileCounterWithBackend("hybrid_moe")

    def __call__(self, gm, example_inputs, **kwargs):
        return self.counter(gm, example_inputs, **kwargs)

    def __deepcopy__(self, memo):
        return self

    @property
    def frame_count(self) -> int:
        return self.counter.frame_count


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles new model instances; their guards must not pile up against the recompile limit."""
    torch._dynamo.reset()
    yield


def stack_file(tmp_path, **edits):
    """A stack file as `hybrid-moe simulate --save-ours` writes one, with `edits` (None removes a key)."""
    import json

    record = {
        "format": 1,
        "scheduler": "queue_aware",
        "cache_policy": "dali_window",
        "cache_options": {"w_size": 4, "u_size": 2, "decay": 0.5},
        "tuned_on": {"trace": "t.safetensors", "hardware": "dali"},
    }
    record.update(edits)
    path = tmp_path / "ours.json"
    path.write_text(json.dumps({k: v for k, v in record.items() if v is not None}))
    return path
