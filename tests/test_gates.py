"""GATES (SERVE_GATES): the routing of every token over the mux protocol, from the codec through
the real engine subprocess to the client's DataFrame, checked against the in-process tracer."""

from __future__ import annotations

import io

import numpy as np
import pandas as pd
import pytest
from engine_util import Mux, text
from hypothesis import given
from hypothesis import strategies as st

from colibri import analysis
from colibri.client import GATES_COLUMNS, Engine, Request, Session, read_loop
from colibri.engine.runner import Runner
from colibri.engine.scheduler import (
    Accepted,
    GenRequest,
    Scheduler,
    SchedulerConfig,
    Token,
    TokenGates,
    by_weight,
)
from colibri.engine.settings import EngineSettings, SettingsError
from colibri.protocol.codec import (
    Accept,
    Data,
    Done,
    Emap,
    Entropy,
    Gates,
    Gpus,
    Hits,
    HwInfo,
    Perf,
    ProtocolError,
    Ready,
    Stat,
    Tiers,
    TopK,
    format_event,
    read_event,
)
from colibri.serve import mux

CTX = 128
N = 12  # tokens asked of each request
PROMPTS = {1: "The quick brown fox", 2: "def add(a, b):"}  # request id: prompt, slot id - 1
TOL = 1e-6


@pytest.fixture(scope="module")
def model_dir(checkpoints):
    return checkpoints("qwen3_moe")


@pytest.fixture(scope="module")
def tracer(model_dir):
    return analysis.RouteTracer(model_dir, capacity=CTX)


@pytest.fixture(scope="module")
def traces(tracer):
    """The in-process trace of each prompt, greedy, N tokens: what GATES must say."""
    return {rid: tracer.trace(p, max_tokens=N) for rid, p in PROMPTS.items()}


@pytest.fixture(scope="module")
def runs(model_dir):
    """Events of both requests decoding at once in two slots, per engine environment (memoised)."""
    memo: dict = {}

    def run(**env: str) -> list:
        key = tuple(sorted(env.items()))
        if key not in memo:
            eng = Mux(model_dir, KV_SLOTS="2", CTX=str(CTX), **env)
            try:
                for rid, prompt in PROMPTS.items():
                    eng.submit(rid, rid - 1, prompt, N)
                memo[key] = eng.collect(*PROMPTS)
                assert eng.close() == 0, eng.stderr()
            finally:
                eng.kill()
        return memo[key]

    return run


# ---------------------------------------------------------------------------- codec

G = Gates(3, 17, 42, ((5, 1), (0, 7)), ((0.75, 0.25), (0.6, 0.4)), (1.5, 2.0), (0.5, 0.2))
G_WIRE = (
    b"GATES 3 17 42 2 2 5 1 0.7500000 0.2500000 1.5000000 0.5000000"
    b" 0 7 0.6000000 0.4000000 2.0000000 0.2000000\n"
)
fixed7 = st.integers(0, 3 * 10**7).map(lambda n: n / 10**7)  # survives %.7f exactly


@st.composite
def gates(draw: st.DrawFn) -> Gates:
    layers, k = draw(st.integers(0, 4)), draw(st.integers(0, 4))
    row = st.lists(st.integers(0, 2**20), min_size=k, max_size=k).map(tuple)
    wts = st.lists(fixed7, min_size=k, max_size=k).map(tuple)
    per_layer = st.lists(fixed7, min_size=layers, max_size=layers).map(tuple)
    return Gates(
        draw(st.integers(1, 2**64 - 1)),
        draw(st.integers(0, 10**6)),
        draw(st.integers(0, 10**6)),
        tuple(draw(row) for _ in range(layers)),
        tuple(draw(wts) for _ in range(layers)),
        draw(per_layer),
        draw(per_layer),
    )


def events_of(data: bytes) -> list:
    stream, out = io.BytesIO(data), []
    while (ev := read_event(stream)) is not None:
        out.append(ev)
    return out


def test_gates_exact_bytes():
    assert format_event(G) == G_WIRE
    assert events_of(G_WIRE) == [G] and G.k == 2
    assert format_event(Gates(1, 0, 9, (), (), (), ())) == b"GATES 1 0 9 0 0\n"


@given(st.lists(gates(), max_size=4))
def test_gates_round_trip_among_other_lines(lines):
    others = [Data(1, b"a\n"), TopK(1, ((-0.5, b"x"),)), Gpus(())]
    stream = [ev for g in lines for ev in (others[len(g.experts) % 3], g)]
    assert events_of(b"".join(format_event(ev) for ev in stream)) == stream


@pytest.mark.parametrize(
    "wire",
    [
        b"GATES 1 2 3\n",  # no layer or expert count
        b"GATES 1 0 5 1 2 3 4 0.5 0.5 1.0\n",  # a field short
        b"GATES 1 0 5 1 1 3 0.5 1.0 0.1 7\n",  # a field over
        b"GATES 1 0 5 1 1 x 0.5 1.0 0.1\n",  # an expert that is not a number
        b"GATES 1 0 5 1 1 3 0.5 1.0 zz\n",  # a margin that is not a number
        b"GATES 1 -1 5 1 1 3 0.5 1.0 0.1\n",  # a negative position
        b"GATES 1 0 5 2 1 3 0.5 1.0 0.1\n",  # two layers announced, one sent
    ],
)
def test_malformed_gates_raise_protocol_error(wire):
    with pytest.raises(ProtocolError, match="malformed GATES"):
        events_of(wire)


def test_gates_values_must_agree_in_shape():
    with pytest.raises(ValueError):
        Gates(1, 0, 5, ((1, 2),), ((0.5,),), (1.0,), (0.1,))
    with pytest.raises(ValueError):
        Gates(1, 0, 5, ((1,), (2, 3)), ((0.5,), (0.5, 0.5)), (1.0, 1.0), (0.1, 0.1))


# ---------------------------------------------------------------------------- settings


def test_serve_gates_setting():
    assert EngineSettings.from_env({}).serve_gates == 0
    for value in ("0", "1", "2"):
        settings = EngineSettings.from_env({"SERVE_GATES": value})
        assert settings.serve_gates == int(value)
        assert EngineSettings.from_env(settings.to_env()) == settings
    for bad in ("3", "on", "-1"):
        with pytest.raises(SettingsError, match="SERVE_GATES"):
            EngineSettings.from_env({"SERVE_GATES": bad})
    with pytest.raises(ValueError, match="gates"):
        SchedulerConfig(gates=3)


# ---------------------------------------------------------------------------- the engine


def _check_against_trace(got: list[Gates], trace: analysis.Trace, first: int) -> None:
    """GATES lines for positions first.. equal the trace's routing there."""
    assert [g.pos for g in got] == list(range(first, first + len(got)))
    assert first + len(got) == trace.routes.shape[1]  # every fed token, the last one's forward
    for g in got:
        p = g.pos
        assert g.token == trace.tokens[p]
        assert np.array_equal(np.asarray(g.experts), trace.routes[:, p])
        np.testing.assert_allclose(g.weights, trace.weights[:, p], atol=TOL, rtol=0)
        np.testing.assert_allclose(g.entropy, trace.entropy[:, p], atol=TOL, rtol=0)
        np.testing.assert_allclose(g.margin, trace.margin[:, p], atol=TOL, rtol=0)


def test_every_data_is_followed_by_its_gates(runs, traces, tracer):
    """SERVE_GATES=1, two slots decoding at once: one GATES after each DATA, the routing of the
    forward that chose the token, as the in-process tracer gives it."""
    evs = runs(SERVE_GATES="1")
    order = [ev.id for ev in evs if isinstance(ev, Data)]
    assert order.index(2) < len(order) - 1 - order[::-1].index(1)  # they decode at once
    tok = tracer.model.tokenizer
    for rid, trace in traces.items():
        mine = [ev for ev in evs if getattr(ev, "id", None) == rid]
        kinds = [type(ev) for ev in mine if isinstance(ev, Data | Gates)]
        assert kinds == [Data, Gates] * (len(kinds) // 2) and kinds
        for i, ev in enumerate(evs[:-1]):  # straight after, not merely later
            if isinstance(ev, Data) and ev.id == rid:
                assert isinstance(evs[i + 1], Gates) and evs[i + 1].id == rid
        generated = trace.tokens[trace.n_prompt :]
        assert text(evs, rid) == b"".join(tok.token_bytes(t) for t in generated)
        got = [ev for ev in mine if isinstance(ev, Gates)]
        assert (got[0].pos, got[0].token) == (trace.n_prompt - 1, trace.tokens[trace.n_prompt - 1])
        assert [g.k for g in got] == [tracer.top_k] * len(got)
        assert all(len(g.experts) == tracer.n_layers for g in got)
        _check_against_trace(got, trace, trace.n_prompt - 1)


def test_layer_by_layer_gates(runs, traces):
    """PROFILE=1 runs layer by layer (the traced router, experts staged per layer): the same
    tokens and routing as the fused program gives them."""
    evs = runs(SERVE_GATES="1", PROFILE="1")
    for rid, trace in traces.items():
        assert text(evs, rid) == text(runs(SERVE_GATES="0"), rid)
        got = [ev for ev in evs if isinstance(ev, Gates) and ev.id == rid]
        _check_against_trace(got, trace, trace.n_prompt - 1)


def test_gates_change_no_token(runs):
    plain, gated = runs(SERVE_GATES="0"), runs(SERVE_GATES="1")
    assert not any(isinstance(ev, Gates) for ev in plain)
    for rid in PROMPTS:
        assert text(gated, rid) == text(plain, rid) != b""
        done = [
            next(ev for ev in run if isinstance(ev, Done) and ev.id == rid)
            for run in (plain, gated)
        ]
        assert done[0].emitted == done[1].emitted


def test_prompt_gates_come_before_the_first_token(runs, traces):
    """SERVE_GATES=2: one GATES per prompt token before the first DATA, then one per DATA."""
    evs = runs(SERVE_GATES="2")
    for rid, trace in traces.items():
        mine = [ev for ev in evs if getattr(ev, "id", None) == rid]
        assert isinstance(mine[0], Accept)
        head = mine[1 : trace.n_prompt]
        assert all(isinstance(ev, Gates) for ev in head) and isinstance(mine[trace.n_prompt], Data)
        got = [ev for ev in mine if isinstance(ev, Gates)]
        _check_against_trace(got, trace, 0)
        assert text(evs, rid) == text(runs(SERVE_GATES="1"), rid)


def test_the_upstream_wire_never_carries_gates(runs):
    evs = runs(SERVE_GATES="1", WIRE="upstream")
    assert evs and all(isinstance(ev, mux.UPSTREAM_KINDS) for ev in evs)
    for rid in PROMPTS:
        assert text(evs, rid) == text(runs(SERVE_GATES="0"), rid)


def test_the_upstream_loop_drops_gates_it_is_handed():
    sent: list[bytes] = []

    class Out:
        def send(self, data: bytes) -> None:
            sent.append(data)

    gates = TokenGates(1, 4, 7, np.array([[3, 1]]), np.array([[0.7, 0.3]], np.float32),
                       np.array([1.0], np.float32), np.array([0.4], np.float32))  # fmt: skip
    token = Token(1, 9, b"hi", gates=gates)
    mux._Loop(None, None, Out(), mux.WIRE_KINDS["upstream"]).emit([token, gates])
    assert sent == [b"DATA 1 2\nhi\n"]
    sent.clear()
    mux._Loop(None, None, Out()).emit([token])
    assert sent[0] == b"DATA 1 2\nhi\n" and sent[1].startswith(b"GATES 1 4 7 1 2 3 1 0.7000000")
    both = Token(1, 9, b"hi", topk=((-0.1, b"hi"),), gates=gates)
    assert [type(ev) for ev in mux.lines(both)] == [Data, TopK, Gates]  # GATES after TOPK


def test_gates_off_trace_nothing(tracer, monkeypatch):
    """With gates 0 the scheduler runs the untraced programs only; with gates every decode
    forward is one traced step."""
    model = tracer.model
    prompt = tuple(model.tokenizer.encode(PROMPTS[1]))
    for gates in (0, 1):
        runner = Runner(model, slots=2, capacity=CTX)
        calls = []
        decode = runner.decode_async

        def spy(*a, decode=decode, calls=calls, **kw):
            calls.append((kw.get("steps", 1), kw.get("trace", False)))
            return decode(*a, **kw)

        monkeypatch.setattr(runner, "decode_async", spy)
        if not gates:
            monkeypatch.setattr(runner, "prefill_traced", _no_traced_prefill)
        config = SchedulerConfig(gates=gates, stop_ids=model.cfg.eos_token_ids)
        sched = Scheduler(runner, model.tokenizer.token_bytes, config)
        events = _serve(sched, GenRequest(1, 0, prompt, N))
        reported = [g for ev in events for g in _gates_of(ev)]
        tokens = [ev for ev in events if isinstance(ev, Token)]
        if gates:
            assert calls and all(c == (1, True) for c in calls)
            assert len(reported) == len(tokens) > 0
        else:
            assert calls and not any(trace for _, trace in calls) and not reported


def _no_traced_prefill(*args, **kwargs):
    pytest.fail("a traced prefill with gates off")


def _serve(sched: Scheduler, *reqs: GenRequest) -> list:
    events = [ev for r in reqs for ev in sched.submit(r)]
    for _ in range(500):
        if not sched.busy:
            return events
        events += sched.step()
    raise AssertionError("scheduler did not finish")


def test_a_reused_prefix_is_not_traced_again(tracer):
    """In process, gates 2: a follow-up in the same slot reports the tokens it prefilled and
    decoded from where the reused prefix ends, as a trace of the whole text has them."""
    model, tok = tracer.model, tracer.model.tokenizer
    runner = Runner(model, slots=1, capacity=CTX)
    config = SchedulerConfig(gates=2, stop_ids=model.cfg.eos_token_ids)
    sched = Scheduler(runner, tok.token_bytes, config)
    _serve(sched, GenRequest(1, 0, tuple(tok.encode(PROMPTS[1])), 4))
    history = sched.history(0)
    follow = (*history, *tok.encode(" jumps over"))
    events = _serve(sched, GenRequest(2, 0, follow, 6))
    assert next(ev for ev in events if isinstance(ev, Accepted)).reused_tokens == len(history)
    got = [g for ev in events for g in _gates_of(ev)]
    generated = [ev.token for ev in events if isinstance(ev, Token)]
    fed = [*follow, *generated[:-1]]
    assert [g.pos for g in got] == list(range(len(history), len(fed)))
    assert [g.token for g in got] == fed[len(history) :]
    _, (whole,) = tracer.runner.prefill_traced([(0, fed, 0)])  # one prefill: shapes differ
    ids, wts, ent, margin = by_weight(whole)
    for g in got:
        assert np.array_equal(g.experts, ids[:, g.pos])
        for mine, ref in ((g.weights, wts), (g.entropy, ent), (g.margin, margin)):
            np.testing.assert_allclose(mine, ref[:, g.pos], atol=1e-5, rtol=0)


def _gates_of(ev) -> list[TokenGates]:
    if isinstance(ev, TokenGates):
        return [ev]
    return [ev.gates] if isinstance(ev, Token) and ev.gates is not None else []


# ---------------------------------------------------------------------------- the client

HW = HwInfo(2, 16.0, 8.0, 0, 0.0, "cpu", "")
EMAP = Emap(2, 4, bytes([0x80] * 8))
HANDSHAKE = [Ready(), Stat(0, 0.0, 0.0, 0.2), HW, Tiers(8, 0, 0, 0.01, 0.0), EMAP]


def _gates(rid: int, pos: int, token: int) -> Gates:
    """Gates of 2 layers, 2 experts, with values that say where they came from."""
    e = ((pos % 4, (pos + 1) % 4), ((pos + 2) % 4, (pos + 3) % 4))
    w = ((0.75, 0.25), (0.5 + pos / 100, 0.5 - pos / 100))
    return Gates(rid, pos, token, e, w, (1.0 + pos, 2.0 + pos), (0.5, pos / 10))


def test_client_gates_frame():
    """SERVE_GATES=2 lines of a 3-token prompt and 2 tokens (an é split over both)."""
    s = Session()
    req = Request(None, 7, 0, "abc")
    s.register(req)
    lines = [
        Accept(7, 3, 0),
        _gates(7, 0, 97),
        _gates(7, 1, 98),
        Data(7, b"caf\xc3"),
        _gates(7, 2, 99),
        Data(7, b"\xa9!"),
        _gates(7, 3, 200),
        HW,
        Perf(7, 1.0, 0, 0, 0, 0, 0, 0),
        Entropy((1.0, 2.0)),
        Gpus(()),
        Tiers(8, 0, 0, 0.01, 0.0),
        EMAP,
        Hits.from_set(2, 4, []),
        Done(7, 2, 10.0, 100.0, 0.3, 3, False),
    ]
    read_loop(io.BytesIO(b"".join(format_event(ev) for ev in [*HANDSHAKE, *lines])), s)
    turn = req.wait(0)
    assert turn.gates == tuple(ev for ev in lines if isinstance(ev, Gates))
    df = s.gates_df()
    assert list(df.columns) == list(GATES_COLUMNS) and len(df) == 4 * 2 * 2
    assert df.attrs == {"top_k": 2, "n_experts": 4}
    assert df["position"].tolist() == np.repeat([0, 1, 2, 3], 4).tolist()
    assert df["token"].tolist() == np.repeat([97, 98, 99, 200], 4).tolist()
    assert df["step"].tolist() == np.repeat([-1, -1, 0, 1], 4).tolist()
    texts = df.loc[(df["layer"] == 0) & (df["rank"] == 0), "token_text"].tolist()
    assert pd.isna(texts[:3]).all() and texts[3] == "caf"  # no text seen for prompt tokens
    assert df["layer"].tolist() == [0, 0, 1, 1] * 4 and df["rank"].tolist() == [0, 1] * 8
    at2 = df[df["position"] == 2]
    assert at2["expert"].tolist() == [2, 3, 0, 1]
    np.testing.assert_allclose(at2["weight"], [0.75, 0.25, 0.52, 0.48], rtol=0, atol=1e-7)
    np.testing.assert_allclose(at2["entropy"], [3.0, 3.0, 4.0, 4.0])
    np.testing.assert_allclose(at2["margin"], [0.5, 0.5, 0.2, 0.2], rtol=0, atol=1e-7)
    assert (df["id"] == 7).all() and (df["turn"] == 0).all() and df["tag"].isna().all()
    assert df.dtypes["weight"] == np.float32 and df.dtypes["expert"] == np.int32
    assert turn.gates_df().equals(df)


def test_client_engine_gates_df(model_dir, traces):
    """The real engine through `colibri.client.Engine(gates=1)`: the frame of two turns decoded
    at once holds each generated token's routing, as the tracer gives it."""
    with Engine(model_dir, slots=2, ctx=CTX, gates=1, topk=False) as eng:
        reqs = [eng.submit(p, slot=rid - 1, max_tokens=N) for rid, p in PROMPTS.items()]
        turns = [r.wait(120) for r in reqs]
        df = eng.gates_df()
    L, K = traces[1].routes.shape[0], traces[1].routes.shape[2]
    assert len(df) == sum(len(t.tokens) for t in turns) * L * K
    for turn, trace in zip(turns, traces.values(), strict=True):
        rows = df[df["id"] == turn.id]
        n = trace.n_prompt
        first = rows[(rows["layer"] == 0) & (rows["rank"] == 0)]
        assert first["position"].tolist() == list(range(n - 1, n - 1 + len(turn.tokens)))
        assert first["step"].tolist() == list(range(len(turn.tokens)))
        assert first["token"].tolist() == list(trace.tokens[n - 1 : n - 1 + len(turn.tokens)])
        pos = rows["position"].to_numpy()
        layer, rank = rows["layer"].to_numpy(), rows["rank"].to_numpy()
        assert np.array_equal(rows["expert"].to_numpy(), trace.routes[layer, pos, rank])
        np.testing.assert_allclose(rows["weight"], trace.weights[layer, pos, rank], atol=TOL)
        np.testing.assert_allclose(rows["entropy"], trace.entropy[layer, pos], atol=TOL)
        np.testing.assert_allclose(rows["margin"], trace.margin[layer, pos], atol=TOL)
