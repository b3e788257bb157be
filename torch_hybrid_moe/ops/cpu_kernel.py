"""Build and call the C++ CPU side: the expert kernel (`csrc/moe_cpu.cpp`) and the CUDA host-function
bridge that runs it from inside captured graphs (`csrc/host_bridge.cpp`).

The kernel is compiled on first use with torch's own extension builder (g++ and ninja; no CUDA toolkit),
once per machine and torch version, and cached under torch's extensions directory. Where it cannot be
built (no compiler) the CPU experts fall back to the per-expert torch loop with one warning.
"""

from __future__ import annotations

import functools
import hashlib
import os
import warnings
from pathlib import Path
from types import ModuleType

import torch

_CSRC = Path(__file__).parent / "csrc"
_COMPILED = (_CSRC / "module.cpp", _CSRC / "moe_cpu.cpp", _CSRC / "host_bridge.cpp")
_SOURCES = (*_COMPILED, _CSRC / "moe_cpu.h", _CSRC / "rows_kernel.h")
ISA_NAMES = {0: "generic", 1: "avx2", 2: "avx512"}


@functools.cache
def extension() -> ModuleType | None:
    """The compiled kernel module, or None (with a warning) when this machine cannot build it."""
    if os.environ.get("HYBRID_MOE_NO_KERNEL"):
        return None
    from torch.utils import cpp_extension

    digest = hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES) + torch.__version__.encode()).hexdigest()[:12]
    try:
        return cpp_extension.load(
            name=f"hybrid_moe_cpu_{digest}",
            sources=[str(p) for p in _COMPILED],
            extra_cflags=["-O3", "-fopenmp", "-ffp-contract=fast"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as err:  # noqa: BLE001 - any build failure means: use the torch loop
        warnings.warn(f"torch_hybrid_moe: CPU expert kernel unavailable ({err}); using the per-expert torch loop",
                      RuntimeWarning, stacklevel=2)
        return None


@functools.cache
def best_isa() -> int:
    """Highest ISA level the kernel runs at on this CPU (0 generic, 1 AVX2 + FMA, 2 AVX-512); -1: no kernel."""
    ext = extension()
    return -1 if ext is None else int(ext.best_isa())


def _level(isa: int | None) -> int:
    """The ISA level to run at: the CPU's best, or one below it (for tests)."""
    level = best_isa() if isa is None else isa
    if not 0 <= level <= best_isa():
        raise ValueError(f"ISA level {level} not available here (best: {best_isa()})")
    return level


def moe_experts(
    hidden: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    out: torch.Tensor,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    isa: int | None = None,
) -> None:
    """out[t] += sum_k weights[t, k] * FFN_{ids[t, k]}(hidden[t]); `isa` below the CPU's best is for tests."""
    level = _level(isa)
    extension().moe_experts(
        hidden.contiguous(), ids.long().contiguous(), weights.float().contiguous(), gate_up, gate_up_scale,
        down, down_scale, level, out,
    )


def dense_matvec(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                 isa: int | None = None) -> torch.Tensor:
    """x [T, K] @ weight.T in fp32: a bf16 / fp16 / fp32 weight [N, K], or int8 [N, K] / packed int4 [N, K / 2]
    with fp32 group scales [N, K / group] (ops/quantize.py), streaming the weight once per few tokens."""
    level = _level(isa)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    extension().dense_matvec(x.contiguous(), weight, scale, level, out)
    return out
