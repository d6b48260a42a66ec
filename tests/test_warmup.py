"""WARMUP: the engine compiles every program traffic can reach up front (after READY), so that
its resident memory is at its working size from the start instead of growing as traffic first
reaches each shape. Here: after the warm-up, runs over every shape (prefill widths at every
context bucket, decode row counts at every position, chained steps, bursts whole and cut, a
scheduler's mixed traffic) compile nothing; the warm-up leaves the cache and the statistics as
they were; and an engine with WARMUP=1 answers at once and says when it is warm."""

from __future__ import annotations

import random
import re
import time

import jax
import numpy as np
import pytest
from engine_util import Mux, Reference, text

from colibri import kernels
from colibri.engine.factory import make_runner
from colibri.engine.runner import PREFILL_CHUNK, Row, Runner
from colibri.engine.scheduler import (
    Failed,
    Finished,
    GenRequest,
    Scheduler,
    SchedulerConfig,
)
from colibri.engine.settings import EngineSettings

CTX, SLOTS = 64, 4
LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # every jit cache miss lowers
_lowered = [0]


def _count(event: str, duration: float, **_) -> None:
    if event == LOWERED:
        _lowered[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count)


def lowerings() -> int:
    """Programs lowered in this process so far (a compile, or a load from the disk cache)."""
    return _lowered[0]


@pytest.fixture(scope="module")
def model_dir(checkpoints):
    return checkpoints("qwen3_moe")


def runner_for(model_dir, tmp_path, slots: int = SLOTS) -> Runner:
    settings = EngineSettings(serve_batch=True, kv_slots=slots, state_dir=str(tmp_path))
    return make_runner(model_dir, settings, CTX)


def expected_programs(slots: int = SLOTS) -> dict[str, int]:
    """What the warm-up of slots x CTX compiles, by kind (context buckets 32 and 64)."""
    native = kernels.available()  # decode attends through the kernel: any context, one program
    rows = {1: 1, 2: 2, 4: 3}[slots]  # row buckets 1, 2, 4
    decode = rows * (1 if native else 2)
    # widths 8, 16, 32 meet contexts 32 and 64; width 64 only 64
    return {"prefill": 7, "decode": decode, "burst": decode * (2 if native else 1)}


def test_the_warm_up_compiles_what_traffic_reaches(model_dir, tmp_path):
    runner = runner_for(model_dir, tmp_path)
    sched = Scheduler(runner, lambda t: bytes([t % 256]), SchedulerConfig())
    names = list(sched.warmup())
    kinds = {k: sum(n.startswith(k + " ") for n in names) for k in ("prefill", "decode", "burst")}
    assert kinds == expected_programs() and len(names) == sum(kinds.values()), names
    before = lowerings()

    # every prefill width at every context bucket it can meet, at offsets within the slot
    for width in (1, 5, 8, 9, 16, 17, 32, 33, 64):
        for end in {min(CTX, 32), CTX} if width <= 32 else {CTX}:
            runner.prefill(0, list(range(1, width + 1)), start=max(0, end - width))
    # decode: every row count at positions in every context bucket, alone and chained
    for n in range(1, SLOTS + 1):
        for pos in (0, 31, 32, 40, CTX - 16):
            rows = [Row(s, 3, pos) for s in range(n)]
            first = runner.decode_async(rows)
            chained = runner.decode_async([Row(s, 0, pos + 1, take=s) for s in range(n)], first)
            chained.result()
            first.result()
            most = SchedulerConfig().burst  # bursts of every length: its program
            burst = runner.decode_async(rows, steps=6, most=most)
            after = [Row(s, 0, pos + 6, take=s) for s in range(n)]
            runner.decode_async(after, burst, steps=5, most=most).result()  # chained behind
            if runner.cuts:
                runner.decode_async(rows, steps=7, cuttable=True, most=most).result()
    # and a scheduler's traffic: sampled and greedy, short and long, arriving over time
    rng, rid, free, owner = random.Random(0), 0, list(range(SLOTS)), {}
    while rid < 120 or sched.busy:
        if rid < 120 and free and rng.random() < 0.4:
            slot, rid = free.pop(rng.randrange(len(free))), rid + 1
            prompt = tuple(rng.randrange(1, 400) for _ in range(rng.choice([1, 4, 12, 30, 50])))
            temp = rng.choice([0.0, 0.0, 0.7])
            owner[rid] = slot
            for ev in sched.submit(GenRequest(rid, slot, prompt, rng.randint(1, 20), temp)):
                free.append(owner.pop(ev.id))
        for ev in sched.step():
            if isinstance(ev, Finished | Failed) and ev.id in owner:
                free.append(owner.pop(ev.id))
    assert lowerings() == before  # nothing new was compiled


def test_the_warm_up_changes_no_cache_and_no_statistic(model_dir, tmp_path):
    """A slot's cached positions and the expert counts are as they were: the decode after a
    warm-up gives the logits it gives without one."""
    prompt = list(range(3, 40))
    outs = []
    for warm in (False, True):
        runner = runner_for(model_dir, tmp_path / str(warm), slots=2)
        logits, _ = runner.prefill(1, prompt)
        lookups = runner.stats.lookups
        if warm:
            assert len(list(runner.warmup(steps=6))) > 0
        assert runner.stats.lookups == lookups
        tok, seq = int(np.argmax(logits)), []
        for i in range(8):
            step, _ = runner.decode([Row(1, tok, len(prompt) + i)])
            seq.append(step[0])
            tok = int(np.argmax(step[0]))
        outs.append(np.stack(seq))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_the_layer_by_layer_path_is_not_warmed(model_dir, tmp_path):
    settings = EngineSettings(serve_batch=True, kv_slots=1, profile=True, state_dir=str(tmp_path))
    assert list(make_runner(model_dir, settings, CTX).warmup(steps=6)) == []


def test_an_engine_with_warmup_answers_at_once_and_says_when_warm(model_dir):
    e = Mux(model_dir, WARMUP="1", KV_SLOTS="2", CTX=str(CTX))
    try:
        e.submit(1, 0, "The quick brown fox", 12)
        e.submit(2, 1, "Permission is hereby", 12, temperature=0.0)
        evs = e.collect(1, 2)
        deadline = time.monotonic() + 120
        while not (done := re.search(r"warm-up: (\d+) programs compiled", e.stderr())):
            assert time.monotonic() < deadline, e.stderr()
            time.sleep(0.1)
        assert e.close() == 0
    finally:
        e.kill()
    ref = Reference(model_dir, CTX)
    assert text(evs, 1) == ref.text("The quick brown fox", 12)
    assert text(evs, 2) == ref.text("Permission is hereby", 12)
    assert int(done.group(1)) == sum(expected_programs(slots=2).values())
    assert "Traceback" not in e.stderr()
    assert PREFILL_CHUNK >= CTX  # (so every prefill width up to CTX is one chunk)
