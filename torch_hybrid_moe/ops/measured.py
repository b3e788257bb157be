"""Warm-up measurements that choose a route (micro-kernels or GEMM, bf16 or fp32), kept on disk per machine.

Which route is fastest depends on the CPU, its thread count and the weight's shape and format, so the kernels
time the candidates on first use (ops/cpu_kernel.py, ops/dense_linear.py). Timed anew in every process, a
noisy moment could flip a near-tie from one run to the next, and the timing costs seconds at every start.
So each result is kept in one JSON file beside the cost profile (profiling.py), keyed by what it depends on:
CPU model, torch version, the kernel's sources and ISA, and the measuring function's arguments (which carry
thread count, shape and format). A result measured while the load average exceeded the core count is used by
its process only. `forget()` (`hybrid-moe profile --refresh`) measures everything again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from .kernel_build import ISA_NAMES, best_isa, source_digest

FORMAT = 2  # bump when what a cached route means changes
T = TypeVar("T")


def cache_dir() -> Path:
    """Where measurements of this machine live: $XDG_CACHE_HOME/torch_hybrid_moe or ~/.cache/torch_hybrid_moe."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "torch_hybrid_moe"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (Linux sysfs), or 256 MiB where it cannot be read: a measurement that must see
    weights streamed from DRAM, as a real layer's are, spreads them over more than this."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text().strip()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=256 * 2**20)


def routes_file() -> Path:
    """This machine's file of measured routes (its name digests CPU model, torch version, the kernel's sources and
    the ISA it runs at: a changed kernel measures again)."""
    key = {
        "format": FORMAT,
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "kernel": source_digest(),
        "isa": ISA_NAMES.get(best_isa(), "none"),
    }
    return cache_dir() / f"routes-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]}.json"


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except (OSError, ValueError) as err:
        warnings.warn(f"cached routes {path} are unusable ({err}): measuring again", stacklevel=3)
        return {}
    return data if isinstance(data, dict) else {}


def measured(
    encode: Callable[[T], Any] = lambda v: v, decode: Callable[[Any], T] = lambda v: v
) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """A measuring function's results cached in this process and in this machine's routes file, per arguments.
    `encode` / `decode` turn a result into JSON and back; a stored value `decode` rejects is measured again."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.cache
        def cached(*args: Any) -> T:
            entry = f"{fn.__module__}.{fn.__qualname__}{args!r}"
            path = routes_file()
            stored = _read(path)
            if entry in stored:
                try:
                    return decode(stored[entry])
                except (TypeError, ValueError, IndexError, KeyError):  # a hand-edited or corrupted entry
                    pass
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
            value = fn(*args)
            cores = os.cpu_count() or 1
            if load is not None and load > cores:  # other work skewed the timing: for this process only
                warnings.warn(
                    f"route not cached: load average {load:.1f} above the {cores} cores while measuring; "
                    "the next process measures it again",
                    stacklevel=2,
                )
                return value
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                stored = {**_read(path), entry: encode(value)}  # another process may have added routes meanwhile
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(stored, indent=1, sort_keys=True))
                tmp.replace(path)
            except OSError as err:
                warnings.warn(f"route not cached: cannot write {path} ({err})", stacklevel=2)
            return value

        cached.__doc__ = fn.__doc__
        return cached

    return wrap


def count(value: Any) -> int:
    """A stored token count, or ValueError (a hand-edited or corrupted file must not choose a route)."""
    if type(value) is not int or value < 0:
        raise ValueError(f"not a token count: {value!r}")
    return value


def flag(value: Any) -> bool:
    if type(value) is not bool:
        raise ValueError(f"not a flag: {value!r}")
    return value


def forget() -> None:
    """Drop this machine's measured routes, on disk (they are measured again by the next process to need them)."""
    routes_file().unlink(missing_ok=True)
