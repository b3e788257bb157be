"""The kernel build's lock handling (ops/kernel_build.py): torch's loader waits forever on a lock left behind."""

import os
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
