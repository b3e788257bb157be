"""Build the C++ CPU side: the expert kernel (`csrc/moe_cpu.cpp`) with its AMX tiles for prefill
(`csrc/amx_gemm.cpp`) and the decode attention kernels (`csrc/attention_kernel.h`; MLA's absorbed form in
`csrc/moe_cpu.cpp`), the table of layers whose experts all run on the CPU behind the `hybrid_moe::cpu_moe` op
(`csrc/cpu_layers.cpp`), greedy decoding's argmax (`csrc/greedy.cpp`), and the CUDA host-function bridge that runs the
kernel from inside captured graphs (`csrc/host_bridge.cpp`).

The kernel is compiled on first use with torch's own extension builder (g++ and ninja; no CUDA toolkit),
once per machine and torch version, and cached under torch's extensions directory. Where it cannot be
built (no compiler) the CPU experts fall back to the per-expert torch loop with one warning. A build lock left by a
process killed while building (Ctrl-C during the first run) is removed at once: torch's loader would wait on it
forever, saying nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

_CSRC = Path(__file__).parent / "csrc"
_COMPILED = tuple(
    _CSRC / name
    for name in ("module.cpp", "moe_cpu.cpp", "amx_gemm.cpp", "cpu_layers.cpp", "greedy.cpp", "host_bridge.cpp")
)
_HEADERS = ("moe_cpu.h", "amx_gemm.h", "rows_kernel.h", "attention_kernel.h")
_SOURCES = (*_COMPILED, *(_CSRC / name for name in _HEADERS))
ISA_NAMES = {0: "generic", 1: "avx2", 2: "avx512"}
_CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=fast")
# libstdc++ named as a shared library: a compiler set up to link it statically (the H200 box's /opt/gcc g++ does)
# puts a second copy of it in the kernel beside the one torch loaded, and every message the kernel formats then
# breaks: on that box the process crashed in the stream code, here the stream stops at the first number.
_LDFLAGS = ("-fopenmp", "-lstdc++")


@functools.cache
def source_digest() -> str:
    """What the compiled kernel is: its sources, flags and torch's version (its build's name; the measured routes'
    key)."""
    what = b"".join(p.read_bytes() for p in _SOURCES) + " ".join((*_CFLAGS, *_LDFLAGS, torch.__version__)).encode()
    return hashlib.sha256(what).hexdigest()[:12]


@functools.cache
def extension() -> ModuleType | None:
    """The compiled kernel module, or None (with a warning) when this machine cannot build it."""
    if os.environ.get("HYBRID_MOE_NO_KERNEL"):
        return None
    from torch.utils import cpp_extension

    name = f"hybrid_moe_cpu_{source_digest()}"
    try:  # torch's private helper: where it is missing or changed, the build goes on without the lock check
        build_dir: Path | None = Path(cpp_extension._get_build_directory(name, verbose=False))
    except (AttributeError, TypeError, OSError):
        build_dir = None
    with contextlib.nullcontext() if build_dir is None else sole_builder(build_dir):
        if build_dir is not None and not (build_dir / f"{name}.so").exists():
            print(f"torch_hybrid_moe: compiling the CPU kernel into {build_dir} (once; a few minutes)", file=sys.stderr)
        try:
            return cpp_extension.load(
                name=name,
                sources=[str(p) for p in _COMPILED],
                extra_cflags=list(_CFLAGS),
                extra_ldflags=list(_LDFLAGS),
                verbose=False,
            )
        except Exception as err:
            warnings.warn(
                f"torch_hybrid_moe: CPU expert kernel unavailable ({err}); using the per-expert torch loop",
                RuntimeWarning,
                stacklevel=2,
            )
            return None


@contextlib.contextmanager
def sole_builder(build_dir: Path) -> Iterator[None]:
    """Held while torch's loader checks or builds the kernel in `build_dir`: an flock, which the OS drops when its
    process dies. Every process loading the kernel holds it, so a torch `lock` file found under it was left by a
    build that was killed; it goes (with a warning) instead of hanging the loader. Another process building now
    is waited for, saying so."""
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(build_dir / "builder.flock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # a directory it cannot write to: torch's loader says so itself
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(
                f"torch_hybrid_moe: waiting for another process building the CPU kernel in {build_dir}", file=sys.stderr
            )
            fcntl.flock(fd, fcntl.LOCK_EX)
        lock = build_dir / "lock"
        if lock.exists():
            lock.unlink(missing_ok=True)
            warnings.warn(
                f"torch_hybrid_moe: removed {lock}, a build lock left by an interrupted build",
                RuntimeWarning,
                stacklevel=3,
            )
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock


@functools.cache
def best_isa() -> int:
    """Highest ISA level the kernel runs at on this CPU (0 generic, 1 AVX2 + FMA, 2 AVX-512 with VNNI); -1: none."""
    ext = extension()
    return -1 if ext is None else int(ext.best_isa())
