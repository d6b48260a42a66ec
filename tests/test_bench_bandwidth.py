"""The bandwidth probe's arithmetic rate (colibri.bench.bandwidth.tiles_rate): the rate of runs
that fault no page in, as the engine's decode steps fault none."""

from __future__ import annotations

import time

import pytest

from colibri import kernels
from colibri.bench import bandwidth


def test_tiles_rate_keeps_only_runs_that_fault_no_page_in(monkeypatch):
    # Runs that fault pages in are slow (here: 0.04 s against 0.01): the rate is a fast run's.
    runs = iter([(0.02, 9), (0.04, 8), (0.01, 0), (0.04, 7), (0.01, 0)] + [(0.04, 5)] * 10)
    faults = [0]
    made = []

    def run(x, ws):
        took, faulted = next(runs)
        made.append(took)
        time.sleep(took)
        faults[0] += faulted
        return x

    monkeypatch.setattr(bandwidth, "_linear_over", run)
    monkeypatch.setattr(bandwidth, "_minor_faults", lambda: faults[0])
    monkeypatch.setattr(kernels, "available", lambda: True)
    a = bandwidth.probe_array(1 / 256)
    rate = bandwidth.tiles_rate(a, 512, rows=16, repeats=2, chunk_rows=256)
    flops = 16 * 2 * a.size // (256 * 512) * 256 * 512
    assert made == [0.02, 0.04, 0.01, 0.04, 0.01]  # compiled, then until two faulted nothing
    assert flops / 0.019 / 1e9 < rate <= flops / 0.01 / 1e9
    # Where every run faults, the best of them after the first (which compiles).
    runs = iter([(0.01, 0)] + [(0.02, 1)] * 20)
    made.clear()
    rate = bandwidth.tiles_rate(a, 512, rows=16, repeats=2, chunk_rows=256)
    assert len(made) == 11 and flops / 0.029 / 1e9 < rate <= flops / 0.02 / 1e9


@pytest.mark.skipif(not kernels.available(), reason="the native kernels' linear calls")
def test_tiles_rate_is_the_16_row_linear_kernels_rate():
    a = bandwidth.probe_array(1 / 32)
    rate = bandwidth.tiles_rate(a, 512, rows=16, repeats=2, chunk_rows=1024)
    assert 0 < rate < 10 * kernels.fma_peak(16)


@pytest.mark.skipif(not kernels.available(), reason="the native kernels' linear calls")
def test_the_probe_times_the_16_row_kernel_on_the_rows_it_is_given():
    bw = bandwidth.memory_bandwidth(gib=1 / 32, repeats=1, columns=(512, 768))
    assert set(bw["kernel_16_gflop_s_at"]) == {"512", "768"}
    assert all(r > 0 for r in bw["kernel_16_gflop_s_at"].values())
    assert bandwidth.memory_bandwidth(gib=1 / 64, repeats=1)["kernel_16_gflop_s_at"] == {}


def test_the_peers_16_row_bound_is_the_steps_parts_at_the_probes_rates():
    from experiment_util import experiment

    from colibri.bench.accounting import f32_step_parts, part_bound
    from colibri.bench.shapes import SHAPES
    from colibri.config import config_from_dict
    from colibri.synth import hf_config

    peers = experiment("bench_peers")
    cfg = config_from_dict(hf_config(SHAPES["qwen3_moe"]))
    args = type("Args", (), {"prompt": 128, "tokens": 64})()
    run = {"distinct_experts_16": [18.0] * cfg.num_layers}
    probe = {"gb_s": 33.0, "kernel_16_gflop_s_at": {"768": 180.0}, "fma_peak_gflop_s": 230.0}
    parts = f32_step_parts(cfg, run["distinct_experts_16"], 16, 128, 64)
    rates = {"experts": 180.0, "dense": 180.0, "attention": 230.0}
    bound = peers.rows_16_bound(cfg, run, probe, args)
    assert bound == pytest.approx(part_bound(parts, 33.0, rates)) and 0 < bound <= 1
    # A faster memory leaves the weights' arithmetic longer than their reads: a lower bound.
    assert peers.rows_16_bound(cfg, run, {**probe, "gb_s": 60.0}, args) < bound
    assert peers.rows_16_bound(cfg, run, {**probe, "kernel_16_gflop_s_at": {}}, args) is None
