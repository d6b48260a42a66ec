"""The engine level of the side-by-side benchmarks: one checkpoint loaded twice (or more) under
different settings, the engines decoding bursts in turn; and the table rows of a way of holding
the weights against float32."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from colibri.bench.conversations import BURST, other_conversations, prompt_ids
from colibri.engine.model import load_model
from colibri.engine.runner import Row, Runner
from colibri.formats import Holding

PROMPT = 128
BURSTS = max(2, 144 // BURST)  # per pass and rows, engine level: ~144 steps


def engine_under(ckpt: Path, holding: Holding):
    """(runner, first tokens of 16 conversations) of the checkpoint loaded with its matrices
    held as `holding` allows."""
    model = load_model(ckpt, progress=False, holding=holding)
    runner = Runner(model, slots=16, capacity=PROMPT + 2 * BURSTS * BURST + 8)
    prompt = prompt_ids(model.cfg.vocab_size, PROMPT)
    logits, _ = runner.prefill(0, prompt)
    return runner, [int(np.argmax(logits)), *other_conversations(runner, prompt, 16)]


def engine_level(
    engines: dict, rows: int, passes: int, exact: tuple[str, ...] | None = None
) -> dict[str, list[float]]:
    """Seconds per burst of each engine {name: (runner, first tokens)}, taking turns burst by
    burst; every engine (`exact`: those named) must decode the same tokens."""
    secs = {k: [] for k in engines}
    tokens = {k: [] for k in engines}
    for p in range(passes + 1):  # the first pass compiles and warms up
        for i in range(BURSTS):
            at = PROMPT + (p % 2) * BURSTS * BURST + i * BURST
            for k in list(engines) if i % 2 == 0 else list(engines)[::-1]:
                runner, first = engines[k]
                t = time.perf_counter()
                fwd = runner.decode_async([Row(s, first[s], at) for s in range(rows)], steps=BURST)
                toks = fwd.tokens()
                if p:
                    secs[k].append(time.perf_counter() - t)
                    tokens[k].append(toks.tolist())
    same = [tokens[k] for k in exact or tokens]
    assert all(t == same[0] for t in same), "the engines' tokens differ"
    return secs


def held_rows(name: str, level: str, rows: int, got: dict, gib: dict, column: str) -> list[dict]:
    """Table rows for one model, level and row count: the times `got` of each way of holding
    the weights (float32 first, the baseline), with the experts' GiB `gib` as held."""
    base = np.asarray(got["float32"])
    out = []
    for h, times in got.items():
        t = np.asarray(times)
        med = float(np.median(t))
        out.append(
            {
                "model": name,
                "level": level,
                "rows": rows,
                column: h,
                "routed experts GiB": gib[h],
                "ms a step (median)": med if level == "kernel" else np.nan,
                "tok/s (median burst)": rows * BURST / med if level == "engine" else np.nan,
                "time / float32 (median of pairs)": float(np.median(t / base)),
            }
        )
    return out
