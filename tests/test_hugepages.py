"""Expert stacks on 2 MiB pages: written in place, taken by JAX without a copy, same values."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from colibri import hugepages
from colibri.checkpoint import Checkpoint
from colibri.config import load_config
from colibri.engine.model import load_model
from colibri.hugepages import HUGE
from colibri.synth import SynthSpec, synthesize
from colibri.weights import expert_slab, load_experts, read_expert


def thp_mode() -> str:
    """The bracketed word of /sys/kernel/mm/transparent_hugepage/enabled ('' if none)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else ""


huge_pages_given = pytest.mark.skipif(
    not sys.platform.startswith("linux") or thp_mode() not in ("always", "madvise"),
    reason="no transparent huge pages for advised memory on this machine",
)


@huge_pages_given
def test_empty_is_aligned_and_backed_by_huge_pages_once_written():
    a = hugepages.empty((3, 1024, 1024), np.float32)  # 12 MiB
    assert a.shape == (3, 1024, 1024) and a.dtype == np.float32 and a.flags.c_contiguous
    assert a.ctypes.data % HUGE == 0
    assert hugepages.huge_bytes([(a.ctypes.data, a.nbytes)]) == 0  # nothing touched yet
    a[:] = 1.5
    assert hugepages.huge_bytes([(a.ctypes.data, a.nbytes)]) == a.nbytes
    # JAX on the CPU keeps using this memory (no copy of the weights), with the same values.
    x = jax.device_put(a)
    assert x.unsafe_buffer_pointer() == a.ctypes.data
    shape = a.shape
    del a  # the JAX array keeps the mapping alive
    gc.collect()
    np.testing.assert_array_equal(np.asarray(x * 2), np.full(shape, 3.0, np.float32))


@huge_pages_given
def test_populate_faults_pages_in_beside_the_writer_without_writing():
    arrays = [hugepages.empty((4, 1024, 1024), np.float32) for _ in range(6)]  # 6 x 16 MiB
    thread = hugepages.populate(arrays)
    assert thread is not None
    arrays[0][:] = 7.0  # written while the thread faults the same memory in
    thread.join(timeout=60)
    assert not thread.is_alive()
    for a in arrays:
        assert hugepages.huge_bytes([(a.ctypes.data, a.nbytes)]) == a.nbytes
    assert (arrays[0] == 7.0).all()
    assert not arrays[5].any()  # faulted in, never written: zeros


def test_small_arrays_and_the_off_switch_get_plain_numpy(monkeypatch):
    small = hugepages.empty((100, 100), np.float32)
    assert small.shape == (100, 100) and small.base is None  # np.empty's own memory
    monkeypatch.setenv("COLIBRI_HUGE_PAGES", "0")
    big = hugepages.empty((4, HUGE // 4), np.float32)
    assert big.base is None  # np.empty's own memory, not a mapping advised for huge pages
    assert hugepages.populate([big]) is None


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    """A checkpoint whose expert stacks (8 x 512 x 256) and embeddings (4096 x 256) each take
    4 MiB: room for huge pages."""
    spec = SynthSpec(layers=1, experts=8, top_k=2, hidden=256, moe_ff=512, vocab=4096)
    return synthesize(spec, tmp_path_factory.mktemp("m"), progress=False)


@huge_pages_given
def test_loaded_expert_stacks_are_on_huge_pages_with_the_checkpoint_values(ckpt_dir):
    ckpt, cfg = Checkpoint(ckpt_dir), load_config(ckpt_dir)
    stacks = load_experts(ckpt, cfg, cfg.moe_layer_ids[0])
    for i, k in enumerate(("gate", "up", "down")):
        a = stacks[k]
        assert a.nbytes == 8 * 512 * 256 * 4 and a.ctypes.data % HUGE == 0
        assert hugepages.huge_bytes([(a.ctypes.data, a.nbytes)]) == a.nbytes
        for e in (0, 7):
            want = read_expert(ckpt, cfg, expert_slab(ckpt, cfg, cfg.moe_layer_ids[0], e))[i]
            np.testing.assert_array_equal(a[e], want)


@huge_pages_given
def test_hold_moves_a_trees_arrays_onto_huge_pages_in_place():
    rng = np.random.default_rng(0)
    tree = {
        "embed": rng.standard_normal((1024, 384), np.float32),  # 1.5 MiB
        "layers": [{"o": rng.standard_normal((384, 384), np.float32), "norm": np.ones(384)}],
        "bits": rng.integers(0, 1 << 16, (700, 512), np.uint16),  # not a multiple of 4 KiB
    }
    want = {
        "embed": tree["embed"].copy(),
        "o": tree["layers"][0]["o"].copy(),
        "bits": tree["bits"].copy(),
    }
    norm = tree["layers"][0]["norm"]
    assert hugepages.hold(tree) is tree
    moved = [tree["embed"], tree["layers"][0]["o"], tree["bits"]]
    for a, w in zip(moved, want.values(), strict=True):
        np.testing.assert_array_equal(a, w)
        assert a.dtype == w.dtype and a.ctypes.data % 4096 == 0
    assert tree["layers"][0]["norm"] is norm  # 3 KiB, under a page: left where it is
    assert sum(hugepages.huge_bytes([(a.ctypes.data, a.nbytes)]) for a in moved) >= HUGE
    x = jax.device_put(tree["embed"])  # JAX takes the memory as it is
    assert x.unsafe_buffer_pointer() == tree["embed"].ctypes.data


def test_hold_leaves_trees_under_a_huge_page_alone():
    tree = {"w": np.ones((256, 256), np.float32)}  # 256 KiB
    w = tree["w"]
    assert hugepages.hold(tree)["w"] is w


@huge_pages_given
def test_a_loaded_models_dense_weights_are_on_huge_pages(ckpt_dir):
    model = load_model(ckpt_dir, progress=False)
    for name in ("embed", "lm_head"):
        b = model.params[name].addressable_shards[0].data
        assert hugepages.huge_bytes([(b.unsafe_buffer_pointer(), b.nbytes)]) > 0, name
