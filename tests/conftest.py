import copy

import pytest
import torch

import torch_hybrid_moe as thm
from torch_hybrid_moe.tiny_models import TINY_ARCHITECTURES, tiny_model

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def reference_models() -> dict[str, torch.nn.Module]:
    """One unpatched fp32 model per architecture; tests patch deep copies, never these."""
    return {arch: tiny_model(arch) for arch in TINY_ARCHITECTURES}


def patched_copy(model: torch.nn.Module, **config) -> torch.nn.Module:
    return thm.patch_model(copy.deepcopy(model), **config)


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
