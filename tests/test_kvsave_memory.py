"""KVSAVE exports: every length through a few compiled programs, the same arrays as before.

Exporting a slot's first n positions once compiled new XLA programs for each new n (an eager
slice of a new static size), which the process kept: with KVSAVE=1 the engine's RSS grew by
about 3 MB each new length a turn ended at (experiments/kvsave_memory.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import monitoring

from colibri.engine.model import load_model
from colibri.engine.runner import Runner
from colibri.synth import SynthSpec, synthesize

CTX = 256
BUCKETS = (32, 64, 128, 256)  # the sizes an export of up to CTX positions copies out
SPECS = {
    "gqa": SynthSpec(family="qwen3_moe", layers=2, experts=4, top_k=2, hidden=128, kv_heads=2),
    "mla": SynthSpec(family="deepseek_v3", layers=2, experts=4, top_k=2, hidden=128),
}


@pytest.fixture(scope="module", params=sorted(SPECS))
def runner(request, tmp_path_factory):
    """A runner of 2 slots whose cache holds a distinct random value in every element."""
    folder = synthesize(SPECS[request.param], tmp_path_factory.mktemp(request.param), False)
    r = Runner(load_model(folder, progress=False), slots=2, capacity=CTX)
    rng = np.random.default_rng(0)
    r.cache = [
        {k: jnp.asarray(rng.standard_normal(v.shape, np.float32)) for k, v in layer.items()}
        for layer in r.cache
    ]
    return r


def _expected(host: list[dict[str, np.ndarray]], slot: int, n: int) -> dict[str, np.ndarray]:
    """What an export wrote before: position first, whatever the cache's layout."""
    out = {}
    for i, layer in enumerate(host):
        for name, buf in layer.items():
            rows = buf[slot, :, :n].swapaxes(0, 1) if name in ("k", "v") else buf[slot, :n]
            out[f"{i}.{name}"] = np.ascontiguousarray(rows)
    return out


class _Compiles:
    """Counts the XLA programs built (compiled or read from the persistent cache) meanwhile."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __enter__(self):
        self.n = 0
        monitoring.register_event_duration_secs_listener(self._seen)
        return self

    def _seen(self, event: str, duration: float, **_) -> None:
        self.n += event == self.EVENT

    def __exit__(self, *exc):
        monitoring.unregister_event_duration_listener(self._seen)


def test_exports_of_every_length_compile_a_few_programs_and_keep_their_bytes(runner):
    host = jax.device_get(runner.cache)
    lengths = list(range(CTX + 1))
    with _Compiles() as compiles:
        got = {n: runner.export_slot(1, n) for n in lengths}
    assert compiles.n <= len(BUCKETS), f"{compiles.n} programs for {len(lengths)} lengths"
    for n in lengths:
        want = _expected(host, 1, n)
        assert got[n].keys() == want.keys()
        for name, arr in want.items():
            a = got[n][name]
            assert a.dtype == arr.dtype and a.shape == arr.shape and a.flags.c_contiguous
            assert a.tobytes() == arr.tobytes(), (n, name)  # what the KV file holds


def test_an_export_imports_back_into_another_slot(runner):
    kv = runner.export_slot(1, 77)
    runner.import_slot(0, kv)
    back = runner.export_slot(0, 77)
    for name, arr in kv.items():
        np.testing.assert_array_equal(back[name], arr)
    with pytest.raises(IndexError):
        runner.export_slot(2, 5)


def test_imports_write_in_place_through_a_few_programs_and_touch_nothing_else(runner):
    """A restored slot is written into the cache's own memory (the cache donated), not into a
    copy of every layer's whole cache, for every length through a few programs; the other
    slot and the imported positions are exactly as they were exported."""
    other = runner.export_slot(1, CTX)
    before = [b.unsafe_buffer_pointer() for b in jax.tree.leaves(runner.cache)]
    with _Compiles() as compiles:
        for n in (1, 31, 33, 100, 200, CTX):
            kv = runner.export_slot(1, n)
            runner.import_slot(0, kv)
            back = runner.export_slot(0, n)
            for name, arr in kv.items():
                np.testing.assert_array_equal(back[name], arr)
    assert compiles.n <= 2 * len(BUCKETS), f"{compiles.n} programs for 6 lengths"
    assert [b.unsafe_buffer_pointer() for b in jax.tree.leaves(runner.cache)] == before
    for name, arr in runner.export_slot(1, CTX).items():
        np.testing.assert_array_equal(arr, other[name])
    too_long = {k: np.concatenate([a, a[:1]]) for k, a in runner.export_slot(1, CTX).items()}
    with pytest.raises(ValueError, match="do not fit"):
        runner.import_slot(0, too_long)
    with pytest.raises(IndexError):
        runner.import_slot(2, kv)
