"""Property tests of the expert store's invariants under random traffic and budgets."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colibri.checkpoint import Checkpoint
from colibri.config import load_config
from colibri.engine.telemetry import Timers
from colibri.experts.budget import TierConfig
from colibri.experts.ram import RamCache
from colibri.experts.stats import TIER_DEVICE, ExpertStats
from colibri.experts.store import ExpertStore
from colibri.synth import SynthSpec, synthesize
from colibri.weights import expert_dtype, expert_stacks, load_experts

E = 8


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    spec = SynthSpec(layers=2, experts=E, top_k=2, hidden=32, moe_ff=16, vocab=300, dtype="bf16")
    return synthesize(spec, tmp_path_factory.mktemp("props"), progress=False)


@pytest.fixture(scope="module")
def truth(ckpt_dir):
    """The experts as the store holds them: this bfloat16 checkpoint's bits."""
    ck, cfg = Checkpoint(ckpt_dir), load_config(ckpt_dir)
    held = expert_dtype(ck, cfg)
    assert held == np.uint16
    return [load_experts(ck, cfg, i, out=expert_stacks(cfg, held)) for i in cfg.moe_layer_ids]


traffic = st.lists(
    st.tuples(st.integers(0, 1), st.sets(st.integers(0, E - 1), min_size=1, max_size=E)),
    min_size=1,
    max_size=12,
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    slots=st.integers(1, E - 1),
    ram=st.integers(0, 6),
    pins=st.integers(0, 2),
    policy=st.sampled_from(["lru", "lfru"]),
    steps=traffic,
)
def test_store_invariants(ckpt_dir, truth, slots, ram, pins, policy, steps):
    cfg = load_config(ckpt_dir)
    eb = 3 * cfg.moe.moe_ff * cfg.hidden * 2  # bfloat16, held as such
    tiers = TierConfig(
        device_bytes=2 * slots * eb,
        ram_bytes=ram * eb,
        pin_bytes=pins * eb,
        policy=policy,
        unified=False,  # a RAM tier of its own, as on a GPU
    )
    store = ExpertStore(Checkpoint(ckpt_dir), cfg, tiers)
    store.stats.counts[:] = np.arange(E)[None]  # some history so pins have something to pick
    pinned_before = [set(s.expert_in[s.pinned]) for s in store.slots]
    timers = Timers()
    for row, needed in steps:
        served = []
        for mapping in store.chunks(row, np.array(sorted(needed)), timers):
            layer = store.slots[row]
            chunk = np.nonzero(mapping >= 0)[0]
            served += chunk.tolist()
            for e in chunk:  # the bytes on device are exactly the checkpoint's
                slot = mapping[e]
                for k in ("gate", "up", "down"):
                    np.testing.assert_array_equal(np.asarray(layer.bufs[k][slot]), truth[row][k][e])
            assert len(chunk) <= layer.n
        assert sorted(served) == sorted(needed)  # every needed expert served exactly once
        for r, s in enumerate(store.slots):
            assert (store.stats.tier[r] == TIER_DEVICE).sum() <= s.n  # capacity never exceeded
            assert set(s.expert_in[s.pinned]) == pinned_before[r]  # pins never evicted
            occupied = s.expert_in[s.expert_in >= 0]
            assert len(set(occupied)) == len(occupied)
            assert all(s.slot_of[e] == i for i, e in enumerate(s.expert_in) if e >= 0)
        assert store.ram.used <= store.ram.budget
        st_ = store.stats
        assert st_.hits + st_.misses == st_.lookups
    store.close()


def test_cpu_slots_are_written_in_place_and_computed_on_as_written(ckpt_dir, truth):
    """On the CPU the slot buffers are host memory the JAX arrays alias: staging writes into
    them (no new device buffer), and a program reading the arrays sees each staged expert."""
    import jax
    import jax.numpy as jnp

    cfg = load_config(ckpt_dir)
    eb = 3 * cfg.moe.moe_ff * cfg.hidden * 2
    store = ExpertStore(Checkpoint(ckpt_dir), cfg, TierConfig(device_bytes=2 * 2 * eb, ram_bytes=0))
    layer = store.slots[0]
    assert layer.host is not None and layer.n == 2
    arrays = dict(layer.bufs)
    total = jax.jit(lambda b, s: jnp.sum(b["down"][s].astype(jnp.float32)))
    for needed in ([0, 1], [2, 3], [5, 1], [7]):
        for mapping in store.chunks(0, np.array(needed), Timers()):
            for e in np.nonzero(mapping >= 0)[0]:
                want = truth[0]["down"][e].view(jnp.bfloat16).astype(np.float32).sum()
                got = total({k: a.view(jnp.bfloat16) for k, a in layer.bufs.items()}, mapping[e])
                np.testing.assert_allclose(float(got), want, rtol=1e-5)
        assert all(layer.bufs[k] is arrays[k] for k in arrays)  # the same arrays, written into
        for k, a in layer.bufs.items():
            assert a.unsafe_buffer_pointer() == layer.host[k].ctypes.data
    store.close()


@given(
    budget=st.integers(0, 10),
    ops=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 4)), max_size=40),
    protect=st.sets(st.integers(0, 5), max_size=3),
)
def test_ram_cache_respects_budget_and_protection(budget, ops, protect):
    cache = RamCache(budget * 4)
    prot = {(0, p) for p in protect}
    for key, size in ops:
        w = tuple(np.zeros(size, np.float32) for _ in range(1)) + (np.zeros(0, np.float32),) * 2
        present = set(cache.keys())
        evicted = cache.put((0, key), w, protect=prot)
        assert cache.used <= cache.budget
        assert not (set(evicted) & prot)
        assert set(evicted) <= present
        assert cache.used == sum(sum(a.nbytes for a in cache.get(k)) for k in cache.keys())


def test_usage_write_is_atomic(tmp_path, monkeypatch):
    import os

    from colibri.experts.usage import read_usage, write_usage

    path = tmp_path / ".coli_usage"
    first = np.array([[0, 3], [5, 0]])
    write_usage(path, first, engine_id=1)
    before = path.read_bytes()

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError):
        write_usage(path, np.array([[9, 9], [9, 9]]))
    assert path.read_bytes() == before  # the old file is whole
    monkeypatch.undo()
    np.testing.assert_array_equal(read_usage(path, 2, 2), first)
    assert read_usage(path, 3, 2).sum() == 0  # another model's shape: ignored


@settings(max_examples=60, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 6), st.integers(1, 3), st.integers(1, 16), st.integers(1, 4)),
    experts=st.integers(1, 12),
    seed=st.integers(0, 2**16),
    masked=st.booleans(),
)
def test_a_burst_is_counted_as_its_steps_one_by_one(shape, experts, seed, masked):
    """ExpertStats.record_steps (a burst's routes at once) counts every kept (step, layer, row,
    choice), marks what each step chose and gives each step's distinct (layer, expert) pairs;
    and record_all, step by step, agrees."""
    rng = np.random.default_rng(seed)
    steps, layers, rows, k = shape
    routes = rng.integers(0, experts, shape).astype(np.int32)
    keep = rng.random((steps, rows)) < 0.6 if masked else np.ones((steps, rows), bool)
    counts = np.zeros((layers, experts), np.int64)
    marks = np.zeros((steps, layers, experts), bool)
    distinct = []
    for s in range(steps):  # the plain count, choice by choice
        seen = set()
        for layer in range(layers):
            for n in np.flatnonzero(keep[s]):
                for e in routes[s, layer, n]:
                    counts[layer, e] += 1
                    marks[s, layer, e] = True
                    seen.add((layer, int(e)))
        distinct.append(len(seen))
    burst, one = ExpertStats(layers, experts), ExpertStats(layers, experts)
    assert burst.record_steps(routes, keep if masked else None).tolist() == distinct
    assert [one.record_all(r[:, keep[s]]) for s, r in enumerate(routes)] == distinct
    for stats in (burst, one):
        np.testing.assert_array_equal(stats.counts, counts)
    np.testing.assert_array_equal(one.take_hits(), counts > 0)
    # the burst's marks step by step: the steps with a row kept, taken a few at a time (the
    # HITS ticks inside it), the rest at the next take
    ran = marks[keep.any(axis=1)]
    cut = len(ran) // 2
    np.testing.assert_array_equal(burst.take_hits(cut), ran[:cut].any(axis=0))
    np.testing.assert_array_equal(burst.take_hits(), ran[cut:].any(axis=0))
    assert not burst.take_hits().any()


def test_experts_on_device_are_computed_while_the_misses_are_still_read(ckpt_dir, truth):
    """A layer needing experts on device and experts on disk gets the ones on device alone
    first, while the disk reads are in flight (held back here until that first chunk is out);
    the misses come next, with the checkpoint's bytes."""
    import threading
    from concurrent.futures import Future

    cfg = load_config(ckpt_dir)
    eb = 3 * cfg.moe.moe_ff * cfg.hidden * 2
    tiers = TierConfig(device_bytes=2 * 4 * eb, ram_bytes=0, unified=False)  # 4 slots a layer
    store = ExpertStore(Checkpoint(ckpt_dir), cfg, tiers)
    timers = Timers()
    for _ in store.chunks(0, np.array([0, 1]), timers):  # experts 0 and 1 now on device
        pass
    gate = threading.Event()
    submit = store.disk.submit

    def held_back(layer: int, expert: int, urgent: bool = True) -> Future:
        inner, outer = submit(layer, expert, urgent), Future()
        threading.Thread(
            target=lambda: (gate.wait(30), outer.set_result(inner.result())), daemon=True
        ).start()
        return outer

    store.disk.submit = held_back
    chunks = store.chunks(0, np.array([0, 1, 5, 6]), timers)
    first = next(chunks)
    assert sorted(np.nonzero(first >= 0)[0]) == [0, 1]  # computed while 5 and 6 are read
    gate.set()
    rest = [m for m in chunks]
    assert [sorted(np.nonzero(m >= 0)[0]) for m in rest] == [[5, 6]]
    slots = store.slots[0]
    for e in (5, 6):
        for k in ("gate", "up", "down"):
            got = np.asarray(slots.bufs[k][rest[0][e]])
            np.testing.assert_array_equal(got, truth[0][k][e])
    store.close()
