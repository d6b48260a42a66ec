"""The piecewise disk reader gives exactly the bytes of a whole read, with or without O_DIRECT."""

from __future__ import annotations

import fcntl
import os
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colibri.checkpoint import Checkpoint, CheckpointError, to_f32
from colibri.config import load_config
from colibri.experts import disk
from colibri.experts.disk import DiskReader
from colibri.formats import BF16_BITS, E4M3, FP8_ROWS
from colibri.synth import SynthSpec, synthesize
from colibri.weights import expert_dtype, expert_stacks, load_experts

# Pieces from one page (every request split many times over) to larger than any range here.
PIECES = [4096, 3 * 4096, 64 << 10, 1 << 20]


def _o_direct_works(path) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except (AttributeError, OSError):
        return False
    return True


@pytest.fixture(scope="module", params=["bf16", "f32", "fp8"])
def ckpt_dir(request, tmp_path_factory):
    # fp8: blocks of 8 over matrices of 48 x 40 and 40 x 48 (partial blocks: tests/test_fp8.py).
    spec = SynthSpec(
        layers=2,
        experts=6,
        top_k=2,
        hidden=48,
        moe_ff=40,
        vocab=300,
        dtype=request.param,
        fp8_block=8,
    )
    return synthesize(spec, tmp_path_factory.mktemp(f"disk-{request.param}"), progress=False)


@pytest.fixture(scope="module")
def truth(ckpt_dir):
    ck, cfg = Checkpoint(ckpt_dir), load_config(ckpt_dir)
    return {i: load_experts(ck, cfg, i) for i in cfg.moe_layer_ids}


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("piece", PIECES)
@pytest.mark.parametrize("coalesce", [True, False])
def test_experts_round_trip_exactly(ckpt_dir, truth, direct, piece, coalesce, monkeypatch):
    if not coalesce:  # one range per matrix, as when an expert's tensors sit apart
        monkeypatch.setattr(disk, "_COALESCE_SLACK", 0)
    ck, cfg = Checkpoint(ckpt_dir), load_config(ckpt_dir)
    reader = DiskReader(ck, cfg, threads=3, direct=direct, piece=piece)
    try:
        slab = reader.slab(cfg.moe_layer_ids[0], 0)
        assert any((t.offset + off) % 4096 for t, off, _ in slab.parts)  # unaligned starts
        futures = {(i, e): reader.submit(i, e) for i in truth for e in range(cfg.moe.num_experts)}
        for (i, e), f in futures.items():
            w = f.result()
            for k, name in enumerate(("gate", "up", "down")):
                assert w[k].dtype == np.float32
                np.testing.assert_array_equal(w[k], truth[i][name][e])
        assert reader.reads == len(futures)
        assert reader.bytes_read == sum(reader.slab(i, e).nbytes for i, e in futures)
        if direct and _o_direct_works(ck.files[0]):
            fd = reader._fd(ck.files[0])
            assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
    finally:
        reader.close()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), piece=st.sampled_from(PIECES), direct=st.booleans())
def test_any_byte_range_matches_a_whole_read(ckpt_dir, data, piece, direct):
    ck, cfg = Checkpoint(ckpt_dir), load_config(ckpt_dir)
    path = data.draw(st.sampled_from(ck.files))
    whole = path.read_bytes()
    start = data.draw(st.integers(0, len(whole) - 1))
    n = data.draw(st.integers(1, len(whole) - start))
    reader = DiskReader(ck, cfg, threads=2, direct=direct, piece=piece)
    try:
        assert reader.read_bytes(path, start, n) == whole[start : start + n]
    finally:
        reader.close()


def test_bfloat16_experts_come_back_as_their_bits(ckpt_dir, truth):
    """Held as bfloat16 bits (weights.expert_dtype), an expert comes back as the stored bits,
    which widen to exactly the float32 weights; a float32 checkpoint cannot be held so."""
    ck, cfg = Checkpoint(ckpt_dir), load_config(ckpt_dir)
    reader = DiskReader(ck, cfg, threads=2, piece=4096, held=BF16_BITS)
    try:
        layer = cfg.moe_layer_ids[-1]
        futures = [reader.submit(layer, e) for e in range(cfg.moe.num_experts)]
        stored = ck.info(reader.slab(layer, 0).parts[0][0].name).dtype
        if stored != "BF16":
            with pytest.raises(CheckpointError, match=f"{stored} tensor cannot be held as bfl"):
                futures[0].result()
            return
        for e, f in enumerate(futures):
            for k, name in enumerate(("gate", "up", "down")):
                bits = f.result()[k]
                assert bits.dtype == np.uint16
                wide = to_f32(bits, "BF16")
                np.testing.assert_array_equal(wide, truth[layer][name][e])
    finally:
        reader.close()


def test_fp8_experts_come_back_as_fp8_rows(ckpt_dir):
    """Held as FP8 rows (weights.expert_dtype of a block-quantized checkpoint), an expert comes
    back as each row's stored e4m3 values followed by its block scales, which widen to exactly
    the dequantized weights; other checkpoints cannot be held so."""
    ck, cfg = Checkpoint(ckpt_dir), load_config(ckpt_dir)
    reader = DiskReader(ck, cfg, threads=2, piece=4096, held=FP8_ROWS)
    try:
        layer = cfg.moe_layer_ids[-1]
        futures = [reader.submit(layer, e) for e in range(cfg.moe.num_experts)]
        stored = ck.info(reader.slab(layer, 0).parts[0][0].name).dtype
        if stored != "F8_E4M3":
            with pytest.raises(CheckpointError, match=f"{stored} tensor cannot be held as FP8"):
                futures[0].result()
            return
        assert expert_dtype(ck, cfg) == FP8_ROWS
        wide = load_experts(ck, cfg, layer)
        rows = load_experts(ck, cfg, layer, out=expert_stacks(cfg, FP8_ROWS, (8, 8)))
        for e, f in enumerate(futures):
            for k, name in enumerate(("gate", "up", "down")):
                got = f.result()[k]
                assert got.dtype == np.uint8
                np.testing.assert_array_equal(got, rows[name][e])
                cols = wide[name].shape[-1]
                bits = got[:, :cols].copy()
                scales = got[:, cols:].copy().view("<f4")
                dequant = E4M3[bits] * np.repeat(scales, 8, axis=1)
                np.testing.assert_array_equal(dequant, wide[name][e])
    finally:
        reader.close()


def test_reading_past_the_end_fails_and_the_reader_goes_on(ckpt_dir):
    ck, cfg = Checkpoint(ckpt_dir), load_config(ckpt_dir)
    path = ck.files[0]
    size = path.stat().st_size
    reader = DiskReader(ck, cfg, threads=2, direct=True, piece=4096)
    try:
        with pytest.raises(CheckpointError, match="file ends"):
            reader.read_bytes(path, size - 10, 5000)
        assert reader.read_bytes(path, size - 10, 10) == path.read_bytes()[-10:]
    finally:
        reader.close()


def test_busy_time_is_the_union_of_reads(ckpt_dir):
    ck, cfg = Checkpoint(ckpt_dir), load_config(ckpt_dir)
    reader = DiskReader(ck, cfg, threads=4, piece=4096)
    try:
        t0 = time.perf_counter()
        for f in [reader.submit(i, e) for i in cfg.moe_layer_ids for e in range(3)]:
            f.result()
        wall = time.perf_counter() - t0
        busy = reader.busy_seconds
        assert 0 < busy <= wall  # overlapping reads count once
        assert busy <= reader.thread_seconds  # t_edisk sums every thread's time
    finally:
        reader.close()


def test_piece_must_be_whole_pages(ckpt_dir):
    ck, cfg = Checkpoint(ckpt_dir), load_config(ckpt_dir)
    with pytest.raises(ValueError, match="piece=1000"):
        DiskReader(ck, cfg, piece=1000)


def test_urgent_pieces_go_first_and_a_promoted_prefetch_joins_them():
    order, started, gate = [], threading.Event(), threading.Event()

    def run(load, *rest):
        if load == "first":
            started.set()
            gate.wait(5)
        order.append(load)

    workers = disk._Workers(1, run)
    try:
        workers.put([("first",)], urgent=False)
        assert started.wait(5)  # the one thread is busy: everything below queues
        workers.put([("p1",), ("p2",), ("p2",)], urgent=False)
        workers.put([("u",)], urgent=True)
        workers.promote("p2")
        gate.set()
    finally:
        workers.close()  # drains the queue first
    assert order == ["first", "u", "p2", "p2", "p1"]


def test_reader_threads_start_with_work_and_leave_when_idle():
    done = threading.Event()
    workers = disk._Workers(3, lambda x: done.set(), idle=0.05)
    assert workers._threads == []  # a reader that never reads holds no thread
    workers.put([(1,)], urgent=True)
    assert done.wait(5)
    deadline = time.monotonic() + 5
    while workers._threads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert workers._threads == []
    done.clear()
    workers.put([(2,)], urgent=True)  # and come back for more
    assert done.wait(5)
    workers.close()
