"""The scheduler's paths over a scripted runner (tests/fake_runner.py): no model, no JAX work,
so that every path is cheap to reach. What the tokens are is fixed by the fake's rule
(`next_token` over the slot's cache), so a path that feeds a wrong token, position or prefix
shows in the tokens; tests/test_scheduler.py checks the same against a real model."""

from __future__ import annotations

import numpy as np
import pytest
from fake_runner import VOCAB, FakeRunner, Fault, experts, logits_after, next_token
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colibri.engine.kvstore import KVStore
from colibri.engine.sampling import sample
from colibri.engine.scheduler import (
    Accepted,
    Failed,
    Finished,
    GenRequest,
    HitsTick,
    Scheduler,
    SchedulerConfig,
    Token,
)
from colibri.experts.stats import RepinEvent

CAP = 64
A = (1, 2, 3)  # prompts
B = (4, 5)
C = (9, 8, 7, 6, 5, 4, 3, 2, 1, 0)
WHOLE = {"burst_ms": 1e6, "full_burst_ms": 1e6}  # every burst runs whole, chained
CUT = {"burst_ms": 0.0, "full_burst_ms": 0.0}  # every burst is cuttable


def token_bytes(tok: int) -> bytes:
    return b"<%d>" % tok


def make(slots=4, capacity=CAP, chains=True, cuts=True, **config) -> Scheduler:
    runner = FakeRunner(slots, capacity, chains=chains, cuts=cuts)
    return Scheduler(runner, token_bytes, SchedulerConfig(**config))


def reference(prompt, n: int, stop=()) -> list[int]:
    """Greedy tokens of a prompt by the fake's rule, up to a stop token or n of them."""
    ctx, out = list(prompt), []
    while len(out) < n and (tok := next_token(ctx)) not in stop:
        out.append(tok)
        ctx.append(tok)
    return out


def expected(req: GenRequest, config: SchedulerConfig, capacity: int) -> tuple[list[int], bool]:
    """The tokens a request gets left alone, drawn as the scheduler draws them (greedy or from
    (seed, id)), and whether a limit (max_tokens, NGEN, the context) ended it."""
    limit = min(capacity - len(req.prompt), req.max_tokens, config.ngen or req.max_tokens)
    rng = np.random.default_rng([config.seed, req.id])
    ctx, out = list(req.prompt), []
    while True:
        tok = sample(logits_after(ctx), req.temperature, req.top_p, rng)
        if tok in config.stop_ids:
            return out, False
        out.append(tok)
        ctx.append(tok)
        if len(out) >= limit:
            return out, True


def run(sched: Scheduler, *reqs: GenRequest, max_steps: int = 500) -> list:
    events = [ev for r in reqs for ev in sched.submit(r)]
    for _ in range(max_steps):
        if not sched.busy:
            assert sched.runner.misuse == []
            return events
        events += sched.step()
    raise AssertionError("scheduler did not finish")


def tokens(events: list, rid: int) -> list[int]:
    return [ev.token for ev in events if isinstance(ev, Token) and ev.id == rid]


def finished(events: list, rid: int) -> Finished:
    (done,) = [ev for ev in events if isinstance(ev, Finished) and ev.id == rid]
    return done


def kinds(events: list) -> list[str]:
    """Events as short names: "A1" accepted 1, "T1" token of 1, "F1" finished, "H" tick, and
    a Failed as "X1:CODE"."""
    names = {Accepted: "A", Token: "T", Finished: "F", HitsTick: "H", RepinEvent: "R"}
    out = []
    for ev in events:
        if isinstance(ev, Failed):
            out.append(f"X{ev.id}:{ev.code}")
        else:
            out.append(names[type(ev)] + str(getattr(ev, "id", "")))
    return out


def cache_agrees(sched: Scheduler) -> bool:
    """The scheduler's idea of each slot's cache is what the runner holds."""
    runner = sched.runner
    return all(
        runner.cache[i][: len(sched.history(i))] == sched.history(i) for i in range(runner.slots)
    )


# ---------------------------------------------------------------------------- one request


@pytest.mark.parametrize("mode", ["steps", "chained", "bursts", "cut", "uncut", "unasked"])
def test_a_request_alone_gets_the_model_tokens_and_its_report(mode):
    config = {
        "steps": {"burst": 1},
        "chained": {"burst": 1},
        "bursts": {"burst": 6, **WHOLE},
        "cut": {"burst": 6, **CUT},
        "uncut": {"burst": 6, **CUT},  # on a runner that cannot cut bursts
        "unasked": {"burst": 6, **CUT, "cut_bursts": False},
    }[mode]
    sched = make(chains=mode != "steps", cuts=mode != "uncut", **config)
    events = run(sched, GenRequest(1, 0, A, 20))
    # a tick with decode steps 6, 12, 18, before their tokens, also inside a burst
    tick = ["T1"] * 6 + ["H"]
    assert kinds(events) == ["A1"] + tick * 3 + ["T1"] * 2 + ["F1"]
    assert events[0] == Accepted(1, prompt_tokens=3, reused_tokens=0)
    assert tokens(events, 1) == reference(A, 20)
    assert all(ev.text == token_bytes(ev.token) for ev in events if isinstance(ev, Token))
    assert all(ev.topk == () for ev in events if isinstance(ev, Token))
    report = finished(events, 1).report
    assert (report.emitted, report.prompt_tokens, report.length_limited) == (20, 3, True)
    assert report.forwards == 20  # its prefill, then a decode step for each later token
    assert sched.steps == 19 and sched.forwards == 20 and sched.runner.turns == 1
    assert sched.history(0) == list(A) + tokens(events, 1)[:-1]  # the last token is not fed
    assert cache_agrees(sched) and sched.slots[0].owner is None
    calls = sched.runner.calls
    if mode == "steps":
        assert calls == [(1, False, False)] * 19  # nothing chains
    elif mode == "bursts":  # steps 1, 2 one a forward (no step time yet), then bursts, the
        # last as long as the request has tokens left
        assert calls == [(1, False, False), (1, False, True)] + [(6, False, True)] * 2 + [
            (5, False, True)
        ]
    elif mode == "cut":  # cuttable: nothing chains behind them
        assert calls == [(1, False, False), (1, False, True), (6, True, True)] + [
            (6, True, False),
            (5, True, False),
        ]
    else:  # chained steps, also where bursts could only be cut and the runner cannot
        assert calls == [(1, False, False)] + [(1, False, True)] * 18
    # each tick the experts of its own steps, wherever it falls in a burst (the prompt's too)
    fed = list(A) + reference(A, 20)  # each position's token: the prompt's, then step 1 ..
    ticks = [ev.hits for ev in events if isinstance(ev, HitsTick)]
    for got, want in zip(ticks, (range(9), range(9, 15), range(15, 21)), strict=True):
        np.testing.assert_array_equal(got, routed(fed, want))
    np.testing.assert_array_equal(report.hits, routed(fed, [21]))  # decode step 19


def test_topk_candidates_come_with_each_token_and_no_bursts():
    sched = make(topk=3, burst=6, **WHOLE)
    events = run(sched, GenRequest(1, 0, A, 8))
    for ev in events:
        if isinstance(ev, Token):
            assert [text for _, text in ev.topk] == [
                token_bytes((ev.token + d) % VOCAB) for d in (0, 1, 2)
            ]
            lps = [lp for lp, _ in ev.topk]
            assert lps == sorted(lps, reverse=True)
    assert {c[0] for c in sched.runner.calls} == {1}  # TOPK needs logits: no bursts


def test_requests_batched_together_each_get_their_own_tokens():
    """Requests that join while others decode, on any runner: each gets the tokens it gets
    alone, and each step gives one token to every active request, in admission order."""
    for chains in (False, True):
        for config in ({"burst": 1}, {"burst": 6, **WHOLE}, {"burst": 6, **CUT}):
            if not chains and config["burst"] > 1:
                continue
            sched = make(chains=chains, **config)
            reqs = [GenRequest(1, 0, A, 25), GenRequest(2, 1, B, 9), GenRequest(3, 3, C, 14)]
            events = sched.submit(reqs[0]) + sched.step() + sched.step()
            events += sched.submit(reqs[1]) + sched.step()
            events += sched.submit(reqs[2])
            events += run(sched)
            for r in reqs:
                assert tokens(events, r.id) == reference(r.prompt, r.max_tokens), (chains, config)
                report = finished(events, r.id).report
                assert report.emitted == r.max_tokens and report.length_limited
            assert [ev.id for ev in events if isinstance(ev, Accepted)] == [1, 2, 3]
            assert cache_agrees(sched)


# ---------------------------------------------------------------------------- bursts


def _two_requests(burst: int, stop=(), **config):
    """Request 1 (20 tokens) and 2 (13: its limit on the last step of the 2nd burst; steps 1
    and 2 run alone, before any step has landed) side by side; events, scheduler."""
    sched = make(slots=3, burst=burst, stop_ids=stop, **config)
    events = run(sched, GenRequest(1, 0, A, 20), GenRequest(2, 1, B, 13))
    return events, sched


def test_bursts_give_the_tokens_counts_and_ticks_of_single_steps():
    ref_a, ref_b = reference(A, 20), reference(B, 13)
    at = next(i for i in range(4, 8) if ref_a[i] not in ref_a[:i] + ref_b)
    stop = (ref_a[at],)  # request 1 stops inside the first burst (steps 3 .. 8); 2 goes on
    one, sched1 = _two_requests(1, stop)
    for config, cut in ((WHOLE, False), (CUT, True)):
        six, sched6 = _two_requests(6, stop, **config)
        steps = [(1, False, False), (1, False, True)]  # (cuttable: nothing chains behind)
        assert sched6.runner.calls == steps + [(6, cut, True), (4, cut, not cut)]
        assert len(sched1.runner.calls) == 12
        assert tokens(six, 1) == tokens(one, 1) == ref_a[:at]
        assert tokens(six, 2) == tokens(one, 2) == ref_b
        interleaved = [ev.id for ev in six if isinstance(ev, Token)]
        assert interleaved == [ev.id for ev in one if isinstance(ev, Token)]
        for rid in (1, 2):
            a, b = finished(six, rid).report, finished(one, rid).report
            assert (a.emitted, a.length_limited, a.entropy) == (
                b.emitted,
                b.length_limited,
                b.entropy,
            )
        # request 2 saw every forward of both runs; request 1's window ends when the forward
        # that ended it lands: a burst's steps after its stop token are in it
        assert finished(six, 2).report.forwards == finished(one, 2).report.forwards == 13
        assert finished(one, 1).report.forwards == 2 + at  # two prefills, its steps
        assert finished(six, 1).report.forwards == 2 + 8  # ... and the rest of the burst
        np.testing.assert_array_equal(sched6.runner.stats.counts, sched1.runner.stats.counts)
        assert sched6.steps == sched1.steps == 12
        assert sum(isinstance(ev, HitsTick) for ev in six) == 2


def test_a_cut_burst_lands_its_steps_and_a_frame_joins_the_next():
    """A cuttable burst cut after its 2nd step (a frame came in: here a new request): the
    scheduler admits the request and goes on in bursts at once, the new request in them, their
    HITS ticks inside them; tokens, ticks and counts are those of single steps."""
    sched = make(slots=2, burst=6, **CUT)
    events = sched.submit(GenRequest(1, 0, A, 40))
    for _ in range(3):  # 2 steps landed (one a forward: no step time yet), a burst in flight
        events += sched.step()
    runner = sched.runner
    assert runner.calls == [(1, False, False), (1, False, True), (6, True, True)]
    assert sched.steps == 2
    runner.frame(during=2)
    events += sched.submit(GenRequest(2, 1, B, 12))
    events += sched.step()  # the cut burst lands, 2 has its prefill, a burst of both starts
    assert sched.steps == 4 and [ev.id for ev in events if isinstance(ev, Accepted)] == [1, 2]
    events += run(sched)
    # 2 has 11 decode steps (5 .. 15): its limit ends the second burst of both after 5
    assert runner.calls[3:] == [(6, True, False), (5, True, False)] + [(6, True, False)] * 4
    assert tokens(events, 1) == reference(A, 40)
    assert tokens(events, 2) == reference(B, 12)
    assert sum(isinstance(ev, HitsTick) for ev in events) == sched.steps // 6
    single = make(slots=2, burst=1)
    run(single, GenRequest(1, 0, A, 40), GenRequest(2, 1, B, 12))
    np.testing.assert_array_equal(runner.stats.counts, single.runner.stats.counts)


def test_bursts_run_whole_up_to_full_burst_ms_while_every_slot_is_taken():
    """burst_ms 0, full_burst_ms unbounded: cuttable bursts while a slot is free, whole ones
    (chained) while every slot is taken."""
    sched = make(slots=2, burst=6, burst_ms=0.0, full_burst_ms=1e6)
    events = sched.submit(GenRequest(1, 0, A, 40))
    for _ in range(3):
        events += sched.step()
    assert sched.runner.calls[2] == (6, True, True)  # a slot free: cuttable
    events += sched.submit(GenRequest(2, 1, B, 40))
    events += run(sched)
    calls = sched.runner.calls
    assert calls[3:6] == [(6, False, False), (6, False, True), (6, False, True)]  # both taken
    assert any(cut for _, cut, _ in calls[6:])  # once request 1 ended: cuttable again
    assert tokens(events, 1) == reference(A, 40) and tokens(events, 2) == reference(B, 40)


def test_bursts_hold_their_tokens_back_no_longer_than_stream_ms():
    """A burst is no longer than the recent steps (20 ms each here) say fits in stream_ms.
    Where not even two fit, each step is its own forward, started when the last lands (so
    that a frame waits for one step at most), and every token lands as it is chosen."""
    for stream_ms in (30.0, 70.0, 1e6):
        sched = make(burst=6, stream_ms=stream_ms, **CUT)
        sched.runner.step_s = 0.02
        events = run(sched, GenRequest(1, 0, A, 30))
        calls = sched.runner.calls
        assert calls[:2] == [(1, False, False), (1, False, True)]  # no step time yet
        longest = max(steps for steps, _, _ in calls[2:])
        if stream_ms == 30.0:
            assert calls[2:] == [(1, False, False)] * (len(calls) - 2)
        else:
            assert 2 <= longest and longest * 0.02 <= stream_ms / 1e3
        assert (longest == 6) == (stream_ms == 1e6)
        assert tokens(events, 1) == reference(A, 30)


def test_a_burst_ends_with_the_stop_token_of_its_last_request():
    """A request alone in a burst that chooses a stop token ends the burst there (the runner
    runs no step after it); whole, with another chained behind it (which lands for nothing),
    or cuttable: tokens, steps, counts and its report are those of single steps."""
    ref = reference(A, 30)
    at = next(i for i in range(4, 9) if ref[i] not in ref[:i])  # inside the first burst
    one = make(burst=1, stop_ids=(ref[at],))
    alone = finished(run(one, GenRequest(1, 0, A, 30)), 1).report
    for config, cut in ((WHOLE, False), (CUT, True)):
        sched = make(burst=6, stop_ids=(ref[at],), **config)
        events = run(sched, GenRequest(1, 0, A, 30))
        calls = sched.runner.calls
        assert calls[2] == (6, cut, True) and len(calls) == 3 + (not cut)
        assert tokens(events, 1) == ref[:at] and sched.steps == one.steps == at
        report = finished(events, 1).report
        assert (report.emitted, report.forwards, report.length_limited) == (
            alone.emitted,
            alone.forwards,
            False,
        )
        np.testing.assert_array_equal(sched.runner.stats.counts, one.runner.stats.counts)


def test_no_burst_chains_while_a_prompt_waits_or_a_request_samples():
    sched = make(burst=6, **WHOLE)
    events = sched.submit(GenRequest(1, 0, A, 30)) + sched.step()
    events += sched.submit(GenRequest(2, 1, B, 5, temperature=1.0)) + sched.step()
    events += run(sched)
    # 1 alone (no step time yet), then 2 samples (its 4 decode steps): one step a forward,
    # and nothing chains; then bursts
    assert sched.runner.calls[:6] == [(1, False, False)] * 5 + [(6, False, False)]
    assert tokens(events, 1) == reference(A, 30)


# ---------------------------------------------------------------------------- ticks, counts


def routed(fed, positions) -> np.ndarray:
    """bool [n_moe, E]: the experts the tokens fed at `positions` are routed to."""
    out = np.zeros((2, 8), bool)
    for pos in positions:
        out[np.arange(2)[:, None], experts(fed[pos], pos)] = True
    return out


def test_hits_ticks_come_every_6_steps_with_the_experts_routed_since():
    """A tick every 6 decode steps (of any request) and each turn's report carry the experts
    routed since the tick or report before."""
    sched = make(burst=1)
    per_step = [sched.submit(GenRequest(1, 0, A, 14))]
    while sched.busy:
        per_step.append(sched.step())
    ticks = [(i, ev) for i, evs in enumerate(per_step) for ev in evs if isinstance(ev, HitsTick)]
    assert [i for i, _ in ticks] == [7, 13]  # the step() calls that land decode steps 6, 12
    assert kinds(per_step[7]) == ["H", "T1"]
    fed = list(A) + reference(A, 14)  # each position's token (the prompt's, then steps 1 ..)
    np.testing.assert_array_equal(ticks[0][1].hits, routed(fed, range(9)))  # + steps 1 .. 6
    np.testing.assert_array_equal(ticks[1][1].hits, routed(fed, range(9, 15)))  # 7 .. 12
    report = finished(per_step[-1], 1).report
    np.testing.assert_array_equal(report.hits, routed(fed, [15]))  # decode step 13
    assert not sched.runner.stats.hits_since.any()  # taken: the next tick starts afresh
    events = run(sched, GenRequest(2, 1, B, 8))  # decode steps 14 .. 18: a tick at 18
    (tick,) = [ev for ev in events if isinstance(ev, HitsTick)]
    fed = list(B) + reference(B, 8)
    np.testing.assert_array_equal(tick.hits, routed(fed, range(7)))  # the prompt, 5 steps


def test_forwards_count_every_prefill_and_decode_step_of_the_turn_window():
    sched = make(burst=1)
    events = sched.submit(GenRequest(1, 0, A, 10)) + sched.step() + sched.step()
    events += run(sched, GenRequest(2, 1, B, 3))
    assert finished(events, 1).report.forwards == 10 + 1  # its own, and 2's prefill
    assert finished(events, 2).report.forwards == 3
    assert sched.forwards == sched.runner.prefills + sched.steps == 11


def test_repins_surface_after_the_forward_that_made_them():
    sched = make(burst=1)
    sched.submit(GenRequest(1, 0, A, 10))
    early = RepinEvent(layer=0, expert=1, old_tier=0)
    sched.runner.stats.repins.append(early)  # (as if the prefill made it)
    assert kinds(sched.step()) == ["A1", "R", "T1"]
    swap = RepinEvent(layer=1, expert=3, old_tier=1)
    sched.runner.stats.repins.append(swap)
    assert swap in sched.step()
    assert swap not in sched.step()


# ---------------------------------------------------------------------------- admission


def test_the_prefill_budget_admits_serially():
    sched = make(prefill_budget=20)
    reqs = [GenRequest(i, i - 1, C, 5) for i in (1, 2, 3)]  # 10 prompt tokens each
    for r in reqs:
        assert sched.submit(r) == []
    first = sched.step()
    assert [ev.id for ev in first if isinstance(ev, Accepted)] == [1, 2]  # 10, then 0 left
    assert sched.runner.prefills == 2 and [r.id for r in sched.waiting] == [3]
    second = sched.step()
    assert kinds(second) == ["T1", "T2", "A3", "T3"]  # the landed step, then the admission
    assert sched.runner.prefills == 3
    events = first + second + run(sched)
    assert all(tokens(events, r.id) == reference(C, 5) for r in reqs)
    # a budget of 0 still admits one prompt a step, however long
    sched = make(prefill_budget=0)
    for r in reqs:
        sched.submit(r)
    admitted = [[ev.id for ev in sched.step() if isinstance(ev, Accepted)] for _ in range(3)]
    assert admitted == [[1], [2], [3]]


def test_a_slot_reuses_the_prefix_it_holds():
    sched = make()
    first = run(sched, GenRequest(1, 0, C, 6))
    follow = C + tuple(tokens(first, 1)) + (3, 1)  # the conversation goes on
    events = run(sched, GenRequest(2, 0, follow, 6))
    assert events[0] == Accepted(2, len(follow), reused_tokens=len(C) + 5)  # all it fed
    assert tokens(events, 2) == reference(follow, 6)
    other = (9, 8, 1)  # diverges at position 2
    events = run(sched, GenRequest(3, 0, other, 6))
    assert events[0] == Accepted(3, 3, reused_tokens=2)
    assert tokens(events, 3) == reference(other, 6) and cache_agrees(sched)
    again = run(sched, GenRequest(4, 0, other, 6))  # the same prompt: its last token refed
    assert again[0] == Accepted(4, 3, reused_tokens=2)
    assert tokens(again, 4) == reference(other, 6)


def test_refusals():
    sched = make(slots=2, capacity=16)
    assert sched.submit(GenRequest(1, 0, A, 5)) == []
    assert sched.submit(GenRequest(1, 1, B, 5)) == [Failed(1, "DUPLICATE_ID")]  # waiting
    sched.step()
    assert sched.submit(GenRequest(1, 1, B, 5)) == [Failed(1, "DUPLICATE_ID")]  # active
    assert sched.submit(GenRequest(2, 0, B, 5)) == [Failed(2, "SLOT_BUSY")]
    assert sched.submit(GenRequest(3, 2, B, 5)) == [Failed(3, "BAD_REQUEST")]
    assert sched.submit(GenRequest(3, -1, B, 5)) == [Failed(3, "BAD_REQUEST")]
    assert sched.submit(GenRequest(3, 1, B, 0)) == [Failed(3, "BAD_REQUEST")]
    assert sched.submit(GenRequest(3, 1, (), 5)) == [Failed(3, "EMPTY_PROMPT")]
    assert sched.submit(GenRequest(3, 1, (1,) * 16, 5)) == [
        Failed(3, "CONTEXT_EXCEEDED", ("16", "16"))
    ]
    assert sched.cancel(9) == [Failed(9, "NOT_FOUND")]
    assert sched.stop(9) == [Failed(9, "NOT_FOUND")]
    assert sched.slots[1].owner is None and sched.in_flight() == [1]


# ---------------------------------------------------------------------------- ends of turns


def test_limits_max_tokens_ngen_and_the_context():
    sched = make(capacity=16, ngen=4)
    events = run(sched, GenRequest(1, 0, A, 10), GenRequest(2, 1, B, 2))
    assert tokens(events, 1) == reference(A, 4) and finished(events, 1).report.length_limited
    assert tokens(events, 2) == reference(B, 2) and finished(events, 2).report.length_limited
    sched = make(capacity=16)
    events = run(sched, GenRequest(3, 0, (1,) * 12, 100))  # room for 4 more positions
    assert tokens(events, 3) == reference((1,) * 12, 4)
    assert finished(events, 3).report.length_limited
    forwards = len(sched.runner.calls)
    events = run(sched, GenRequest(4, 1, (2,) * 15, 100))  # one token, from the prefill
    assert kinds(events) == ["A4", "T4", "F4"] and len(sched.runner.calls) == forwards


def test_a_stop_token_ends_a_turn_unsent():
    ref = reference(A, 20)
    at = next(i for i in range(1, 20) if ref[i] not in ref[:i])
    sched = make(stop_ids=(ref[at],))
    events = run(sched, GenRequest(1, 0, A, 20))
    assert tokens(events, 1) == ref[:at]
    report = finished(events, 1).report
    assert report.emitted == at and not report.length_limited
    sched = make(stop_ids=(ref[0],))  # the prefill's token: done at once
    events = run(sched, GenRequest(2, 0, A, 20))
    assert kinds(events) == ["A2", "F2"] and finished(events, 2).report.emitted == 0
    assert sched.runner.calls == []


def test_stop_before_admission_finishes_with_nothing_emitted():
    sched = make()
    sched.submit(GenRequest(1, 0, C, 5))
    (done,) = sched.stop(1)
    assert done.id == 1 and isinstance(done, Finished)
    r = done.report
    assert (r.emitted, r.prompt_tokens, r.length_limited, r.forwards) == (0, 10, False, 0)
    assert r.entropy == (0.0, 0.0) and not sched.busy and sched.runner.prefills == 0
    assert sched.submit(GenRequest(2, 0, A, 5)) == []  # the slot is free again


def test_stop_and_cancel_between_steps():
    sched = make(burst=6, **WHOLE)
    sched.submit(GenRequest(1, 0, A, 30))
    sched.submit(GenRequest(2, 1, B, 30))
    events = [ev for _ in range(4) for ev in sched.step()]  # steps 1, 2, a burst of 6 landed
    assert sched.runner.calls[-1] == (6, False, True)  # ... and another in flight
    assert len(tokens(events, 1)) == 9
    assert sched.cancel(1) == [Failed(1, "CANCELLED")]
    (done,) = sched.stop(2)
    assert done.report.emitted == len(tokens(events, 2)) == 9 and not done.report.length_limited
    assert sched.runner.turns == 2 and not sched.busy
    assert sched.step() == []  # the burst in flight lands for nothing: no step, no count
    assert sched.steps == 8
    assert sched.history(0) == list(A) + reference(A, 8)  # what was fed stays
    events = run(sched, GenRequest(3, 0, A + tuple(reference(A, 8)) + (0,), 4))
    assert events[0] == Accepted(3, 12, reused_tokens=11) and cache_agrees(sched)


def test_cancel_frees_the_slot_for_a_new_request():
    sched = make(slots=1, burst=1)
    sched.submit(GenRequest(1, 0, A, 30))
    events = sched.step() + sched.step() + sched.step()
    assert sched.submit(GenRequest(2, 0, B, 4)) == [Failed(2, "SLOT_BUSY")]
    assert sched.cancel(1) == [Failed(1, "CANCELLED")]
    events = run(sched, GenRequest(2, 0, B, 4))
    assert kinds(events) == ["A2", "T2", "T2", "T2", "T2", "F2"]
    assert tokens(events, 2) == reference(B, 4)
    # cancelling one still waiting: no prefill, nothing but the cancellation
    sched.submit(GenRequest(3, 0, C, 4))
    assert sched.cancel(3) == [Failed(3, "CANCELLED")] and sched.step() == []
    assert sched.runner.prefills == 2


def test_stop_all_ends_waiting_and_active_requests_with_done():
    sched = make()
    sched.submit(GenRequest(1, 0, A, 30))
    sched.step()
    sched.submit(GenRequest(2, 1, B, 30))
    events = sched.stop_all()
    assert [(type(ev), ev.id) for ev in events] == [(Finished, 2), (Finished, 1)]
    assert [ev.report.emitted for ev in events] == [0, 1] and not sched.busy


# ---------------------------------------------------------------------------- failures


def test_a_failing_prefill_ends_only_its_request():
    sched = make(burst=1)
    sched.runner.faults.append(Fault("prefill", slot=1))
    events = run(sched, GenRequest(1, 0, A, 6), GenRequest(2, 1, B, 6), GenRequest(3, 2, C, 6))
    assert [ev for ev in events if isinstance(ev, Failed)] == [Failed(2, "INTERNAL")]
    assert not any(isinstance(ev, Accepted | Token) and ev.id == 2 for ev in events)
    assert tokens(events, 1) == reference(A, 6) and tokens(events, 3) == reference(C, 6)
    assert sched.history(1) == [] and sched.slots[1].owner is None
    assert tokens(run(sched, GenRequest(4, 1, B, 6)), 4) == reference(B, 6)


def test_a_forward_that_fails_to_start_ends_its_requests_and_the_next_go_on():
    sched = make(burst=1, chains=False)
    sched.submit(GenRequest(1, 0, A, 10))
    sched.submit(GenRequest(2, 1, B, 10))
    sched.step()
    sched.runner.faults.append(Fault("start"))
    events = sched.step()  # the forward in flight lands; the next one fails to start
    assert kinds(events) == ["T1", "T2", "X1:INTERNAL", "X2:INTERNAL"]
    assert not sched.busy and sched.history(0) == sched.history(1) == []
    events = run(sched, GenRequest(3, 0, A, 6))
    assert events[0] == Accepted(3, 3, 0) and tokens(events, 3) == reference(A, 6)


def test_a_chained_forward_that_fails_to_start_starts_after_the_one_in_flight():
    sched = make(burst=1)
    events = sched.submit(GenRequest(1, 0, A, 10)) + sched.step()
    sched.runner.faults.append(Fault("start"))
    events += sched.step() + run(sched)
    assert not any(isinstance(ev, Failed) for ev in events)
    assert tokens(events, 1) == reference(A, 10)
    assert sched.runner.calls[1] == (1, False, False)  # unchained, started after the landing


@pytest.mark.parametrize("chains", [False, True])
def test_a_forward_that_fails_while_running_ends_only_its_requests(chains):
    """Requests in the failed forward end with INTERNAL; one waiting meanwhile is admitted
    and decodes as if nothing happened; the failed slots start over."""
    sched = make(burst=1, chains=chains)
    sched.submit(GenRequest(1, 0, A, 10))
    sched.submit(GenRequest(2, 1, B, 10))
    events = sched.step()
    sched.runner.faults.append(Fault("land", slot=1))  # the next forward: 1 and 2 in it
    events += sched.step()
    assert tokens(events, 1) == reference(A, 2)
    events += sched.submit(GenRequest(3, 2, C, 8))
    events += sched.step()  # lands the failed forward
    assert kinds(events)[-4:] == ["X1:INTERNAL", "X2:INTERNAL", "A3", "T3"]
    assert sched.history(0) == sched.history(1) == []
    events += run(sched)
    assert tokens(events, 3) == reference(C, 8) and finished(events, 3).report.emitted == 8
    assert sum(isinstance(ev, Failed) for ev in events) == 2
    assert not any(isinstance(ev, Finished) and ev.id in (1, 2) for ev in events)
    events = run(sched, GenRequest(4, 0, A, 5))
    assert events[0] == Accepted(4, 3, 0) and tokens(events, 4) == reference(A, 5)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN probabilities
def test_a_request_whose_sampling_fails_ends_alone():
    config = SchedulerConfig(seed=3)
    sched = Scheduler(FakeRunner(), token_bytes, config)
    greedy = GenRequest(1, 0, A, 12)
    sampled = GenRequest(2, 1, B, 12, temperature=1.0, top_p=0.9)
    events = [ev for r in (greedy, sampled) for ev in sched.submit(r)] + sched.step()
    sched.runner.faults.append(Fault("nan", slot=1))
    events += sched.step() + sched.step()
    assert kinds(events)[-4:] == ["T1", "T2", "X2:INTERNAL", "T1"]
    events += run(sched)
    assert tokens(events, 1) == reference(A, 12) and finished(events, 1).report.emitted == 12
    assert tokens(events, 2) == expected(sampled, config, CAP)[0][:2]


def test_a_token_that_fails_to_report_ends_its_request_only():
    ref_a, ref_b = reference(A, 10), reference(B, 10)
    bad = next(t for t in ref_a[1:] if t not in ref_b)
    at = ref_a.index(bad)

    def text(tok: int) -> bytes:
        if tok == bad:
            raise UnicodeError("injected")
        return token_bytes(tok)

    sched = Scheduler(FakeRunner(), text, SchedulerConfig(burst=1))
    events = run(sched, GenRequest(1, 0, A, 10), GenRequest(2, 1, B, 10))
    assert tokens(events, 1) == ref_a[:at]
    assert [ev for ev in events if isinstance(ev, Failed)] == [Failed(1, "INTERNAL")]
    assert tokens(events, 2) == ref_b and finished(events, 2).report.length_limited


# ---------------------------------------------------------------------------- sampling, KV


def test_sampled_requests_draw_from_seed_and_id():
    def draw(seed: int, rid: int) -> list[int]:
        sched = make(seed=seed)
        req = GenRequest(rid, 0, A, 12, temperature=1.0, top_p=0.9)
        events = run(sched, req)
        assert (tokens(events, rid), True) == expected(req, sched.config, CAP)
        return tokens(events, rid)

    assert draw(0, 5) == draw(0, 5)
    assert draw(0, 5) != draw(0, 6) and draw(0, 5) != draw(1, 5)


def test_restored_slots_continue_as_if_never_stopped(tmp_path):
    before = Scheduler(FakeRunner(), token_bytes, kv_store=KVStore(tmp_path, "fake"))
    first = run(before, GenRequest(1, 2, C, 5))
    restored = Scheduler(FakeRunner(), token_bytes, kv_store=KVStore(tmp_path, "fake"))
    assert restored.restore() == len(before.history(2)) == len(C) + 4
    follow = C + tuple(tokens(first, 1)) + (7,)
    events = run(restored, GenRequest(2, 2, follow, 6))
    assert events[0] == Accepted(2, len(follow), len(C) + 4)
    assert tokens(events, 2) == reference(follow, 6)


# ---------------------------------------------------------------------------- properties

_op = st.one_of(
    st.tuples(
        st.just("submit"),
        st.integers(1, 6),  # id
        st.integers(0, 2),  # slot
        st.sampled_from([A, B, C, (5,), A + (0, 1, 2)]),
        st.integers(1, 24),  # max_tokens
        st.sampled_from([0.0, 0.0, 1.0]),  # temperature
    ),
    st.tuples(st.sampled_from(["cancel", "stop"]), st.integers(1, 6)),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("fault"), st.sampled_from(["prefill", "start", "land", "nan"])),
    st.tuples(st.just("frame"), st.integers(1, 6)),
)
_config = st.fixed_dictionaries(
    {
        "burst": st.sampled_from([1, 2, 3, 6]),
        "hits_every": st.sampled_from([1, 3, 6]),
        "prefill_budget": st.sampled_from([0, 8, 256]),
        "stop_ids": st.sampled_from([(), (7,), (3, 30)]),
        "ngen": st.sampled_from([0, 0, 5]),
        "burst_ms": st.sampled_from([0.0, 0.0, 1e6]),  # 0: cuttable bursts, where allowed
        "cut_bursts": st.sampled_from([True, True, False]),
    }
)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the NaN fault
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(_op, max_size=30),
    config=_config,
    chains=st.sampled_from([True, True, False]),
    cuts=st.sampled_from([True, True, False]),
    slot_=st.integers(0, 2),
)
def test_random_traffic_ends_every_request_once_with_the_model_tokens(
    ops, config, chains, cuts, slot_
):
    """Random submits, cancels, stops, steps, injected failures and frames on any runner:
    a request speaks only while in flight and ends exactly once; no slot has two owners;
    the scheduler's view of each slot's cache is the runner's; every request's tokens are a
    prefix of what it gets alone, all of them where it ended by a limit or a stop token; the
    ticks and forwards add up."""
    config = SchedulerConfig(full_burst_ms=config["burst_ms"], **config)
    runner = FakeRunner(slots=3, capacity=32, chains=chains, cuts=cuts)
    sched = Scheduler(runner, token_bytes, config)
    live: dict[int, GenRequest] = {}
    got: dict[int, list[int]] = {}  # tokens of the request under each id now
    stopped: set[int] = set()  # ids a STOP or CANCEL named (a STOP's DONE may come early)
    waiting: list[int] = []  # submitted, not yet admitted: admitted first come, first served
    ticks = 0

    def check(events: list) -> None:
        nonlocal ticks
        for ev in events:
            if isinstance(ev, HitsTick):
                ticks += 1
            elif isinstance(ev, Failed) and ev.code == "NOT_FOUND":
                assert ev.id not in live
            elif isinstance(ev, Failed) and ev.code in ("CANCELLED", "INTERNAL"):
                live.pop(ev.id)  # KeyError: ended twice, or never started
                if ev.id in waiting:  # cancelled while waiting, or its prefill failed
                    assert ev.code == "CANCELLED" or waiting[0] == ev.id
                    waiting.remove(ev.id)
            elif isinstance(ev, Finished):
                req = live.pop(ev.id)
                if ev.id in waiting:  # stopped while waiting
                    assert ev.report.emitted == ev.report.forwards == 0
                    waiting.remove(ev.id)
                assert ev.report.emitted == len(got[ev.id])
                assert ev.report.prompt_tokens == len(req.prompt)
                want, limited = expected(req, config, runner.capacity)
                if ev.id not in stopped:
                    assert (got[ev.id], ev.report.length_limited) == (want, limited)
            elif isinstance(ev, Token):
                got[ev.id].append(ev.token)
                req = live[ev.id]
                assert got[ev.id] == expected(req, config, runner.capacity)[0][: len(got[ev.id])]
            elif isinstance(ev, Accepted):
                assert ev.id in live and not got[ev.id] and waiting[0] == ev.id
                assert ev.prompt_tokens == len(live[ev.id].prompt)
                waiting.pop(0)
            else:
                assert not isinstance(ev, Failed), ev  # refusals come from submit only
        owners = [s.owner for s in sched.slots if s.owner is not None]
        assert len(owners) == len(set(owners))
        assert {rid: req.slot for rid, req in live.items()} == {
            s.owner: i for i, s in enumerate(sched.slots) if s.owner is not None
        }
        assert cache_agrees(sched) and runner.misuse == []

    for op in ops:
        if op[0] == "submit":
            _, rid, slot, prompt, max_tokens, temperature = op
            req = GenRequest(rid, slot, prompt, max_tokens, temperature, top_p=0.9)
            out = sched.submit(req)
            if out:
                assert len(out) == 1 and out[0].code in ("DUPLICATE_ID", "SLOT_BUSY")
            else:
                live[rid], got[rid] = req, []
                stopped.discard(rid)
                waiting.append(rid)
        elif op[0] == "step":
            for _ in range(op[1]):
                check(sched.step())
        elif op[0] == "fault":
            runner.faults.append(Fault(op[1], slot=slot_))  # failures end with INTERNAL
        elif op[0] == "frame":
            runner.frame(op[1])
        else:
            stopped.add(op[1])
            check(getattr(sched, op[0])(op[1]))
    runner.faults.clear()
    check(run(sched))
    assert not live and not waiting and all(s.owner is None for s in sched.slots)
    assert ticks == sched.steps // config.hits_every
    assert sched.forwards == runner.prefills + sched.steps
