"""Slot KV files: round trips, appends vs rewrites; torn or corrupted files never load bad data."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colibri.engine.kvstore import KVStore, fingerprint


def _kv(tokens: list[int]) -> dict[str, np.ndarray]:
    """Arrays standing in for a slot's cache: each position's values derive from its token."""
    t = np.asarray(tokens, np.float32).reshape(-1, 1, 1)
    return {
        "0.k": np.broadcast_to(t * 1.5, (len(tokens), 2, 3)).copy(),
        "0.v": np.broadcast_to(-t, (len(tokens), 2, 3)).copy(),
        "1.lat": np.broadcast_to(t[:, 0] + 0.25, (len(tokens), 4)).copy(),
    }


def _export(tokens: list[int]):
    full = _kv(tokens)
    return lambda n: {k: v[:n] for k, v in full.items()}


def _check(kv, tokens: list[int]) -> None:
    assert kv is not None and kv.tokens == tokens
    for name, arr in _kv(tokens).items():
        np.testing.assert_array_equal(kv.arrays[name], arr)


def test_round_trip_append_and_rewrite(tmp_path):
    store = KVStore(tmp_path, "m1")
    assert store.load(0) is None
    store.sync(0, [1, 2, 3], _export([1, 2, 3]))
    _check(KVStore(tmp_path, "m1").load(0), [1, 2, 3])

    inode = store.path(0).stat().st_ino
    size = store.path(0).stat().st_size
    store.sync(0, [1, 2, 3, 4, 5], _export([1, 2, 3, 4, 5]))  # extends: appended in place
    assert store.path(0).stat().st_ino == inode and store.path(0).stat().st_size > size
    _check(KVStore(tmp_path, "m1").load(0), [1, 2, 3, 4, 5])

    store.sync(0, [1, 2, 9], _export([1, 2, 9]))  # a changed prefix: rewritten, then renamed
    assert store.path(0).stat().st_ino != inode
    _check(KVStore(tmp_path, "m1").load(0), [1, 2, 9])
    assert not list(tmp_path.glob("*.tmp"))

    store.sync(0, [], _export([]))
    _check(KVStore(tmp_path, "m1").load(0), [])


def test_slots_are_separate_and_a_foreign_model_is_ignored(tmp_path):
    store = KVStore(tmp_path, "m1")
    store.sync(0, [1, 2], _export([1, 2]))
    store.sync(3, [7, 8, 9], _export([7, 8, 9]))
    _check(KVStore(tmp_path, "m1").load(3), [7, 8, 9])
    assert KVStore(tmp_path, "another model").load(0) is None
    store.path(1).write_bytes(b"not a kv file at all")
    assert KVStore(tmp_path, "m1").load(1) is None


def test_fingerprint_changes_with_the_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 100)
    a = fingerprint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\1" * 100)
    assert fingerprint(tmp_path) != a


def _history(tmp_path) -> tuple[KVStore, list[list[int]]]:
    """A slot file built by appends: the token lists it was synced to, in order."""
    store = KVStore(tmp_path, "m")
    states, tokens = [], []
    for n in (3, 1, 4, 2):
        tokens = tokens + list(range(len(tokens) + 10, len(tokens) + 10 + n))
        store.sync(0, tokens, _export(tokens))
        states.append(tokens)
    return store, states


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cut=st.floats(0, 1))
def test_a_torn_tail_loads_an_earlier_state_and_is_repaired(tmp_path_factory, cut):
    folder = tmp_path_factory.mktemp("torn")
    store, states = _history(folder)
    data = store.path(0).read_bytes()
    store.path(0).write_bytes(data[: int(cut * len(data))])
    kv = KVStore(folder, "m").load(0)
    if kv is None:  # the header itself was cut
        return
    assert kv.tokens in [[], *states]
    _check(kv, kv.tokens)
    repaired = KVStore(folder, "m")
    _check(repaired.load(0), kv.tokens)  # the torn tail was dropped on disk
    more = kv.tokens + [99, 98]
    repaired.sync(0, more, _export(more))  # and appends after it load again
    _check(KVStore(folder, "m").load(0), more)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(at=st.floats(0, 1), xor=st.integers(1, 255))
def test_a_corrupted_byte_never_loads_wrong_data(tmp_path_factory, at, xor):
    folder = tmp_path_factory.mktemp("flip")
    store, states = _history(folder)
    data = bytearray(store.path(0).read_bytes())
    data[min(int(at * len(data)), len(data) - 1)] ^= xor
    store.path(0).write_bytes(bytes(data))
    kv = KVStore(folder, "m").load(0)
    if kv is not None:
        assert kv.tokens in [[], *states]
        _check(kv, kv.tokens)


_WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from colibri.engine.kvstore import KVStore
    store = KVStore(sys.argv[1], "m")
    tokens = []
    print("ready", flush=True)
    while True:
        n = len(tokens)
        tokens = tokens + [(n + i) % 50 for i in range(7)] if n < 700 else tokens[:5]
        full = {"a": np.arange(len(tokens) * 64, dtype=np.float32).reshape(-1, 64)}
        store.sync(0, tokens, lambda n: {k: v[:n] for k, v in full.items()})
    """
)


@pytest.mark.parametrize("delay", [0.05, 0.2, 0.35])
def test_a_killed_writer_leaves_a_loadable_file(tmp_path, delay):
    p = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE)
    assert p.stdout.readline() == b"ready\n"
    time.sleep(delay)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    kv = KVStore(tmp_path, "m").load(0)
    if kv is not None:
        n = len(kv.tokens)
        assert kv.tokens == [i % 50 for i in range(n)]
        want = np.arange(n * 64, dtype=np.float32).reshape(-1, 64)
        np.testing.assert_array_equal(kv.arrays["a"], want)


# ---------------------------------------------------------------------------- a full disk


def _disk_full_after(monkeypatch, budget: int) -> None:
    """Every write in colibri.files stores `budget` bytes, then fails with ENOSPC."""
    import errno

    import colibri.files

    def write_all(fd: int, data: bytes) -> None:
        os.write(fd, bytes(data[:budget]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(colibri.files, "_write_all", write_all)


def test_a_full_disk_keeps_the_last_good_files_and_no_temporary_one(tmp_path, monkeypatch):
    from colibri.experts.usage import read_usage, write_usage

    usage = tmp_path / ".coli_usage"
    counts = np.arange(12).reshape(3, 4)
    write_usage(usage, counts)
    store = KVStore(tmp_path / "kv", "m")
    store.sync(0, [1, 2, 3], _export([1, 2, 3]))
    kv_file = store.path(0).read_bytes()

    _disk_full_after(monkeypatch, 7)
    with pytest.raises(OSError, match="No space"):
        write_usage(usage, counts + 1)
    with pytest.raises(OSError, match="No space"):  # an append: cut back to where it was
        store.sync(0, [1, 2, 3, 4, 5], _export([1, 2, 3, 4, 5]))
    assert store.path(0).read_bytes() == kv_file
    with pytest.raises(OSError, match="No space"):  # a rewrite: the old file stays
        store.sync(0, [9, 9], _export([9, 9]))
    assert store.path(0).read_bytes() == kv_file
    assert (read_usage(usage, 3, 4) == counts).all()
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == [
        ".coli_usage",
        store.path(0).name,
    ]
    monkeypatch.undo()  # space again: the next write goes through
    store.sync(0, [1, 2, 3, 4, 5], _export([1, 2, 3, 4, 5]))
    assert KVStore(tmp_path / "kv", "m").load(0).tokens == [1, 2, 3, 4, 5]
