"""Side-by-side runs (colibri.bench.replay.alternate, experiments/bench_kernel_revs.py --probe):
the versions take turns step by step, the probe runs before every pass, and the passes split at
the median of the reads before them; the routes they replay are the engine's own."""

from __future__ import annotations

import numpy as np
import pytest
import tiny
from experiment_util import experiment

from colibri import kernels
from colibri.bench import anatomy, replay
from colibri.bench.bandwidth import PassProbe
from colibri.config import load_config


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


@pytest.mark.skipif(not kernels.available(), reason="bursts need the native kernels")
def test_recorded_routes_are_the_engines_greedy_steps_one_forward_at_a_time(tmp_path):
    from colibri.engine.model import load_model
    from colibri.engine.runner import Row

    ckpt = tiny.build("qwen3_moe", tmp_path / "ckpt")
    cfg = load_config(ckpt)
    rows, prompt = 2, 12
    routes = replay.record_routes(ckpt, rows, prompt_len=prompt)
    assert routes.shape == (replay.STEPS, len(cfg.moe_layer_ids), rows, cfg.moe.top_k)
    runner, toks = anatomy.conversations(
        load_model(ckpt, progress=False), rows, replay.STEPS, prompt, slots=rows
    )
    for i in range(replay.STEPS):
        logits, step = runner.decode([Row(s, t, prompt + i) for s, t in enumerate(toks)])
        np.testing.assert_array_equal(np.asarray(step)[:, :rows], routes[i])
        toks = np.argmax(np.asarray(logits)[:rows], axis=-1).tolist()
