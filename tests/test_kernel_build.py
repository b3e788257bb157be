"""The kernel build's lock handling (ops/kernel_build.py): torch's loader waits forever on a lock left behind."""

import os
import shutil
import subprocess
import sys
import time

import pytest

from torch_hybrid_moe.ops import kernel_build


def test_a_stale_build_lock_is_removed_with_a_warning(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - kernel_build.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    (tmp_path / "other").touch()
    with pytest.warns(RuntimeWarning, match="interrupted build"):
        assert kernel_build.clear_stale_lock(tmp_path)
    assert not lock.exists() and (tmp_path / "other").exists()


def test_a_recent_lock_or_none_is_left_alone(tmp_path):
    assert not kernel_build.clear_stale_lock(tmp_path)  # no lock
    lock = tmp_path / "lock"
    lock.touch()  # another process building now
    assert not kernel_build.clear_stale_lock(tmp_path)
    assert not kernel_build.clear_stale_lock(tmp_path, now=time.time() + kernel_build.STALE_LOCK_S - 60)
    assert lock.exists()


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the kernel")
def test_a_compiler_that_links_libstdcxx_statically_still_formats_whole_messages(tmp_path):
    """The H200 box's g++ links libstdc++ statically: the kernel then held a second copy beside torch's, and a refusal
    whose message formats a number crashed the process (there) or stopped at the number (here). A one-function
    extension built with the kernel's flags in a child process, with such a compiler, must give its refusal whole (the
    whole kernel built this way took minutes)."""
    compiler = tmp_path / "g++"
    compiler.write_text(f'#!/bin/sh\nexec {shutil.which("g++")} "$@" -static-libstdc++\n')
    compiler.chmod(0o755)
    source = tmp_path / "probe.cpp"  # c10's checks and pybind11 only: torch/extension.h took ~40 s to compile
    source.write_text(
        "#include <c10/util/Exception.h>\n#include <pybind11/pybind11.h>\n"
        'void refuse(int64_t n) { TORCH_CHECK(n % 32 == 0, n, " columns: not a multiple of 32"); }\n'
        'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("refuse", &refuse); }\n'
    )
    refuse = (
        "from torch.utils import cpp_extension\n"
        "from torch_hybrid_moe.ops import kernel_build\n"
        "flags = dict(extra_cflags=list(kernel_build._CFLAGS), extra_ldflags=list(kernel_build._LDFLAGS))\n"
        f"probe = cpp_extension.load('refusal_probe', [{str(source)!r}], **flags)\n"
        "try:\n"
        "    probe.refuse(48)\n"
        "except RuntimeError as err:\n"
        "    print(err)\n"
    )
    env = {**os.environ, "CXX": str(compiler), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    done = subprocess.run([sys.executable, "-c", refuse], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "48 columns: not a multiple of 32" in done.stdout, done.stdout + done.stderr[-2000:]
