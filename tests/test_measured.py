"""ops/measured.py: a warm-up measurement runs once per machine, its result read back from disk by later
processes; a corrupted file, another machine's file or `forget()` measure again."""

import contextlib
import json

import pytest

from torch_hybrid_moe.ops import cpu_kernel, measured


@pytest.fixture(autouse=True)
def _kernel_loaded_first(monkeypatch) -> None:
    """The routes file names the kernel; load it before a test moves XDG_CACHE_HOME, which torch's extension
    builder also reads (it would build the kernel again there). A quiet machine as seen by `measured` (other
    work running beside the tests would keep routes out of the file); tests that want a busy one say so."""
    cpu_kernel.best_isa()
    monkeypatch.setattr(measured.os, "getloadavg", lambda: (0.0, 0.0, 0.0))


def _counting(calls: list, **codec):
    @measured.measured(**codec)
    def measure(shape: tuple[int, int], bits: int) -> int:
        calls.append((shape, bits))
        return shape[0] + bits

    return measure


def test_measured_once_per_machine_and_arguments(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    first = _counting(calls, decode=measured.count)
    assert first((8, 4), 8) == 16 and first((8, 4), 8) == 16 and first((8, 4), 4) == 12
    assert calls == [((8, 4), 8), ((8, 4), 4)]
    later = _counting(calls, decode=measured.count)  # a new process: nothing in memory, the file on disk
    assert later((8, 4), 8) == 16 and later((8, 4), 4) == 12
    assert len(calls) == 2
    measured.forget()
    assert _counting(calls, decode=measured.count)((8, 4), 8) == 16 and len(calls) == 3


@pytest.mark.parametrize("content", ["{not json", json.dumps(["a list"]), "bad value"])
def test_a_corrupted_routes_file_is_measured_again(content, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    _counting(calls, decode=measured.count)((8, 4), 8)
    path = measured.routes_file()
    if content == "bad value":  # a hand-edited entry: a negative token count must not choose a route
        content = json.dumps(dict.fromkeys(json.loads(path.read_text()), -5))
    path.write_text(content)
    with pytest.warns(UserWarning, match="unusable") if content.startswith("{not") else contextlib.nullcontext():
        assert _counting(calls, decode=measured.count)((8, 4), 8) == 16
    assert len(calls) == 2
    assert json.loads(path.read_text())  # rewritten with the fresh value


def test_another_machine_measures_again(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    _counting(calls)((8, 4), 8)
    monkeypatch.setattr(measured, "cpu_model", lambda: "another CPU")
    _counting(calls)((8, 4), 8)
    assert len(calls) == 2 and len(list((tmp_path / "torch_hybrid_moe").glob("routes-*.json"))) == 2


def test_an_unwritable_cache_still_measures(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))  # the cache's parent is a file
    calls = []
    with pytest.warns(UserWarning, match="route not cached"):
        assert _counting(calls)((8, 4), 8) == 16


def test_a_route_measured_under_load_is_not_kept(tmp_path, monkeypatch):
    """Other work on the machine skews the timing: the result serves this process, the next one measures again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(measured.os, "getloadavg", lambda: (99.0, 99.0, 99.0))
    calls = []
    with pytest.warns(UserWarning, match="route not cached: load average 99.0"):
        assert _counting(calls)((8, 4), 8) == 16
    assert not measured.routes_file().exists()
    monkeypatch.setattr(measured.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert _counting(calls)((8, 4), 8) == 16 and len(calls) == 2 and measured.routes_file().exists()


def test_a_truncated_pair_is_measured_again(tmp_path, monkeypatch):
    """A route stored as a pair (cpu_kernel.GemmRoute's form) cut short by hand: measured again, not a crash."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    pair = {"encode": lambda v: [v, 0], "decode": lambda v: measured.count(v[0]) + measured.count(v[1])}
    _counting(calls, **pair)((8, 4), 8)
    path = measured.routes_file()
    path.write_text(json.dumps({k: [16] for k in json.loads(path.read_text())}))
    assert _counting(calls, **pair)((8, 4), 8) == 16 and len(calls) == 2


def test_a_stored_amx_route_is_measured_again_where_amx_is_unusable(monkeypatch):
    """The routes file is keyed by CPU model: the same model under a Linux that refuses the tile state must not be
    handed the AMX route it stored (the kernel would refuse it at the first prefill)."""
    from torch_hybrid_moe.ops import cpu_kernel

    monkeypatch.setattr(cpu_kernel, "amx_fits", lambda hidden_size, inter: False)
    for stored in ("amx", "fastest", 1):
        with pytest.raises(ValueError, match="not a GEMM kernel for this machine"):
            cpu_kernel._stored_kernel(stored)
    assert cpu_kernel._stored_kernel("bf16") == "bf16"
