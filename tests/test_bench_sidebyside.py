"""colibri.bench.sidebyside's table from the runs it makes: each engine's best round, colibri's
rate against the roofline of each round's probe, and the most of that roofline its widening
and its kernels' streaming allow (the workers and the probe stood in for by what they
report)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from colibri.bench import sidebyside


@pytest.mark.parametrize("kernels", [True, False])
def test_rounds_give_roofline_ratios_and_the_widening_bound(monkeypatch, kernels):
    probes = iter([{"gb_s": 40.0}, {"gb_s": 20.0}])
    rates = {"colibri": iter([100.0, 150.0]), "llama.cpp": iter([120.0, 110.0])}
    rates_16 = {"colibri": iter([900.0, 800.0]), "llama.cpp": iter([400.0, 450.0])}

    envs, given = [], []

    def worker(kind, path, prompt, tokens, env=None, conversations=None):
        envs.append((kind, env))
        given.append(conversations)
        res = {
            "decode_tok_s_1": next(rates[kind]),
            "decode_tok_s_16": next(rates_16[kind]),
            "prefill_tok_s": 1.0,
            "peak_rss_mb": 1.0,
            "tokens": [1, 2, 3],
        }
        if kind == "colibri":
            res |= {"held_step_bytes_1": 100e6, "expert_step_bytes_1": 60e6}
            if kernels:
                res["widen_gb_s"] = 24.0
                res["stream_gb_s"] = 15.0
        return res

    monkeypatch.setattr(sidebyside, "run_probe", lambda: next(probes))
    monkeypatch.setattr(sidebyside, "run_worker", worker)
    monkeypatch.setattr(sidebyside, "load_config", lambda p: SimpleNamespace(vocab_size=64))
    rows = sidebyside.side_by_side(
        "m",
        {"colibri (int8 held)": Path("a"), "llama.cpp q8_0": Path("b")},
        rounds=2,
        envs={"colibri (int8 held)": {"COLIBRI_INT8": "1"}},
    )
    assert (
        sorted(envs, key=str)
        == [("colibri", {"COLIBRI_INT8": "1"})] * 2 + [("llama.cpp", None)] * 2
    )
    ours, theirs = rows
    assert ours["decode tok/s (batch 1, best of rounds)"] == 150.0
    assert theirs["colibri / this"] == pytest.approx(150.0 / 120.0)
    # 16 conversations: each engine's best round, whichever round gave its best batch 1; both
    # engines given the same 16 conversations, the first of them the batch-1 prompt.
    assert ours["decode tok/s, 16 conversations (best of rounds)"] == 900.0
    assert theirs["colibri / this, 16 conversations"] == pytest.approx(900.0 / 450.0)
    assert all(c == given[0] for c in given) and len(given[0]) == 16
    assert given[0][0] == sidebyside.prompt_ids(64, 128)
    # Roofline: 40 GB/s over 100 MB is 400 tok/s, 20 GB/s 200 tok/s.
    assert ours["/ roofline, per round (probe GB/s)"] == "0.25 (40.0), 0.75 (20.0)"
    # Widening: 60 MB at 24 GB/s take 2.5 ms a step and the other 40 MB 1 ms at 40 GB/s (0.71
    # of the first round's 2.5 ms roofline at most), 2 ms at 20 (all of the second's 5 ms:
    # 1.00, not 1.11). The rest of the step is read, not widened: it adds to the time.
    want = "0.71, 1.00" if kernels else None
    assert ours["most the widening allows, per round"] == want
    assert theirs["most the widening allows, per round"] is None
    # Streaming: 60 MB at 15 GB/s (4 ms) and the other 40 MB at the probe's rate (1 ms at 40
    # GB/s, 2 at 20): 5 ms against 2.5 (0.50), 6 ms against 5 (0.83).
    want = "0.50 (15.0), 0.83 (15.0)" if kernels else None
    assert ours["most the kernels' streaming allows, per round (their GB/s)"] == want
    assert theirs["most the kernels' streaming allows, per round (their GB/s)"] is None
