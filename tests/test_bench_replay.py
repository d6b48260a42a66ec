"""Side-by-side runs (colibri.bench.replay.alternate, experiments/bench_kernel_revs.py --probe):
the versions take turns step by step, the probe runs before every pass, and the passes split at
the median of the reads before them."""

from __future__ import annotations

import numpy as np
import pytest
from experiment_util import experiment

from colibri import kernels
from colibri.bench import replay
from colibri.bench.bandwidth import PassProbe


class Done:
    def block_until_ready(self):
        return self


def test_the_versions_take_turns_and_the_probe_runs_before_each_pass():
    seen = []
    calls = {"a": "a", "b": "b"}
    ms = replay.alternate(
        calls,
        lambda v, i: seen.append((v, i)) or Done(),
        steps=3,
        passes=2,
        before_pass=lambda: seen.append("probe"),
    )
    one_pass = ["probe", ("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
    assert seen == one_pass * 2
    assert set(ms) == {"a", "b"} and all(len(t) == 2 and min(t) > 0 for t in ms.values())


@pytest.mark.skipif(not kernels.available(), reason="the probe reads with the native kernels")
def test_the_pass_probe_reads_memory_before_each_pass():
    probe = PassProbe(gib=1 / 64)
    probe()
    probe()
    assert len(probe.rates) == 2 and min(probe.rates) > 0


def test_passes_split_at_the_median_of_their_reads():
    halves = experiment("bench_kernel_revs").by_read_halves
    reads = np.array([30.0, 50.0, 31.0, 48.0, 29.0])
    ratios = np.array([1.00, 0.90, 1.02, 0.92, 0.98])
    slower, faster = halves("olmoe", 1, reads, ratios)
    assert slower["reads"] == "slower" and slower["passes"] == 2 and slower["GB/s"] == "29.0-30.0"
    assert slower["time / base (median of passes)"] == 0.99
    assert faster["passes"] == 3 and faster["GB/s"] == "31.0-50.0"
    assert faster["time / base (median of passes)"] == 0.92
