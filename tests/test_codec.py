"""Wire codec: exact bytes, round trips, request refusals and fuzzed streams never raising."""

import io

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri.protocol.codec import (
    MAX_HEADER,
    Accept,
    Cancel,
    Data,
    Done,
    Emap,
    Entropy,
    Error,
    FrameError,
    Gates,
    Gpus,
    Hits,
    HwInfo,
    Perf,
    Prof,
    ProtocolError,
    Ready,
    Repin,
    Stat,
    Stop,
    Submit,
    Tiers,
    TopK,
    Unknown,
    UTF8Assembler,
    format_event,
    format_request,
    read_event,
    read_request,
)

# ---------------------------------------------------------------------------- strategies

ids = st.integers(1, 2**64 - 1)
counts = st.integers(0, 10**6)
signed = st.integers(-(10**6), 10**6)


def fixed(places: int, lo: int = -(10**9), hi: int = 10**9) -> st.SearchStrategy[float]:
    """Floats that survive their wire format exactly: k / 10**places."""
    return st.integers(lo, hi).map(lambda k: k / 10**places)


gb, sec = fixed(2, 0), fixed(6, 0)
name_chars = st.characters(blacklist_categories=("Cs",), blacklist_characters="\n|")
word = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\n "), max_size=12)


@st.composite
def emaps(draw: st.DrawFn) -> Emap:
    rows, cols = draw(st.integers(0, 6)), draw(st.integers(0, 9))
    return Emap(rows, cols, draw(st.binary(min_size=rows * cols, max_size=rows * cols)))


@st.composite
def hits(draw: st.DrawFn) -> Hits:
    rows, cols = draw(st.integers(0, 6)), draw(st.integers(0, 9))
    cells = st.tuples(st.integers(0, max(rows - 1, 0)), st.integers(0, max(cols - 1, 0)))
    chosen = draw(st.sets(cells)) if rows and cols else set()
    return Hits.from_set(rows, cols, chosen)


@st.composite
def gates(draw: st.DrawFn) -> Gates:
    layers, k = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    row = st.lists(counts, min_size=k, max_size=k).map(tuple)
    wts = st.lists(fixed(7, 0), min_size=k, max_size=k).map(tuple)
    per_layer = st.lists(fixed(7, 0), min_size=layers, max_size=layers).map(tuple)
    experts = tuple(draw(row) for _ in range(layers))
    weights = tuple(draw(wts) for _ in range(layers))
    entropy, margin = draw(per_layer), draw(per_layer)
    return Gates(draw(ids), draw(counts), draw(counts), experts, weights, entropy, margin)


events = st.one_of(
    st.just(Ready()),
    st.builds(Stat, counts, fixed(2, 0), fixed(1, 0, 1000), gb),
    st.builds(
        HwInfo, counts, gb, gb, counts, gb, st.text(name_chars), st.text(name_chars | st.just("|"))
    ),
    st.builds(Tiers, counts, counts, counts, gb, gb),
    emaps(),
    hits(),
    st.builds(Data, ids, st.binary(max_size=40)),
    st.builds(
        TopK, ids, st.lists(st.tuples(fixed(4), st.binary(max_size=8)), max_size=6).map(tuple)
    ),
    gates(),
    st.builds(Repin, signed, signed, signed, signed),
    st.builds(Perf, ids, sec, sec, sec, sec, sec, sec, sec),
    st.builds(Prof, fixed(3, 0), counts, counts, *[fixed(3, 0)] * 5, counts),
    st.builds(Entropy, st.lists(fixed(4, 0), max_size=8).map(tuple)),
    st.builds(Gpus, st.lists(st.tuples(gb, gb, counts), max_size=4).map(tuple)),
    st.builds(Done, ids, counts, fixed(2, 0), fixed(1, 0, 1000), gb, counts, st.booleans()),
    st.builds(Error, ids, word, st.lists(word, max_size=3).map(tuple)),
    st.builds(Accept, ids, counts, counts),
    st.builds(
        Unknown,
        st.just("FUTURE"),
        st.binary(max_size=30).map(lambda b: b"FUTURE " + b.replace(b"\n", b"")),
    ),
)

utf8 = st.characters(blacklist_categories=("Cs",), blacklist_characters="\0")
valid_submits = st.builds(
    Submit,
    ids,
    st.integers(0, 3),
    st.integers(1, 4096),
    st.floats(0.0, 2.0),
    st.floats(0.0, 1.0, exclude_min=True),
    st.text(utf8, min_size=1).map(str.encode),
    st.one_of(st.just(b""), st.text(utf8, max_size=40).map(str.encode)),
)
requests = st.one_of(valid_submits, st.builds(Cancel, ids), st.builds(Stop, ids))


def events_of(data: bytes) -> list:
    stream, out = io.BytesIO(data), []
    while (ev := read_event(stream)) is not None:
        out.append(ev)
    return out


def requests_of(data: bytes, kv_slots: int = 4) -> list:
    stream, out = io.BytesIO(data), []
    while (req := read_request(stream, kv_slots)) is not None:
        out.append(req)
    return out


# ---------------------------------------------------------------------------- exact bytes

EXACT = [
    (Ready(), b"\x01\x01READY\x01\x01\n"),
    (Stat(0, 0.0, 0.0, 0.4242), b"STAT 0 0.00 0.0 0.42\n"),
    (
        HwInfo(16, 125.5, 100.254, 1, 139.8, "AMD EPYC 9654 96-Core", "NVIDIA H200"),
        b"HWINFO 16 125.50 100.25 1 139.80 AMD EPYC 9654 96-Core|NVIDIA H200\n",
    ),
    (HwInfo(2, 24.0, 20.0, 0, 0.0, "cpu", ""), b"HWINFO 2 24.00 20.00 0 0.00 cpu|\n"),
    (Tiers(10, 20, 30, 1.5, 2.25), b"TIERS 10 20 30 1.50 2.25\n"),
    (Emap(1, 2, bytes([0x85, 0x03])), b"EMAP 1 2 8503\n"),
    (Hits.from_set(2, 5, {(0, 0), (1, 4)}), b"HITS 2 5 0102\n"),
    (Data(5, b"a\nb"), b"DATA 5 3\na\nb\n"),
    (TopK(3, ((-0.1, b"hi"), (-2.5, b" "))), b"TOPK 3 2 -0.1000 6869 -2.5000 20\n"),
    (TopK(3, ((-0.5, b""),)), b"TOPK 3 1 -0.5000 \n"),
    (
        Gates(3, 17, 42, ((5, 1),), ((0.75, 0.25),), (1.5,), (0.5,)),
        b"GATES 3 17 42 1 2 5 1 0.7500000 0.2500000 1.5000000 0.5000000\n",
    ),
    (Repin(4, 17, 1, 0), b"REPIN 4 17 1 0\n"),
    (
        Perf(9, 1.5, 0.25, 0.125, 0.5, 0.3, 0.0, 0.01),
        b"PERF 9 1.500000 0.250000 0.125000 0.500000 0.300000 0.000000 0.010000\n",
    ),
    (
        Prof(2.5, 30, 12, 0.0, 0.125, 1.25, 0.5, 0.0625, 17),
        b"PROF 2.500 30 12 0.000 0.125 1.250 0.500 0.062 17\n",
    ),
    (Entropy((1.5, 0.25)), b"ENTROPY 1.5000 0.2500\n"),
    (Entropy(()), b"ENTROPY\n"),
    (Gpus(()), b"GPUS 0\n"),
    (Gpus(((12.5, 139.8, 300),)), b"GPUS 1 12.50 139.80 300\n"),
    (Done(7, 12, 3.456, 87.26, 1.5, 30, True), b"DONE 7 STAT 12 3.46 87.3 1.50 30 1\n"),
    (Error(4, "CONTEXT_EXCEEDED", ("5000", "4096")), b"ERROR 4 CONTEXT_EXCEEDED 5000 4096\n"),
    (Error(4, "CANCELLED"), b"ERROR 4 CANCELLED\n"),
    (Accept(4, 120, 100), b"ACCEPT 4 120 100\n"),
]


@pytest.mark.parametrize(("event", "wire"), EXACT, ids=[type(e).__name__ for e, _ in EXACT])
def test_exact_bytes(event, wire):
    assert format_event(event) == wire
    parsed = events_of(wire)
    assert len(parsed) == 1
    assert format_event(parsed[0]) == wire


def test_requests_exact_bytes():
    submit = Submit(1, 0, 16, 0.7, 0.9, b"hi\nthere")
    assert format_request(submit) == b"SUBMIT 1 0 8 16 0.7 0.9\nhi\nthere\n"
    # the grammar follows the payload with no separator, as colibrì's gateway writes it
    grammar = Submit(2, 1, 16, 0.0, 1.0, b"hi", b'{"type":"object"}')
    assert format_request(grammar) == b'SUBMIT 2 1 2 16 0.0 1.0 17\nhi{"type":"object"}\n'
    assert format_request(Cancel(12)) == b"CANCEL 12\n"
    assert format_request(Stop(12)) == b"STOP 12\n"


def test_spec_handshake_parses():
    wire = (
        b"\x01\x01READY\x01\x01\nSTAT 0 0.00 0.0 0.42\n"
        b"HWINFO 2 23.40 19.10 0 0.00 Intel(R) Xeon(R) CPU @ 2.20GHz|\n"
        b"TIERS 0 0 96 0.00 0.00\nEMAP 2 3 000102414243\nGPUS 0\n"
    )
    ready, stat, hw, tiers, emap, gpus = events_of(wire)
    assert ready == Ready() and stat == Stat(0, 0.0, 0.0, 0.42)
    assert hw.cpu_name == "Intel(R) Xeon(R) CPU @ 2.20GHz" and hw.gpu_name == ""
    assert tiers == Tiers(0, 0, 96, 0.0, 0.0) and gpus == Gpus(())
    assert (emap.tier(1, 2), emap.heat(1, 2)) == (1, 3)
    assert (emap.tier(0, 2), emap.heat(0, 2)) == (0, 2)


def test_accept_without_reused_tokens():
    assert events_of(b"ACCEPT 3 17\n") == [Accept(3, 17, 0)]


# ---------------------------------------------------------------------------- round trips


@given(events)
def test_every_kind_round_trips(event):
    assert events_of(format_event(event)) == [event]


@given(st.lists(events, max_size=12))
def test_streams_round_trip(evs):
    assert events_of(b"".join(map(format_event, evs))) == evs


@given(requests)
def test_requests_round_trip(req):
    assert requests_of(format_request(req)) == [req]


@given(st.integers(0, 5), st.integers(0, 11), st.data())
def test_hits_bits(rows, cols, data):
    cells = st.tuples(st.integers(0, rows - 1), st.integers(0, cols - 1))
    chosen = data.draw(st.sets(cells)) if rows and cols else set()
    h = Hits.from_set(rows, cols, chosen)
    assert len(h.bits) == (rows * cols + 7) // 8 and h.cells() == chosen
    assert format_event(h).split(b" ")[-1].strip() == h.bits.hex().encode()
    for row, col in chosen:
        assert h.hit(row, col)
        assert not h.with_hit(row, col, False).hit(row, col)
        assert h.with_hit(row, col, False).with_hit(row, col) == h


def test_hits_bit_order_is_row_major_lsb_first():
    """As colibrì's engine writes HITS and its web UI reads them: bit i & 7 of byte i >> 3."""
    h = Hits.from_set(1, 11, {(0, 7), (0, 8), (0, 10)})
    assert h.bits == bytes([0x80, 0x05])


def test_map_sizes_are_checked():
    with pytest.raises(ValueError, match="EMAP 2x2"):
        Emap(2, 2, b"\0")
    with pytest.raises(ValueError, match="HITS 3x3"):
        Hits(3, 3, b"\0")
    with pytest.raises(IndexError):
        Emap(1, 1, b"\0").tier(1, 0)


# ---------------------------------------------------------------------------- DATA and text


def test_split_utf8_reassembles():
    text = "héllo 🐦 世界"
    raw = text.encode()
    wire = b"".join(format_event(Data(1, raw[i : i + 1])) for i in range(len(raw)))
    asm = UTF8Assembler()
    pieces = [asm.feed(ev.payload) for ev in events_of(wire)]
    assert "".join(pieces) + asm.flush() == text
    assert "" in pieces  # some frames held part of a character back


@given(st.text(st.characters(blacklist_categories=("Cs",))), st.lists(st.integers(0, 64)))
def test_split_utf8_any_cut(text, cuts):
    raw = text.encode()
    bounds = sorted({0, len(raw), *(c for c in cuts if c < len(raw))})
    frames = [raw[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    wire = b"".join(format_event(Data(9, f)) for f in frames)
    asm = UTF8Assembler()
    got = "".join(asm.feed(ev.payload) for ev in events_of(wire)) + asm.flush()
    assert got == text


def test_data_payload_may_hold_anything():
    payload = b"DATA 1 2\n\x00\xff\n\n"
    assert events_of(format_event(Data(2, payload)) + b"GPUS 0\n") == [Data(2, payload), Gpus(())]


def test_incomplete_utf8_flushes_as_replacement():
    asm = UTF8Assembler()
    assert asm.feed("é".encode()[:1]) == ""
    assert asm.flush() == "\ufffd"


class Trickle(io.RawIOBase):
    """A pipe that hands out one byte per read, as a raw stream may."""

    def __init__(self, data: bytes) -> None:
        self._buf = io.BytesIO(data)

    def readline(self, size: int = -1) -> bytes:
        return self._buf.readline(size)

    def read(self, size: int = -1) -> bytes:
        return self._buf.read(min(size, 1) if size > 0 else size)


def test_short_reads_still_frame():
    wire = format_event(Data(1, b"abcdef")) + b"GPUS 0\n"
    stream = Trickle(wire)
    assert read_event(stream) == Data(1, b"abcdef")
    assert read_event(stream) == Gpus(())
    req = Submit(1, 0, 4, 1.0, 1.0, b"hello")
    assert read_request(Trickle(format_request(req)), 1) == req


# ---------------------------------------------------------------------------- robustness of events


def test_unknown_kinds_parse_as_unknown():
    wire = b"FUTURE 1 2 3\n\x01\x01END\x01\x01\nGPUS 0\n"
    assert events_of(wire) == [
        Unknown("FUTURE", b"FUTURE 1 2 3"),
        Unknown("\x01\x01END\x01\x01", b"\x01\x01END\x01\x01"),
        Gpus(()),
    ]


def test_overlong_unknown_line_is_truncated_not_buffered():
    wire = b"BLOB " + b"x" * 5000 + b"\nGPUS 0\n"
    stream = io.BytesIO(wire)
    ev = read_event(stream, max_line=100)
    assert isinstance(ev, Unknown) and ev.kind == "BLOB" and len(ev.raw) == 100
    assert read_event(stream) == Gpus(())


@pytest.mark.parametrize(
    "wire",
    [
        b"STAT 0 0.00\n",
        b"DONE 1 XSTAT 1 1.00 1.0 1.00 1 0\n",
        b"DONE 1 STAT 1 1.00 1.0 1.00 1 2\n",
        b"EMAP 2 2 00\n",
        b"HITS 2 2 zz\n",
        b"TOPK 1\n",
        b"GATES 1 0 5 1 2 3 4 0.5 0.5 1.0\n",
        b"GPUS 2 1.00 2.00 3\n",
        b"HWINFO 1 1.00 1.00 0 0.00 no-separator\n",
        b"DATA 1 3\nabcX",
        b"DATA x 3\nabc\n",
    ],
)
def test_malformed_known_lines_raise_protocol_error(wire):
    with pytest.raises(ProtocolError):
        events_of(wire)


@pytest.mark.parametrize("wire", [b"", b"GPUS 0", b"DATA 1 5\nab", b"DATA 1 2\nab"])
def test_eof_mid_line_or_frame_ends_the_stream(wire):
    assert read_event(io.BytesIO(wire)) is None


@settings(max_examples=300)
@given(st.binary(max_size=300))
def test_random_engine_bytes_only_raise_protocol_error(data):
    stream = io.BytesIO(data)
    for _ in range(len(data) + 1):
        try:
            if read_event(stream) is None:
                return
        except ProtocolError:
            pass
    pytest.fail("reader did not reach EOF")


# ---------------------------------------------------------------------------- request refusals


def submit(head: bytes, payload: bytes = b"hi") -> bytes:
    return b"SUBMIT " + head + b"\n" + payload + b"\n"


def first(wire: bytes, kv_slots: int = 4):
    return read_request(io.BytesIO(wire), kv_slots)


REFUSALS = {
    "id not a number": (submit(b"x 0 2 16 0.7 0.9"), "BAD_REQUEST", 0),
    "id zero": (submit(b"0 0 2 16 0.7 0.9"), "BAD_REQUEST", 0),
    "id over u64": (submit(b"18446744073709551616 0 2 16 0.7 0.9"), "BAD_REQUEST", 0),
    "too few fields": (submit(b"5 0 2 16 0.7"), "BAD_REQUEST", 0),
    "grammar count not a number but payload drained": (
        submit(b"x 0 2 16 0.7 0.9 3", b"hi{a}"),
        "BAD_REQUEST",
        0,
    ),
    "slot not a number": (submit(b"5 a 2 16 0.7 0.9"), "BAD_REQUEST", 0),
    "slot == kv_slots": (submit(b"5 4 2 16 0.7 0.9"), "BAD_REQUEST", 5),
    "slot negative": (submit(b"5 -1 2 16 0.7 0.9"), "BAD_REQUEST", 5),
    "temperature high": (submit(b"5 0 2 16 2.01 0.9"), "BAD_REQUEST", 5),
    "temperature negative": (submit(b"5 0 2 16 -0.1 0.9"), "BAD_REQUEST", 5),
    "temperature nan": (submit(b"5 0 2 16 nan 0.9"), "BAD_REQUEST", 5),
    "digit separators": (submit(b"5 0 2 16 0_1 0.9"), "BAD_REQUEST", 0),
    "top_p zero": (submit(b"5 0 2 16 0.7 0"), "BAD_REQUEST", 5),
    "top_p over one": (submit(b"5 0 2 16 0.7 1.01"), "BAD_REQUEST", 5),
    "max_tokens zero": (submit(b"5 0 2 0 0.7 0.9"), "BAD_REQUEST", 5),
    "max_tokens negative": (submit(b"5 0 2 -3 0.7 0.9"), "BAD_REQUEST", 5),
    "NUL in payload": (submit(b"5 0 2 16 0.7 0.9", b"h\0"), "BAD_REQUEST", 5),
    "invalid UTF-8": (submit(b"5 0 2 16 0.7 0.9", b"\xff\xfe"), "BAD_REQUEST", 5),
    "split UTF-8 char": (submit(b"5 0 1 16 0.7 0.9", "é".encode()[:1]), "BAD_REQUEST", 5),
    "NUL in grammar": (submit(b"5 0 2 16 0.7 0.9 3", b"hia\0b"), "BAD_REQUEST", 5),
    "grammar not UTF-8": (submit(b"5 0 2 16 0.7 0.9 2", b"hi\xff\xfe"), "BAD_REQUEST", 5),
    "empty payload": (submit(b"5 0 0 16 0.7 0.9", b""), "EMPTY_PROMPT", 5),
    "unknown kind": (b"HELLO 1\n", "BAD_REQUEST", 0),
    "blank line": (b"\n", "BAD_REQUEST", 0),
    "cancel without id": (b"CANCEL\n", "BAD_REQUEST", 0),
    "cancel id zero": (b"CANCEL 0\n", "BAD_REQUEST", 0),
    "stop extra field": (b"STOP 3 4\n", "BAD_REQUEST", 0),
}


@pytest.mark.parametrize(("wire", "code", "rid"), REFUSALS.values(), ids=REFUSALS.keys())
def test_request_refusals(wire, code, rid):
    got = first(wire)
    assert isinstance(got, FrameError), got
    assert (got.code, got.id, got.fatal) == (code, rid, False)
    assert got.to_event() == Error(rid, code)


def test_boundary_values_are_accepted():
    wire = submit(b"5 3 2 1 0 1") + submit(b"6 0 2 1 2 0.0001")
    assert requests_of(wire) == [
        Submit(5, 3, 1, 0.0, 1.0, b"hi"),
        Submit(6, 0, 1, 2.0, 0.0001, b"hi"),
    ]


def test_unparseable_header_drains_its_payload():
    wire = submit(b"x 0 9 16 0.7 0.9", b"CANCEL 1\n") + b"CANCEL 2\n"
    got = requests_of(wire)
    assert len(got) == 2 and got[0].code == "BAD_REQUEST" and got[0].id == 0
    assert got[1] == Cancel(2)


def test_grammar_is_kept_and_the_next_request_read_whole():
    wire = submit(b"5 0 2 16 0.7 0.9 10", b"hiroot ::= x") + b"STOP 5\n"
    assert requests_of(wire) == [Submit(5, 0, 16, 0.7, 0.9, b"hi", b"root ::= x"), Stop(5)]
    zero = submit(b"6 0 2 16 0.7 0.9 0")  # a 0 count is no grammar
    assert requests_of(zero) == [Submit(6, 0, 16, 0.7, 0.9, b"hi")]


def test_oversized_grammar_is_drained_and_refused():
    stream = io.BytesIO(submit(b"5 0 2 16 0.7 0.9 50", b"hi" + b"g" * 50) + b"CANCEL 5\n")
    got = read_request(stream, 1, max_grammar=10)
    assert isinstance(got, FrameError) and (got.code, got.id, got.fatal) == (
        "BAD_REQUEST",
        5,
        False,
    )
    assert read_request(stream, 1) == Cancel(5)


UNFRAMED = {  # no way to know where the frame ends: the stream cannot be trusted any more
    "no byte count": (b"SUBMIT 5 0 two 16 0.7 0.9\nhi\n", 5),
    "grammar count not a number": (b"SUBMIT 5 0 2 16 0.7 0.9 x\nhi\n", 5),
    "too many fields": (b"SUBMIT 5 0 2 16 0.7 0.9 1 2\nhi\n", 0),
    "grammar count too small": (submit(b"5 0 2 16 0.7 0.9 3", b"hiroot"), 5),
    "grammar count too large": (submit(b"5 0 2 16 0.7 0.9 9", b"hiroot") + b"CANCEL 5\n", 5),
}


@pytest.mark.parametrize(("wire", "rid"), UNFRAMED.values(), ids=UNFRAMED.keys())
def test_a_frame_of_unknown_length_is_fatal_bad_frame(wire, rid):
    got = first(wire)
    assert isinstance(got, FrameError)
    assert (got.code, got.id, got.fatal) == ("BAD_FRAME", rid, True)


def test_wrong_byte_after_payload_is_fatal_bad_frame():
    got = first(b"SUBMIT 5 0 2 16 0.7 0.9\nhiX")
    assert isinstance(got, FrameError)
    assert (got.code, got.id, got.fatal) == ("BAD_FRAME", 5, True)


def test_truncated_payload_is_fatal_then_eof():
    stream = io.BytesIO(b"SUBMIT 5 0 10 16 0.7 0.9\nhi")
    got = read_request(stream, 1)
    assert isinstance(got, FrameError) and got.code == "BAD_FRAME" and got.fatal
    assert read_request(stream, 1) is None


def test_partial_header_at_eof_is_eof():
    assert first(b"SUBMIT 5 0 2") is None


def test_overlong_header_is_refused_and_skipped():
    wire = b"SUBMIT " + b"1" * (3 * MAX_HEADER) + b"\nSTOP 7\n"
    got = requests_of(wire)
    assert isinstance(got[0], FrameError) and (got[0].code, got[0].id) == ("BAD_REQUEST", 0)
    assert got[1:] == [Stop(7)]


def test_oversized_payload_is_drained_and_refused():
    stream = io.BytesIO(submit(b"5 0 100 16 0.7 0.9", b"x" * 100) + b"CANCEL 5\n")
    got = read_request(stream, 1, max_payload=10)
    assert isinstance(got, FrameError) and (got.code, got.id, got.fatal) == (
        "BAD_REQUEST",
        5,
        False,
    )
    assert read_request(stream, 1) == Cancel(5)


def test_huge_byte_count_ends_at_eof():
    got = first(b"SUBMIT 5 0 99999999999999999999 16 0.7 0.9\nshort")
    assert isinstance(got, FrameError) and got.code == "BAD_FRAME" and got.fatal


# ---------------------------------------------------------------------------- fuzzed requests


def drain(data: bytes, kv_slots: int = 2) -> list:
    """Read requests until EOF, checking every call consumes input: the loop must end."""
    stream, out = io.BytesIO(data), []
    while True:
        before = stream.tell()
        got = read_request(stream, kv_slots)
        if got is None:
            return out
        assert stream.tell() > before
        assert isinstance(got, Submit | Cancel | Stop | FrameError)
        out.append(got)


@settings(max_examples=300)
@given(st.binary(max_size=400))
def test_random_request_bytes_never_raise(data):
    drain(data)


@st.composite
def mutated_streams(draw: st.DrawFn) -> bytes:
    wire = bytearray(b"".join(map(format_request, draw(st.lists(requests, max_size=5)))))
    for _ in range(draw(st.integers(0, 6))):
        at = draw(st.integers(0, len(wire)))
        op = draw(st.sampled_from(["flip", "insert", "delete"]))
        byte = draw(st.sampled_from([b"\n", b" ", b"0", b"9", b"-", b"\0", b"\xff", b"S"]))
        if op == "insert" or not wire:
            wire[at:at] = byte
        elif op == "delete":
            del wire[min(at, len(wire) - 1)]
        else:
            wire[min(at, len(wire) - 1)] = byte[0]
    return bytes(wire)


@settings(max_examples=400)
@given(mutated_streams())
def test_mutated_request_streams_never_raise(data):
    drain(data)


@given(st.lists(requests, max_size=6))
def test_request_streams_round_trip(reqs):
    assert drain(b"".join(map(format_request, reqs)), kv_slots=4) == reqs
