"""The scheduler in-process: exact batching, prefix reuse, limits, refusals, failures, reports."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colibri import kernels
from colibri.engine.generate import generate_ids
from colibri.engine.kvstore import KVStore
from colibri.engine.model import load_model
from colibri.engine.runner import Runner
from colibri.engine.scheduler import (
    Accepted,
    Failed,
    Finished,
    GenRequest,
    HitsTick,
    Scheduler,
    SchedulerConfig,
    Token,
    entropy_bits,
)
from colibri.experts.stats import RepinEvent

CAP = 128  # as in the engine tests, so compiled programs are shared through the cache
PROMPTS = [
    "def add(a, b):",
    "The quick brown fox jumps",
    "Der schnelle",
    "emoji 🐦 colibrì — naïve",
]


@pytest.fixture(scope="module")
def model(checkpoints):
    return load_model(checkpoints("qwen3_moe"), progress=False)


@pytest.fixture(scope="module")
def reference(model):
    """Greedy ids of a prompt alone on one slot."""
    runner = Runner(model, slots=1, capacity=CAP)
    memo: dict = {}

    def ids(prompt: tuple[int, ...], n: int) -> list[int]:
        key = (prompt, n)
        if key not in memo:
            toks = generate_ids(runner, list(prompt), n, stop_ids=model.cfg.eos_token_ids)
            memo[key] = list(toks)
        return memo[key]

    return ids


def _sched(model, slots: int = 4, kv_store=None, **config) -> Scheduler:
    config.setdefault("stop_ids", model.cfg.eos_token_ids)
    runner = Runner(model, slots=slots, capacity=CAP)
    return Scheduler(runner, model.tokenizer.token_bytes, SchedulerConfig(**config), kv_store)


def _req(model, rid: int, slot: int, prompt: str, max_tokens: int = 10, **kw) -> GenRequest:
    return GenRequest(rid, slot, tuple(model.tokenizer.encode(prompt)), max_tokens, **kw)


def _run(sched: Scheduler, *reqs: GenRequest, max_steps: int = 500) -> list:
    events = [ev for r in reqs for ev in sched.submit(r)]
    for _ in range(max_steps):
        if not sched.busy:
            return events
        events += sched.step()
    raise AssertionError("scheduler did not finish")


def _tokens(events: list, rid: int) -> list[int]:
    return [ev.token for ev in events if isinstance(ev, Token) and ev.id == rid]


def _finished(events: list, rid: int) -> Finished:
    return next(ev for ev in events if isinstance(ev, Finished) and ev.id == rid)


def test_batched_decode_equals_each_prompt_alone(model, reference):
    sched = _sched(model)
    reqs = [_req(model, i + 1, i, p, 12) for i, p in enumerate(PROMPTS)]
    events = [ev for r in reqs[:2] for ev in sched.submit(r)]
    for _ in range(3):  # two requests decode while the others arrive
        events += sched.step()
    events += _run(sched, *reqs[2:])
    for r in reqs:
        assert _tokens(events, r.id) == reference(r.prompt, 12)
    admitted = [ev.id for ev in events if isinstance(ev, Accepted)]
    assert admitted == [1, 2, 3, 4]


def test_prefix_reuse_and_truncation_keep_tokens(model, reference):
    sched = _sched(model)
    a = _req(model, 1, 0, "The quick brown fox", 6)
    events = _run(sched, a)
    assert sched.history(0) == list(a.prompt) + _tokens(events, 1)[:-1]  # the last is not fed
    longer = _req(model, 2, 0, "The quick brown fox jumps over", 6)
    events = _run(sched, longer)
    accepted = next(ev for ev in events if isinstance(ev, Accepted))
    assert accepted.reused_tokens >= len(a.prompt) - 1 > 0
    assert _tokens(events, 2) == reference(longer.prompt, 6)
    other = _req(model, 3, 0, "Permission", 6)
    events = _run(sched, other)
    assert _tokens(events, 3) == reference(other.prompt, 6)


def test_limits_set_length_limited(model, reference):
    sched = _sched(model, ngen=3)
    events = _run(sched, _req(model, 1, 0, "The quick", 10))
    assert len(_tokens(events, 1)) == 3 and _finished(events, 1).report.length_limited
    sched = _sched(model)
    prompt = GenRequest(2, 1, (40,) * (CAP - 4), 100)  # the context leaves room for 4 tokens
    events = _run(sched, prompt)
    n = len(_tokens(events, 2))
    assert n == CAP - len(prompt.prompt) and _finished(events, 2).report.length_limited
    assert sched.history(1) == list(prompt.prompt) + _tokens(events, 2)[:-1]


def test_the_stop_token_ends_a_turn_unsent(model, reference):
    req = _req(model, 1, 0, "Der schnelle", 8)
    greedy = reference(req.prompt, 8)
    at = next(i for i in range(1, 8) if greedy[i] not in greedy[:i])
    sched = _sched(model, stop_ids=(greedy[at],))
    before = sched.runner.stats.counts.copy()  # the model's statistics outlive a scheduler
    other = _req(model, 2, 1, "The quick brown", 12)  # decodes on after request 1 stops
    events = _run(sched, req, other)
    assert _tokens(events, 1) == greedy[:at]
    report = _finished(events, 1).report
    assert report.emitted == at and not report.length_limited
    # Request 1's row in the forward chained behind its stop token was computed for nothing:
    # it is not counted. Fed: each prompt, then every emitted token but a limit's last.
    done = _finished(events, 2).report
    fed = len(req.prompt) + at + len(other.prompt) + done.emitted - done.length_limited
    counted = (sched.runner.stats.counts - before).sum(axis=1)
    assert (counted == fed * model.cfg.moe.top_k).all()


def test_bursts_give_the_tokens_ticks_and_counts_of_single_steps(model, reference):
    """Greedy requests decoded in bursts of several steps a forward give what one step a
    forward gives: tokens, their interleaving, HITS ticks, reports and expert counts; a stop
    token or a limit inside a burst ends its request there, and a request submitted while a
    burst runs joins when it lands. Bursts expected to outlast `burst_ms` are cuttable ones
    (or single steps without `cut_bursts`), and give the same again."""
    first = _req(model, 1, 0, "Der schnelle", 16)
    greedy = reference(first.prompt, 16)  # (without a stop token)
    at = next(i for i in range(4, 16) if greedy[i] not in greedy[:i])
    assert at <= 8  # greedy[0] comes from the prefill, then steps 1 and 2 one a forward (no
    # step time yet): the stop token is inside the 1st burst (steps 3 .. 8)

    def run(burst: int, burst_ms: float = 1e6, cut: bool = True):  # (1e6: whatever they take)
        stop = (greedy[at],)
        limits = {"burst_ms": burst_ms, "full_burst_ms": burst_ms, "cut_bursts": cut}
        sched = _sched(model, slots=3, burst=burst, stop_ids=stop, **limits)
        before = sched.runner.stats.counts.copy()
        calls: list[tuple[int, bool]] = []
        start = sched.runner.decode_async
        sched.runner.decode_async = lambda rows, after=None, steps=1, cuttable=False, **kw: (
            calls.append((steps, cuttable)) or start(rows, after, steps, cuttable, **kw)
        )
        reqs = [first, _req(model, 2, 1, "The quick brown", 11)]
        events = [ev for r in reqs for ev in sched.submit(r)]
        events += sched.step() + sched.step()
        events += _run(sched, _req(model, 3, 2, "def add(a, b):", 13))
        counts = sched.runner.stats.counts - before
        return events, sched.steps, counts, calls

    one, steps1, counts1, calls1 = run(1)
    six, steps6, counts6, calls6 = run(6)
    cut, steps_cut, counts_cut, calls_cut = run(6, burst_ms=0)  # no step is that fast
    assert {c for c, _ in calls1} == {1} and len(calls6) < len(calls1)
    assert max(calls6) == (6, False)  # whole bursts: any length fits in burst_ms
    assert (6, True) in calls_cut and not any(s > 1 and not c for s, c in calls_cut)
    assert {c for c, _ in run(6, burst_ms=0, cut=False)[3][1:]} == {1}
    for events in (six, cut):
        for rid in (1, 2, 3):
            assert _tokens(events, rid) == _tokens(one, rid)
            a, b = _finished(events, rid).report, _finished(one, rid).report
            assert (a.emitted, a.length_limited, a.entropy) == (
                b.emitted,
                b.length_limited,
                b.entropy,
            )
        assert _tokens(events, 1) == greedy[:at]  # its stop token came inside a burst
        together = [ev.id for ev in events if isinstance(ev, Token) and ev.id < 3]
        assert together == [ev.id for ev in one if isinstance(ev, Token) and ev.id < 3]
    for events, steps in ((one, steps1), (six, steps6), (cut, steps_cut)):
        assert sum(isinstance(ev, HitsTick) for ev in events) == steps // 6
    np.testing.assert_array_equal(counts6, counts1)
    np.testing.assert_array_equal(counts_cut, counts1)


def test_a_cut_burst_ends_after_one_step_and_bursts_go_on(model, reference):
    """A cuttable burst cut short (a frame came in: the flag is up) has run its first step;
    the scheduler goes on from there in bursts again (the HITS ticks fall inside them), and
    the tokens, ticks and counts are those of single steps."""
    req = _req(model, 1, 0, "The quick brown", 30)
    config = {"burst": 6, "burst_ms": 0, "full_burst_ms": 0, "stop_ids": ()}
    sched = _sched(model, slots=2, **config)
    before = sched.runner.stats.counts.copy()
    calls: list[tuple[int, bool, int]] = []
    start = sched.runner.decode_async

    def launch(rows, after=None, steps=1, cuttable=False, **kw):
        if len(calls) == 2:  # the third forward: cut as soon as it starts
            kernels.request_cut(True)
        fwd = start(rows, after, steps, cuttable, **kw)
        calls.append((steps, cuttable, fwd.ran()))
        kernels.request_cut(False)
        return fwd

    sched.runner.decode_async = launch
    events = _run(sched, req)
    assert calls[:2] == [(1, False, 1)] * 2  # no step time yet
    assert calls[2] == (6, True, 1)  # cut after its first step
    assert calls[3] == (6, True, 6)
    fed = len(req.prompt) + 30 - 1  # (the last token is never fed)
    counted = (sched.runner.stats.counts - before).sum(axis=1)
    assert (counted == fed * model.cfg.moe.top_k).all()
    assert sum(isinstance(ev, HitsTick) for ev in events) == sched.steps // 6
    assert _tokens(events, 1) == reference(req.prompt, 30)  # (its runner shares the counts)


def test_refusals(model):
    sched = _sched(model, slots=2)
    assert sched.submit(_req(model, 1, 0, "The quick", 20)) == []
    assert sched.submit(_req(model, 1, 1, "x")) == [Failed(1, "DUPLICATE_ID")]
    assert sched.submit(_req(model, 2, 0, "x")) == [Failed(2, "SLOT_BUSY")]
    assert sched.submit(GenRequest(3, 1, (), 5)) == [Failed(3, "EMPTY_PROMPT")]
    assert sched.submit(_req(model, 4, 5, "x")) == [Failed(4, "BAD_REQUEST")]
    too_long = GenRequest(5, 1, (7,) * CAP, 5)
    assert sched.submit(too_long) == [Failed(5, "CONTEXT_EXCEEDED", (str(CAP), str(CAP)))]
    assert sched.cancel(6) == [Failed(6, "NOT_FOUND")]
    assert sched.stop(6) == [Failed(6, "NOT_FOUND")]
    assert sched.cancel(1) == [Failed(1, "CANCELLED")]  # still waiting: no prefill at all
    assert not sched.busy


def test_cancel_and_stop_between_steps(model):
    sched = _sched(model, slots=2)
    sched.submit(_req(model, 1, 0, "The quick", 30))
    sched.submit(_req(model, 2, 1, "Der schnelle", 30))
    events = sched.step() + sched.step()
    assert sched.cancel(1) == [Failed(1, "CANCELLED")]
    stopped = sched.stop(2)
    assert [type(ev) for ev in stopped] == [Finished]
    assert stopped[0].report.emitted == len(_tokens(events, 2)) and not sched.busy
    # the slot keeps what was fed, so the conversation can go on from there
    fed = len(_tokens(events, 1)) - 1  # the last sampled token was never fed
    assert len(sched.history(0)) == len(_req(model, 0, 0, "The quick").prompt) + fed


def test_a_failing_step_ends_its_requests_and_the_scheduler_goes_on(model, reference, monkeypatch):
    sched = _sched(model, slots=2, burst=1)  # one token a forward (bursts: test_bursts_...)
    sched.submit(_req(model, 1, 0, "The quick", 10))
    sched.submit(_req(model, 2, 1, "Der schnelle", 10))
    sched.step()

    def broken(rows, **kw):
        raise RuntimeError("injected")

    monkeypatch.setattr(sched.runner, "decode_async", broken)
    events = sched.step()  # the forward in flight lands; the next one fails to start
    assert [type(ev) for ev in events] == [Token, Token, Failed, Failed]
    assert sorted(ev.id for ev in events[2:]) == [1, 2]
    assert {ev.code for ev in events[2:]} == {"INTERNAL"}
    assert not sched.busy and sched.history(0) == []
    monkeypatch.undo()
    req = _req(model, 3, 0, "The quick", 6)
    assert _tokens(_run(sched, req), 3) == reference(req.prompt, 6)


def test_a_forward_that_fails_while_running_ends_its_requests(model, reference, monkeypatch):
    sched = _sched(model, slots=2)
    sched.submit(_req(model, 1, 0, "The quick", 10))
    sched.step()
    fwd = sched.inflight[1]

    def broken():
        raise RuntimeError("injected")

    monkeypatch.setattr(fwd, "result", broken)
    second = _req(model, 2, 1, "Der schnelle", 4)
    sched.submit(second)  # admitted after the failed forward
    events = sched.step()
    assert events[0] == Failed(1, "INTERNAL") and sched.history(0) == []
    assert _tokens(events + _run(sched), 2) == reference(second.prompt, 4)


def test_reports_hits_and_usage_at_every_turn_end(model):
    sched = _sched(model, slots=2, topk=5, hits_every=4)
    ends = []
    sched.runner.end_turn = lambda: ends.append(1)
    first = _req(model, 1, 0, "The quick", 14)
    events = _run(sched, first, _req(model, 2, 1, "Der", 9))
    steps = sched.steps
    sched.submit(_req(model, 3, 0, "Le renard", 5))
    sched.step()
    sched.cancel(3)
    assert len(ends) == 3  # two DONEs and a cancellation
    ticks = [ev for ev in events if isinstance(ev, HitsTick)]
    assert len(ticks) == steps // 4
    assert all(t.hits.shape == (sched.runner.stats.rows, sched.runner.stats.cols) for t in ticks)
    for ev in events:
        if isinstance(ev, Token):
            lps = [lp for lp, _ in ev.topk]
            assert len(lps) == 5 and lps == sorted(lps, reverse=True)
            assert ev.topk[0][1] == ev.text
    r = _finished(events, 1).report
    assert r.emitted == len(_tokens(events, 1)) and r.prompt_tokens == len(first.prompt)
    assert len(r.entropy) == sched.runner.stats.rows and r.dt > 0
    assert set(r.phases) >= {"t_edisk", "t_ewait", "t_emm", "t_attn", "t_kvb", "t_head"}


def test_repins_surface_after_the_forward_that_made_them(model):
    sched = _sched(model)
    sched.submit(_req(model, 1, 0, "The quick", 5))
    sched.step()
    swap = RepinEvent(layer=1, expert=3, old_tier=1, gpu=0)
    sched.runner.stats.repins.append(swap)  # what the expert store does on a swap
    assert swap in sched.step()
    assert not any(isinstance(ev, RepinEvent) for ev in sched.step())
    sched.stop(1)


def test_sampling_is_seeded_by_seed_and_id(model):
    def sample(seed: int, rid: int) -> list[int]:
        sched = _sched(model, seed=seed)
        req = _req(model, rid, 0, "The quick", 12, temperature=1.0, top_p=0.9)
        return _tokens(_run(sched, req), rid)

    assert sample(0, 5) == sample(0, 5)
    assert sample(0, 5) != sample(0, 6)
    assert sample(0, 5) != sample(1, 5)


def test_greedy_and_sampled_requests_together_are_each_as_alone(model, reference):
    sampled = dict(temperature=1.0, top_p=0.9)
    alone = _tokens(_run(_sched(model), _req(model, 2, 1, "Der", 9, **sampled)), 2)
    sched = _sched(model)
    chained: list[bool] = []
    start = sched.runner.decode_async
    sched.runner.decode_async = lambda rows, after=None, steps=1, cuttable=False, **kw: (
        chained.append(bool(after)) or start(rows, after, steps, cuttable, **kw)
    )
    greedy = _req(model, 1, 0, "The quick", 14)
    events = [ev for ev in sched.submit(greedy)]
    for _ in range(3):  # the greedy request alone: its forwards (steps 1, 2, a burst) chain
        events += sched.step()
    assert chained == [False, True, True]
    events += _run(sched, _req(model, 2, 1, "Der", 9, **sampled))  # now they are not
    assert _tokens(events, 1) == reference(greedy.prompt, 14)
    assert _tokens(events, 2) == alone
    assert chained.count(False) > 2


def test_restored_slots_continue_as_if_never_stopped(model, tmp_path):
    turn = _req(model, 1, 2, "The quick brown fox", 8)
    follow = _req(model, 2, 2, "The quick brown fox jumps over the lazy dog", 8)
    before = _sched(model, kv_store=KVStore(tmp_path, "m"))
    _run(before, turn)
    restored = _sched(model, kv_store=KVStore(tmp_path, "m"))  # a new process, as it were
    assert restored.restore() == len(before.history(2)) > len(turn.prompt)
    got = _run(restored, follow)
    unbroken = _sched(model)
    _run(unbroken, turn)
    expected = _run(unbroken, follow)
    assert _tokens(got, 2) == _tokens(expected, 2)
    reused = [ev.reused_tokens for ev in got if isinstance(ev, Accepted)]
    assert reused == [ev.reused_tokens for ev in expected if isinstance(ev, Accepted)]


def test_entropy_bits():
    counts = np.array([[1, 1, 1, 1], [5, 0, 0, 0], [0, 0, 0, 0], [3, 1, 0, 0]])
    h = entropy_bits(counts)
    assert h[:3] == (2.0, 0.0, 0.0)
    assert math.isclose(h[3], -(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25)))


_op = st.one_of(
    st.tuples(st.just("submit"), st.integers(1, 6), st.integers(0, 2), st.integers(0, 3)),
    st.tuples(st.just("cancel"), st.integers(1, 6)),
    st.tuples(st.just("stop"), st.integers(1, 6)),
    st.tuples(st.just("step"), st.integers(1, 4)),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_op, max_size=25))
def test_every_request_ends_exactly_once(model, ops):
    """Random submits, cancels, stops, steps: a request speaks only while in flight, ends once."""
    sched = _sched(model)
    live: set[int] = set()

    def check(events: list) -> None:
        for ev in events:
            if isinstance(ev, Failed) and ev.code == "NOT_FOUND":
                assert ev.id not in live
            elif isinstance(ev, Failed) and ev.code == "DUPLICATE_ID":
                assert ev.id in live
            elif isinstance(ev, Finished) or isinstance(ev, Failed) and ev.code == "CANCELLED":
                live.remove(ev.id)  # KeyError: ended twice, or never started
            elif isinstance(ev, Accepted | Token):
                assert ev.id in live

    for op in ops:
        if op[0] == "submit":
            _, rid, slot, p = op
            out = sched.submit(_req(model, rid, slot, PROMPTS[p], 1 + 3 * p))
            check(out)
            live |= set() if out else {rid}
        elif op[0] == "step":
            check([ev for _ in range(op[1]) for ev in sched.step()])
        else:
            check(getattr(sched, op[0])(op[1]))
    check(_run(sched))
    assert not live and all(s.owner is None for s in sched.slots)


def test_a_failing_disk_is_reported_once_and_retried(model, tmp_path, monkeypatch):
    """KV and usage writes that fail (ENOSPC) end no turn: one advisory ERROR 0 STATE_WRITE
    for the session, and every later turn end tries again."""
    import errno

    store = KVStore(tmp_path, "m")
    tried = []

    def full(slot, tokens, export):
        tried.append(slot)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "sync", full)
    sched = _sched(model, kv_store=store)
    first = _run(sched, _req(model, 1, 0, "The quick brown fox", 4))
    second = _run(sched, _req(model, 2, 1, "def add(a, b):", 4))
    advisories = [ev for ev in first + second if isinstance(ev, Failed) and ev.id == 0]
    assert advisories == [Failed(0, "STATE_WRITE", ("ENOSPC",))]
    assert [type(ev) for ev in first if getattr(ev, "id", None) == 1][-1] is Finished
    assert any(isinstance(ev, Finished) and ev.id == 2 for ev in second)
    assert tried == [0, 1]
