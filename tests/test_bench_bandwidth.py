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
    assert made == [0.02, 0.04, 0.01, 0.04, 0.01]  # until two runs faulted nothing
    assert flops / 0.019 / 1e9 < rate <= flops / 0.01 / 1e9
    # Where every run faults, the best of them after the first (which compiles).
    runs = iter([(0.03, 1)] + [(0.02, 1)] * 10)
    made.clear()
    rate = bandwidth.tiles_rate(a, 512, rows=16, repeats=2, chunk_rows=256)
    assert len(made) == 10 and flops / 0.029 / 1e9 < rate <= flops / 0.02 / 1e9


@pytest.mark.skipif(not kernels.available(), reason="the native kernels' linear calls")
def test_tiles_rate_is_the_16_row_linear_kernels_rate():
    a = bandwidth.probe_array(1 / 32)
    rate = bandwidth.tiles_rate(a, 512, rows=16, repeats=2, chunk_rows=1024)
    assert 0 < rate < 10 * kernels.fma_peak(16)
