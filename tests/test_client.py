"""colibri.client: the line dispatcher on hand-made streams, then the real engine subprocess."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from colibri import client
from colibri.client import (
    ENGINE_EXITED,
    Engine,
    EngineError,
    Request,
    RequestError,
    Session,
    perf_parts,
    read_loop,
)
from colibri.protocol.codec import (
    Accept,
    Data,
    Done,
    Emap,
    Entropy,
    Error,
    Gpus,
    Hits,
    HwInfo,
    Perf,
    Ready,
    Repin,
    Stat,
    Tiers,
    TopK,
    Unknown,
    format_event,
)

L, E = 3, 8  # the synthetic engine's MoE layers and experts
TINY = dict(layers=L, experts=E, top_k=2, hidden=64, moe_ff=32, vocab=300)
HW = HwInfo(2, 16.0, 8.0, 0, 0.0, "cpu", "")
EMAP0 = Emap(2, 4, bytes([0x80] * 8))
HANDSHAKE = [Ready(), Stat(0, 0.0, 0.0, 0.2), HW, Tiers(8, 0, 0, 0.01, 0.0), EMAP0]


def stream(*events, raw: bytes = b"") -> io.BytesIO:
    return io.BytesIO(b"".join(format_event(ev) for ev in events) + raw)


def session_with(*rids: int) -> tuple[Session, dict[int, Request]]:
    s = Session()
    reqs = {rid: Request(None, rid, slot=rid - 1, prompt=f"p{rid}") for rid in rids}
    for r in reqs.values():
        s.register(r)
    return s, reqs


def block(rid: int, entropy=(1.0, 2.0), emap=EMAP0, hits=None, dt=1.0) -> list:
    """A turn's end as the engine writes it: HWINFO PERF ENTROPY GPUS TIERS EMAP HITS DONE."""
    return [
        HW,
        Perf(rid, dt, 0.05, 0.1, 0.2, 0.3, 0.05, 0.01),
        Entropy(entropy),
        Gpus(()),
        Tiers(6, 1, 1, 0.01, 0.0),
        emap,
        hits or Hits.from_set(2, 4, [(0, rid % 4)]),
        Done(rid, 3, 10.0, 87.5, 0.3, 5, False),
    ]


# ---------------------------------------------------------------------------- dispatcher


def test_handshake_sets_state_and_ready():
    s = Session()
    read_loop(stream(*HANDSHAKE, Gpus(())), s)  # an extra kind after EMAP is allowed
    h = s.handshake
    assert s.ready.is_set() and s.closed.is_set()
    assert (h.stat, h.hwinfo, h.tiers, h.emap) == tuple(HANDSHAKE[1:])
    assert s.emap == EMAP0 and s.gpus == Gpus(())


def test_every_line_kind_of_one_request():
    """DATA with UTF-8 split across frames, TOPK, ACCEPT, HITS, REPIN and the turn block."""
    s, reqs = session_with(7)
    bird, e_acute = "🐦".encode(), "é".encode()
    tick = Hits.from_set(2, 4, [(1, 2)])
    evs = [
        Accept(7, 5, 2),
        Data(7, b"caf" + e_acute[:1]),
        TopK(7, ((-0.1, b"caf"), (-2.0, b"x"))),
        Data(7, e_acute[1:] + bird[:1]),
        TopK(7, ((-0.2, b"\xc3\xa9"),)),
        Data(7, bird[1:3]),
        tick,
        Repin(1, 3, 0, 0),
        Data(7, bird[3:] + b"!"),
        *block(7, entropy=(0.5, 1.5)),
    ]
    read_loop(stream(*HANDSHAKE, *evs), s)
    turn = reqs[7].wait(0)
    assert turn.ok and turn.text == "café🐦!"
    assert turn.tokens == (b"caf\xc3", b"\xa9\xf0", b"\x9f\x90", b"\xa6!")
    assert turn.accept == Accept(7, 5, 2) and turn.done == evs[-1]
    assert turn.perf == evs[-7] and turn.hwinfo == HW
    assert turn.entropy == (0.5, 1.5) and turn.gpus == Gpus(()) and turn.emap == EMAP0
    assert turn.tiers == Tiers(6, 1, 1, 0.01, 0.0)
    assert [t.entries[0][1] for t in turn.topk] == [b"caf", b"\xc3\xa9"]
    assert turn.hits == (tick, evs[-2]) and turn.repins == (Repin(1, 3, 0, 0),)
    assert turn.routed()[1, 2] and turn.routed()[0, 3] and turn.routed().sum() == 2
    assert s.repins == [Repin(1, 3, 0, 0)] and s.hits == evs[-2] and s.turns == [turn]
    events = list(reqs[7])  # the queue holds the same events, ending with DONE
    assert events[0] == Accept(7, 5, 2) and events[-1] == evs[-1]
    datas = [ev for ev in evs if isinstance(ev, Data)]
    assert [ev for ev in events if isinstance(ev, Data)] == datas


def test_iter_text_yields_whole_characters():
    s, reqs = session_with(1)
    bird = "🐦".encode()
    read_loop(stream(*HANDSHAKE, *(Data(1, bytes([b])) for b in bird), *block(1)), s)
    assert list(reqs[1].iter_text()) == ["🐦"]


def test_unknown_kinds_are_ignored_anywhere():
    s, reqs = session_with(1)
    odd = [Unknown("FUTURE", b"FUTURE 1 2 3"), Unknown("X", b"X"), Unknown("", b"")]
    evs = [*HANDSHAKE[:3], odd[0], *HANDSHAKE[3:], Data(1, b"a"), odd[1]]
    blk = block(1)
    read_loop(stream(*evs, *blk[:3], odd[2], *blk[3:]), s)
    turn = reqs[1].wait(0)
    assert s.ready.is_set() and s.unknown == 3
    assert turn.text == "a" and turn.entropy == (1.0, 2.0) and turn.emap == EMAP0


def test_turn_blocks_while_other_requests_stream():
    """A's block lands in the middle of B's and C's streams: only A gets A's block."""
    s, reqs = session_with(1, 2, 3)
    emap_a = Emap(2, 4, bytes([0x81] * 8))
    emap_b = Emap(2, 4, bytes([0x42] * 8))
    tick = Hits.from_set(2, 4, [(0, 0)])
    evs = [
        Data(1, b"a1"),
        Data(2, b"b1"),
        tick,
        Data(3, b"c1"),
        *block(1, entropy=(1.0, 1.0), emap=emap_a),
        Data(2, b"b2"),
        Data(3, b"c2"),
        Error(3, "CANCELLED"),
        *block(2, entropy=(2.0, 2.0), emap=emap_b),
    ]
    read_loop(stream(*HANDSHAKE, *evs), s)
    a, b, c = (reqs[i].wait(0) for i in (1, 2, 3))
    assert (a.text, b.text, c.text) == ("a1", "b1b2", "c1c2")
    assert (a.entropy, a.emap, a.perf.id) == ((1.0, 1.0), emap_a, 1)
    assert (b.entropy, b.emap, b.perf.id) == ((2.0, 2.0), emap_b, 2)
    assert c.error == Error(3, "CANCELLED") and c.perf is None and c.entropy == ()
    assert tick in a.hits and tick in b.hits and tick in c.hits
    assert block(1)[6] in b.hits  # engine-wide HITS of A's block reached B in flight
    assert [t.id for t in s.turns] == [1, 3, 2] and s.emap == emap_b


def test_errors_strays_and_engine_exit():
    s, reqs = session_with(1, 2)
    read_loop(stream(*HANDSHAKE, Error(0, "BAD_REQUEST"), Error(1, "SLOT_BUSY"), Data(9, b"x")), s)
    assert reqs[1].wait(0).error == Error(1, "SLOT_BUSY")
    assert reqs[2].wait(0).error == Error(2, ENGINE_EXITED)  # EOF with 2 still open
    assert s.stray == [Error(0, "BAD_REQUEST"), Data(9, b"x")]


def test_malformed_line_is_skipped():
    s, reqs = session_with(1)
    raw = (
        b"PERF 1 not-a-number\n"
        + format_event(Data(1, b"ok"))
        + b"".join(format_event(ev) for ev in block(1))
    )
    read_loop(stream(*HANDSHAKE, raw=raw), s)
    assert reqs[1].wait(0).text == "ok" and reqs[1].wait(0).ok


def test_subscribers_see_events_with_their_request():
    s, reqs = session_with(1)
    seen = []
    unsubscribe = s.subscribe(lambda ev, req: seen.append((type(ev).__name__, req and req.id)))
    s.subscribe(lambda ev, req: 1 / 0)  # a failing subscriber does not stop the others
    read_loop(stream(*HANDSHAKE, Data(1, b"a"), Hits.from_set(2, 4, []), *block(1)), s)
    assert seen[:6] == [("Ready", None), ("Stat", None), ("HwInfo", None), ("Tiers", None)] + [
        ("Emap", None),
        ("Data", 1),
    ]
    assert ("Hits", None) in seen and seen[-1] == ("Done", 1) and ("Entropy", 1) in seen
    unsubscribe()
    n = len(seen)
    s.dispatch(Gpus(()))
    assert len(seen) == n


def test_tables_from_a_session():
    s, reqs = session_with(1, 2)
    hits = Hits.from_set(2, 4, [(1, 3)])
    emap = Emap(2, 4, bytes([0x80 | 5, 0x40 | 1, 0x00, 0x82, 0x80, 0x80, 0x41, 0xBF]))
    read_loop(stream(*HANDSHAKE, *block(1, dt=2.0), *block(2, emap=emap, hits=hits)), s)
    reqs[2].tag = "code"
    turns = s.turns_df()
    assert list(turns.id) == [1, 2] and len(turns) == 2
    assert turns.loc[0, "dt"] == 2.0 and turns.loc[1, "t_emm"] == 0.2
    assert turns.loc[0, "hit_pct"] == 87.5 and turns.loc[0, "prompt_tokens"] == 5
    ent = s.entropy_df()
    assert len(ent) == 4 and list(ent.layer) == [0, 1, 0, 1]
    em = s.emap_df()
    assert len(em) == 8 and list(em.tier) == [2, 1, 0, 2, 2, 2, 1, 2]
    assert list(em.heat) == [5, 1, 0, 2, 0, 0, 1, 63]
    assert em.set_index(["layer", "expert"]).hit.to_dict() == {
        (r, c): (r, c) == (1, 3) for r in range(2) for c in range(4)
    }
    assert em.tier_name[1] == "ram" and em.tier_name[2] == "disk"


def test_perf_parts_sum_to_dt():
    p = Perf(1, 2.0, 0.7, 0.3, 0.5, 0.4, 0.1, 0.05)
    parts = perf_parts(p)
    assert list(parts) == list(client.PERF_PARTS)
    assert parts["attention"] == pytest.approx(0.3) and parts["kv expansion"] == 0.1
    assert sum(parts.values()) == pytest.approx(2.0)
    frame = client.perf_frame(Session().turns_df())
    assert frame.empty and list(frame.columns) == list(client.PERF_PARTS)


def test_turn_times_are_defined_once():
    """dt (PERF) = prefill_s + decode_s; decode_s is the window DONE's tok_s is measured over;
    the client's own clock adds queue_s and wall_s; TURN_COLUMNS names and defines them all."""
    s, reqs = session_with(1, 2, 3)
    evs = [
        Accept(1, 5, 2),
        Data(1, b"a"),
        Data(1, b"b"),
        Data(1, b"c"),
        *block(1, dt=1.0),  # DONE: 3 tokens at 10 tok/s: decode 0.2 s, so prefill 0.8 s
        Accept(2, 4, 0),
        Data(2, b"x"),
        HW,
        Perf(2, 0.3, 0, 0, 0, 0, 0, 0),
        Done(2, 1, 0.0, 50.0, 0.3, 4, True),  # one token: no decode window
        Accept(3, 4, 0),
        HW,
        Perf(3, 0.1, 0, 0, 0, 0, 0, 0),
        Done(3, 0, 0.0, 50.0, 0.3, 4, True),
    ]
    read_loop(stream(*HANDSHAKE, *evs), s)
    t1, t2, t3 = (reqs[i].wait(0) for i in (1, 2, 3))
    assert t1.decode_s == pytest.approx(0.2) and t1.prefill_s == pytest.approx(0.8)
    assert (t2.decode_s, t2.prefill_s) == (0.0, pytest.approx(0.3))
    assert (t3.decode_s, t3.prefill_s) == (0.0, pytest.approx(0.1))
    c = t1.clock
    assert c.submit <= c.accept <= c.first <= c.last <= c.end
    assert 0 <= c.queue_s <= c.wall_s and t3.clock.first is None
    df = s.turns_df()
    assert list(df.columns) == list(client.TURN_COLUMNS)
    assert list(client.turn_columns().index) == list(client.TURN_COLUMNS)
    assert df.prefill_s.tolist() == pytest.approx([0.8, 0.3, 0.1])
    assert df.decode_s.tolist() == pytest.approx([0.2, 0.0, 0.0])
    assert (df.prefill_s + df.decode_s).tolist() == pytest.approx(df.dt.tolist())
    assert df.prefill_tok_s[0] == pytest.approx((5 - 2) / 0.8)  # tokens actually prefilled
    assert (df.queue_s >= 0).all() and (df.wall_s >= df.queue_s).all()
    # a rate of 0 for more than one token cannot give a window; a long decode never makes
    # prefill negative (tok_s has 2 decimals on the wire)
    assert np.isnan(client.decode_seconds(Done(9, 3, 0.0, 0, 0, 1, False)))
    assert client.prefill_seconds(0.5, Done(9, 101, 199.99, 0, 0, 1, False)) == 0.0
    assert np.isnan(client.turns_frame([]).reindex([0]).prefill_s[0])


def test_grids_match_codec_accessors():
    rng = np.random.default_rng(0)
    emap = Emap(3, 5, rng.integers(0, 256, 15, dtype=np.uint8).tobytes())
    cells = {(int(r), int(c)) for r, c in rng.integers(0, [3, 5], (6, 2))}
    hits = Hits.from_set(3, 5, cells)
    for r in range(3):
        for c in range(5):
            assert client.tier_grid(emap)[r, c] == emap.tier(r, c)
            assert client.heat_grid(emap)[r, c] == emap.heat(r, c)
            assert client.hits_grid(hits)[r, c] == hits.hit(r, c)


# ---------------------------------------------------------------------------- real engine


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("client") / "synth"
    return client.synthetic_model(out, **TINY)


@pytest.fixture(scope="module")
def engine(model):
    e = Engine(model, slots=4, ctx=1024)  # room for a turn long enough to STOP mid-way
    yield e
    assert e.close() == 0, e.stderr()


def test_engine_handshake(engine):
    h = engine.session.handshake
    assert (h.emap.rows, h.emap.cols) == (L, E)
    assert h.tiers.vram + h.tiers.ram + h.tiers.disk == L * E
    assert h.stat.emitted == 0 and h.hwinfo.cores >= 1 and engine.alive


def test_engine_concurrent_submits_from_threads(engine):
    prompts = ["def add(a, b):", "naïve café 🐦", "The quick brown fox", "int main(void) {"]
    reqs: list[Request] = []
    lock = threading.Lock()

    def go(i: int) -> None:
        r = engine.submit(prompts[i], slot=i, max_tokens=10, tag=f"p{i}")
        with lock:
            reqs.append(r)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    turns = [r.wait(120) for r in reqs]
    assert len({t.id for t in turns}) == 4
    for t in turns:
        assert t.ok, t.error
        assert t.text == b"".join(t.tokens).decode("utf-8", errors="replace")
        assert t.done.emitted == len(t.tokens) and len(t.topk) == len(t.tokens)
        assert t.perf.id == t.id and len(t.entropy) == L
        assert all(0.0 <= h <= np.log2(E) + 1e-6 for h in t.entropy)
        assert (t.emap.rows, t.emap.cols) == (L, E) and t.hits and t.tiers is not None
        assert t.accept.prompt_tokens == t.done.prompt_tokens
        assert t.prompt == prompts[t.slot] and t.tag == f"p{t.slot}"
    # greedy: the same prompt on another slot gives the same text
    again = engine.generate(prompts[0], slot=3, max_tokens=10, timeout=120)
    first = next(t for t in turns if t.slot == 0)
    assert again.text == first.text


def test_engine_tables(engine):
    engine.generate("free of charge", slot=0, max_tokens=4, tag="x", timeout=120)
    turns = engine.turns_df()
    ok = [t for t in engine.turns if t.ok]
    assert len(turns) == len(ok) and list(turns.id) == [t.id for t in ok]
    assert (turns.dt > 0).all() and (turns.emitted >= 0).all()
    assert turns.iloc[-1].tag == "x"
    ent = engine.entropy_df()
    assert len(ent) == L * len(ok) and set(ent.layer) == set(range(L))
    em = engine.emap_df()
    assert len(em) == L * E and set(em.tier) <= {0, 1, 2}
    assert em.heat.max() > 0  # experts were selected: cumulative heat shows it


def test_engine_turn_times(engine):
    """On a real engine: the client's wall time holds the engine's window, which splits into
    prefill and decode; the request's live rate and elapsed time are there while it runs."""
    r = engine.submit("The quick brown fox", slot=0, max_tokens=12)
    turn = r.wait(120)
    row = engine.turns_df().set_index("id").loc[turn.id]
    dt = row["dt"]  # (a Series' .dt is pandas' datetime accessor)
    assert dt == pytest.approx(row.prefill_s + row.decode_s, abs=1e-3)
    assert 0 <= row.prefill_s <= dt and row.queue_s >= 0
    assert row.wall_s >= dt - 0.01  # submit..DONE read holds acceptance..DONE
    assert r.running_s() == pytest.approx(turn.clock.end - turn.clock.accept)
    if turn.done.emitted >= 2:
        assert row.decode_s > 0 and r.live_tok_s() > 0


def test_engine_errors_and_stop(engine):
    with pytest.raises(RequestError, match="BAD_REQUEST"):
        engine.generate("x", slot=99, timeout=60)
    with pytest.raises(RequestError, match="EMPTY_PROMPT"):
        engine.generate("", slot=0, timeout=60)
    # ~1,000 tokens: long enough that the STOP lands mid-turn even on a loaded machine
    r = engine.submit("jumps over the lazy", slot=1, max_tokens=1000)
    for ev in r:
        if isinstance(ev, Data):
            r.stop()
            break
    turn = r.wait(60)
    assert turn.ok and 1 <= turn.done.emitted < 1000 and not turn.done.length_limited
    c = engine.submit("to any person", slot=2, max_tokens=100)
    c.cancel()
    assert c.wait(60).error.code == "CANCELLED"
    assert engine.generate("still alive", slot=0, max_tokens=2, timeout=60).ok


def test_close_is_clean(model):
    e = Engine(model, slots=1, ctx=64)
    scratch = Path(e.env["STATE_DIR"])
    r = e.submit("hello", max_tokens=3)
    assert e.close() == 0  # EOF: the in-flight request finishes first
    assert r.wait(0).ok and not e.alive and not scratch.exists()
    with pytest.raises(EngineError):
        e.submit("again")
    assert e.close() == 0  # idempotent


def test_engine_that_cannot_start(tmp_path):
    with pytest.raises(EngineError, match="config.json|No such file|not found"):
        Engine(tmp_path / "missing", start_timeout=60)


def test_interpreter_exit_stops_the_engine(model):
    code = textwrap.dedent(
        f"""
        from colibri.client import Engine
        e = Engine({str(model)!r}, ctx=64)
        print(e.pid, flush=True)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(pid)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split()[2] == "Z")
