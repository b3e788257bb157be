"""The kernel build's lock handling (ops/kernel_build.py): torch's loader waits forever on a lock left behind."""

import fcntl
import os
import shutil
import subprocess
import sys
import threading

import pytest

from torch_hybrid_moe.ops import kernel_build


def test_a_lock_a_killed_build_left_is_removed_at_once(tmp_path):
    """A process killed while building (Ctrl-C on the first run) leaves torch's lock file, on which torch's loader
    waits forever; the flock it held went with it, so the next load removes the lock straight away."""
    child = subprocess.Popen([sys.executable, "-c", _HOLD_AND_LOCK, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "building"
    child.kill()
    child.wait()
    (tmp_path / "other").touch()
    with pytest.warns(RuntimeWarning, match="interrupted build"), kernel_build.sole_builder(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert (tmp_path / "other").exists()


_HOLD_AND_LOCK = """
import sys, time
from pathlib import Path
from torch_hybrid_moe.ops import kernel_build
with kernel_build.sole_builder(Path(sys.argv[1])):
    (Path(sys.argv[1]) / "lock").touch()  # what torch's loader makes while it builds
    print("building", flush=True)
    time.sleep(600)
"""


def test_a_build_in_progress_is_waited_for_and_its_lock_left_alone(tmp_path, capfd):
    """While another process builds (holds the flock), a second waits, saying so, and leaves torch's lock to the
    builder."""
    holder = os.open(tmp_path / "builder.flock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)
    (tmp_path / "lock").touch()
    entered = threading.Event()

    def load() -> None:
        with kernel_build.sole_builder(tmp_path):
            entered.set()

    waiter = threading.Thread(target=load)
    waiter.start()
    assert not entered.wait(0.5)
    assert (tmp_path / "lock").exists()
    (tmp_path / "lock").unlink()  # the builder finishes: its lock goes, then its flock
    os.close(holder)
    assert entered.wait(30)
    waiter.join()
    assert "waiting for another process building" in capfd.readouterr().err


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
