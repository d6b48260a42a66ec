"""Kernel calls timed (COLIBRI_KERNEL_TRACE=1: kernels.take_traced_calls, cpu/gang.h's
CallRecord; experiments/call_trace.py): a traced build records every call in order, with its
kernel, work and threads, and gives the bits of the untraced one; the experiment run end to end
on a tiny checkpoint."""

from __future__ import annotations

import ctypes
import os

import jax
import numpy as np
import pytest
import tiny
from experiment_util import experiment, run_experiment

from colibri import kernels
from colibri.bench.kernel_calls import linear_call
from colibri.config import load_config

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no native kernels here")


def test_a_traced_build_records_every_call_and_gives_the_same_bits():
    lib_path = kernels.build(trace=True)
    lib = ctypes.cdll.LoadLibrary(str(lib_path))
    traced = jax.jit(linear_call(lib_path, "colibri_traced_linear"))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 1024)).astype(np.float32)
    big = rng.standard_normal((1030, 1024)).astype(np.float32)  # 4.2 MB: shared out
    small = rng.standard_normal((8, 64)).astype(np.float32)  # under 512 KiB: the caller alone
    kernels.take_traced_calls(lib)  # (whatever ran before)
    got = np.asarray(traced(x, big)), np.asarray(traced(x[:, :64], small))
    first, second = kernels.take_traced_calls(lib)
    assert len(kernels.take_traced_calls(lib)) == 0  # a take empties the record
    np.testing.assert_array_equal(got[0], np.asarray(kernels.linear(x, big)))
    np.testing.assert_array_equal(got[1], np.asarray(kernels.linear(x[:, :64], small)))

    assert kernels.TRACE_KINDS[int(first["kind"])] == "linear" == kernels.TRACE_KINDS[2]
    assert first["work"] == big.nbytes and second["work"] == small.nbytes
    assert first["enter"] <= first["caller_start"] <= first["caller_end"] <= first["done"]
    assert first["done"] <= second["enter"] <= second["caller_start"] <= second["caller_end"]
    assert second["caller_end"] <= second["done"]
    assert second["threads"] == 1 and second["helper_start"] == second["helper_end"] == 0
    assert 1 <= first["threads"] <= first["items"]
    if first["helper_start"]:  # (a helper that came after the caller had done all takes none)
        assert first["enter"] <= first["helper_start"] <= first["helper_end"] <= first["done"]


def test_a_decode_call_hands_its_work_to_the_helper_waiting_for_it_and_a_prefill_call_not():
    """A helper that has done its share of a call of up to 16 rows (a decode step's) waits for
    the next call (gang.h's `serve`; here up to 0.1 s, COLIBRI_LINGER_NS): the call after it
    finds that helper and hands it its work instead of scheduling a task of the pool. After
    calls of more rows (a prefill's) the helpers go back to the pool at once. The same bits
    either way."""
    import time

    tiles = {**kernels.tuning(), "COLIBRI_LINGER_NS": 10**8}
    lib_path = kernels.build(tiles=tiles, trace=True)
    lib = ctypes.cdll.LoadLibrary(str(lib_path))
    traced = linear_call(lib_path, "colibri_handed_linear")
    rng = np.random.default_rng(1)
    w = rng.standard_normal((2048, 2048)).astype(np.float32) / 45  # 16 MB: shared out

    @jax.jit
    def chain(x):
        for _ in range(6):
            x = traced(x, w)
        return x

    def run(rows):
        x = rng.standard_normal((rows, 2048)).astype(np.float32)
        time.sleep(0.25)  # every helper of the calls before back in the pool
        kernels.take_traced_calls(lib)
        got = np.asarray(chain(x))
        calls = kernels.take_traced_calls(lib)
        want = x
        for _ in range(6):
            want = kernels.linear(want, w)
        np.testing.assert_array_equal(got, np.asarray(want))
        assert len(calls) == 6
        return calls

    prefill = run(32)
    if (prefill["threads"] < 2).any():
        pytest.skip("XLA's pool has one thread here: no helpers")
    assert (prefill["handed"] == 0).all()
    # A helper comes too late for every call of a chain only where the machine is busy: a
    # few chains, until one has a call its helper joined.
    for _ in range(10):
        decode = run(2)
        assert decode["handed"][0] == 0  # no helper waits from before
        joined = np.flatnonzero(decode["helper_start"][:-1] > 0)
        if len(joined):
            break
    else:
        pytest.skip("no helper joined a call here: the cores were busy throughout")
    # The first helper to join a call counts itself as waiting before that call can end: the
    # next call hands it its work. (Later ones may be handed to it before it is back from the
    # core it gave away, where other threads want the cores.)
    assert decode["handed"][joined[0] + 1] == 1


def test_calls_made_at_once_from_several_threads_give_the_bits_of_one_at_a_time():
    """Calls from several threads at once share the helpers waiting for a call among them
    (gang.h's `serve`, `run`): each call's results are those it gives alone."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(2)
    w = rng.standard_normal((1536, 1024)).astype(np.float32)  # 6 MB: shared out
    xs = [rng.standard_normal((r, 1024)).astype(np.float32) for r in (1, 3, 16, 2)]
    call = jax.jit(kernels.linear)
    want = [np.asarray(call(x, w)) for x in xs]

    def calls(i):
        return [np.asarray(call(xs[i % len(xs)], w)) for _ in range(12)]

    with ThreadPoolExecutor(4) as pool:
        for i, got in enumerate(pool.map(calls, range(8))):
            for g in got:
                np.testing.assert_array_equal(g, want[i % len(xs)])


def test_the_engines_own_library_does_not_trace():
    if os.environ.get("COLIBRI_KERNEL_TRACE") == "1":
        pytest.skip("this run traces its kernels")
    with pytest.raises(RuntimeError, match="COLIBRI_KERNEL_TRACE=1"):
        kernels.take_traced_calls()


def test_the_experiment_traces_a_tiny_model(tmp_path):
    ckpt = tiny.build("qwen3_moe", tmp_path / "ckpt")
    out = tmp_path / "trace"
    args = ("--ckpt", str(ckpt), "--tokens", "20", "--prompt", "12", "--rounds", "1")
    res = run_experiment("call_trace", out, *args)["ckpt"]
    (rnd,) = res["rounds"]
    parts = {p["part"]: p for p in rnd["parts"]}
    cfg = load_config(ckpt)
    assert parts["routed experts"]["calls a step"] == len(cfg.moe_layer_ids)
    assert parts["attention"]["calls a step"] == cfg.num_layers
    assert parts[f"linear [{tiny.VOCAB}, 64]"]["calls a step"] == 1  # lm_head
    assert parts["linear [128, 64]"]["calls a step"] == cfg.num_layers  # fused q, k and v
    assert sum(p["calls a step"] for p in parts.values()) * 20 == rnd["calls"]
    # The tiny model's calls are all under ~512 KiB of work: each on the caller alone.
    assert all(p["shared"] == 0 and 0 < p["µs a call"] for p in parts.values())
    # One row: the weight calls' rate is their weights' float32 bytes over their time.
    lm_head = parts[f"linear [{tiny.VOCAB}, 64]"]
    assert lm_head["GB/s"] > 0 and lm_head["/ read"] == pytest.approx(
        lm_head["GB/s"] / max(rnd["read_gb_s"])
    )
    assert np.isnan(parts["attention"]["GB/s"])
    # The step: its time in the traced calls (every call's, parts together) and outside them.
    assert rnd["step_us"] == pytest.approx(1e6 / rnd["tok_s"])
    assert rnd["in_calls_us"] == pytest.approx(sum(p["µs a step"] for p in parts.values()))
    assert 0 < rnd["in_calls_us"] < rnd["step_us"]
    assert rnd["outside_us"] == pytest.approx(rnd["step_us"] - rnd["in_calls_us"])
    assert rnd["roofline_ratio"] == pytest.approx(
        rnd["tok_s"] * res["step_bytes"] / 1e9 / max(rnd["read_gb_s"])
    )
    # Beside it, the most of the roofline the step's parts allow, each the longer of reading
    # its bytes and computing its FLOPs at the cores' ceiling.
    step = res["step_parts"]
    assert set(step) == {"experts", "dense", "attention"}
    assert sum(p["bytes"] for p in step.values()) == pytest.approx(res["step_bytes"])
    assert sum(p["flops"] for p in step.values()) == pytest.approx(res["step_flops"])
    read = max(rnd["read_gb_s"])
    reading = res["step_bytes"] / read

    def bound(rates):
        return reading / sum(max(p["bytes"] / read, p["flops"] / rates[n]) for n, p in step.items())

    ceiling = res["fma_gflop_s"]
    assert rnd["roofline_allowed"] == pytest.approx(bound(dict.fromkeys(step, ceiling)))
    assert 0 < rnd["roofline_allowed"] <= 1
    # And with the weights at the rate the kernels' own tiles computed 16 inputs from DRAM.
    tiles = rnd["tiles_gflop_s"]
    assert tiles > 0
    rates = {"experts": tiles, "dense": tiles, "attention": ceiling}
    assert rnd["tiles_allowed"] == pytest.approx(bound(rates))
    experts = parts["routed experts"]
    assert rnd["experts_gb_s"] == pytest.approx(experts["GB/s"])
    report = out.with_suffix(".md").read_text()
    assert "| routed experts |" in report and "ends apart" in report
    assert "| / roofline |" in report and "| allowed |" in report and "| outside |" in report
    assert "| tiles allow |" in report and "their tiles from DRAM" in report


def test_linear_calls_are_named_by_their_matrices_and_read_as_held():
    """The linear kernel counts a call's work as its matrix in float32 ([O, I], a pass for
    every four rows); the trace names the matrices that make it by their shapes and reads
    their bytes as held: int4 rows of 64 values in two blocks 32 bytes and two scales a row,
    bfloat16 bits two bytes a weight."""
    from colibri import formats

    ct = experiment("call_trace")
    params = {
        "qkv": np.zeros((128, 40), formats.INT4.storage),
        "router": np.zeros((64, 64), formats.BF16.storage),
        "a": np.zeros((64, 96), np.float32),
        "b": np.zeros((96, 64), np.float32),
    }
    got = ct.linear_weights(params, 1, [128 * 64 * 4, 64 * 64 * 4, 64 * 96 * 4, 12345])
    assert got[128 * 64 * 4] == ("linear [128, 64]", 128 * 40)
    assert got[64 * 64 * 4] == ("linear [64, 64]", 64 * 64 * 2)
    assert got[64 * 96 * 4] == ("linear [64, 96] or [96, 64]", 64 * 96 * 4)
    assert 12345 not in got
    assert ct.linear_weights(params, 5, [2 * 128 * 64 * 4])[2 * 128 * 64 * 4][0] == (
        "linear [128, 64]"  # five rows: two passes
    )
    # A row holds its columns as the kernels read them: the values, then a scale (and an
    # offset) per block of a multiple of 8 columns that divides them.
    assert ct.holds(formats.INT4, 40, 64) and ct.holds(formats.INT4, 36, 64)
    assert not ct.holds(formats.INT4, 38, 64) and not ct.holds(formats.INT4, 32, 64)
    assert ct.holds(formats.INT8, 64 + 16, 64) and not ct.holds(formats.INT8, 64 + 12, 64)
    assert not ct.holds(formats.INT4, 32 + 9 * 4, 64)  # nine blocks do not divide 64


def test_many_rounds_detail_the_slowest_and_fastest_read_whose_reads_agree():
    ct = experiment("call_trace")
    reads = [(30.0, 31.0), (50.0, 30.0), (45.0, 46.0), (25.0, 26.0), (60.0, 40.0)]
    rounds = [
        {
            "round": i,
            "read_gb_s": list(r),
            "tok_s": 100.0,
            "roofline_ratio": 0.9,
            "roofline_allowed": 1.0,
            "tiles_gflop_s": 150.0,
            "tiles_allowed": 1.0,
            "step_us": 1e4,
            "in_calls_us": 9e3,
            "outside_us": 1e3,
            "experts_gb_s": 30.0,
            "linear_gb_s": 20.0,
        }
        for i, r in enumerate(reads)
    ]
    # Rounds 1 and 4 met the memory changing speed: not the fastest steady read's.
    assert [r["round"] for r in ct.detailed(rounds)] == [3, 2]
    assert [r["round"] for r in ct.detailed(rounds[:2])] == [0, 1]
    table = ct.summary({"rounds": rounds})
    assert list(table.index) == [3, 0, 2, 1, 4]  # slowest read first
    assert table.loc[1, "/ roofline"] == "0.90*" and table.loc[2, "/ roofline"] == "0.90"
    assert table.loc[2, "experts / read"] == pytest.approx(30.0 / 46.0)
