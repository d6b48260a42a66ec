"""The wire session alone: which open requests each engine line belongs to, property-tested over
random interleavings of several requests' streams, engine-wide ticks and unknown kinds."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

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
    Prof,
    Ready,
    Repin,
    Stat,
    Tiers,
    Unknown,
)
from colibri.protocol.session import Session

HW = HwInfo(2, 24.0, 20.0, 0, 0.0, "cpu", "")
EMAP = Emap(1, 4, bytes(4))
HANDSHAKE = [Ready(), Stat(0, 0.0, 0.0, 0.1), HW, Tiers(4, 0, 0, 0.0, 0.0), EMAP]
TICK = Hits.from_set(1, 4, [(0, 1)])


def block(rid: int) -> list:
    """A turn's end: HWINFO PERF ENTROPY GPUS TIERS EMAP HITS PROF DONE."""
    return [
        HW,
        Perf(rid, 1.0, 0, 0, 0, 0, 0, 0),
        Entropy((1.0,)),
        Gpus(()),
        Tiers(4, 0, 0, 0.0, 0.0),
        EMAP,
        TICK,
        Prof(1.0, 3, 2, 0, 0, 0, 0, 0, 2),
        Done(rid, 2, 1.0, 100.0, 0.1, 3, False),
    ]


@st.composite
def sessions(draw: st.DrawFn):
    """(events, expected owners): each request's ACCEPT and DATAs, then its block or an ERROR;
    the requests interleaved line by line, blocks whole, HITS/REPIN/unknown lines between."""
    n = draw(st.integers(1, 5))
    scripts = {}
    for rid in range(1, n + 1):
        lines = [Accept(rid, 3, 0)] + [Data(rid, b"x")] * draw(st.integers(0, 4))
        ends = draw(st.sampled_from(["done", "error", "open"]))
        scripts[rid] = lines + (
            {"done": [block(rid)], "error": [Error(rid, "CANCELLED")]}.get(ends, [])
        )
    events, owners, open_ids = [], [], set(range(1, n + 1))
    while any(scripts.values()):
        rid = draw(st.sampled_from(sorted(r for r, s in scripts.items() if s)))
        line = scripts[rid].pop(0)
        for ev in line if isinstance(line, list) else [line]:
            events.append(ev)
            block_line = isinstance(ev, Entropy | Gpus | Tiers | Emap | Prof)
            if isinstance(ev, Hits):
                owners.append(set(open_ids))
            elif isinstance(ev, HwInfo):
                owners.append(set())  # delivered with the PERF after it
            else:
                owners.append({rid} if block_line or hasattr(ev, "id") else set())
            if isinstance(ev, Done | Error):
                open_ids.discard(rid)
        extra = draw(st.sampled_from([None, "tick", "repin", "unknown"]))
        if extra:
            ev = {"tick": TICK, "repin": Repin(0, 1, 0, 0), "unknown": Unknown("X", b"X 1")}[extra]
            events.append(ev)
            owners.append(set(open_ids) if extra != "unknown" else set())
    return n, events, owners


@given(sessions())
def test_every_line_goes_to_the_requests_it_belongs_to(case):
    n, events, owners = case
    s = Session()
    for ev in HANDSHAKE:
        assert s.route(ev).to == ()
    assert s.ready and s.handshake.emap == EMAP and s.handshake.hwinfo == HW
    for rid in range(1, n + 1):
        s.open(rid)
    ended = []
    for i, (ev, want) in enumerate(zip(events, owners, strict=True)):
        routed = s.route(ev)
        assert set(routed.to) == want, (i, ev)
        assert not routed.stray
        if isinstance(ev, Perf):
            assert routed.before == (events[i - 1],)  # its HWINFO
        if routed.ends:
            ended.append(routed.to[0])
    assert sorted(ended) == sorted(set(range(1, n + 1)) - set(s.in_flight()))
    assert s.unknown == sum(isinstance(ev, Unknown) for ev in events)
    assert s.telemetry.profile_seq == sum(isinstance(ev, Prof) for ev in events)


def test_strays_telemetry_and_duplicate_ids():
    s = Session()
    for ev in HANDSHAKE:
        s.route(ev)
    s.open(1)
    with pytest.raises(ValueError, match="already in flight"):
        s.open(1)
    assert s.route(Error(0, "BAD_REQUEST")).stray  # an unreadable header's refusal
    assert s.route(Data(9, b"x")).stray
    assert s.route(Entropy((0.5,))).to == ()  # no block open: engine-wide only
    assert s.telemetry.entropy == Entropy((0.5,))
    seq = s.telemetry.seq
    s.route(TICK)
    assert s.telemetry.hits == TICK and s.telemetry.seq == seq + 1
    assert s.route(Done(1, 0, 0.0, 100.0, 0.1, 3, False)).ends
    assert s.in_flight() == [] and s.route(Done(1, 0, 0.0, 100.0, 0.1, 3, False)).stray
