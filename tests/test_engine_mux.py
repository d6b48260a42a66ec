"""The mux engine as a black box: the real `colibri engine` subprocess on a tiny checkpoint.

Most tests share one engine (16 slots, CTX 512, TOPK on) and use their own ids and slots; the
restart, fatal-frame and fuzz tests start their own processes. Requests that a test CANCELs,
STOPs or signals while they decode ask for hundreds of tokens: short ones can end before a
loaded client sends its frame.
"""

from __future__ import annotations

import math
import queue
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from engine_util import Mux, Reference, ended, of, request, spawn, text
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colibri.engine.kvstore import KVStore, fingerprint
from colibri.engine.scheduler import Accepted, Failed, GenRequest, HitsTick, Token, common_prefix
from colibri.engine.settings import EngineSettings, SettingsError
from colibri.experts.budget import TierConfig
from colibri.experts.stats import RepinEvent
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
    TopK,
    Unknown,
    UTF8Assembler,
)
from colibri.serve import mux
from colibri.serve.stdio import Inbox

CTX = 512
SHARED = dict(KV_SLOTS="16", CTX=str(CTX), SERVE_TOPK="1")
SMALL = dict(KV_SLOTS="2", CTX="64", NGEN="4")  # fatal-frame and fuzz processes
PROMPTS = [
    "def add(a, b):",
    "The quick brown fox",
    "Der schnelle braune",
    "Le renard brun",
    "int main(void) {",
    "Permission is hereby",
    "emoji 🐦 colibrì",
    "return a + b",
    "jumps over the lazy",
    "springt über den",
    "saute par-dessus",
    'printf("hello',
    "free of charge",
    "naïve café",
    "to any person",
    "The lazy dog",
]
TURN_BLOCK = [HwInfo, Perf, Entropy, Gpus, Tiers, Emap, Hits, Prof, Done]


@pytest.fixture(scope="module")
def model_dir(checkpoints):
    return checkpoints("qwen3_moe")


@pytest.fixture(scope="module")
def ref(model_dir):
    return Reference(model_dir, CTX)


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    e = Mux(model_dir, STATE_DIR=str(state), **SHARED)
    e.state = state
    yield e
    status = e.close()
    e.kill()
    assert status == 0, e.stderr()


def _accept(evs: list) -> Accept:
    return next(ev for ev in evs if isinstance(ev, Accept))


def _ngpu() -> int:
    return sum(d.platform == "gpu" for d in jax.devices())


# ---------------------------------------------------------------------------- shared engine


def test_handshake_order_and_content(engine, ref):
    assert [type(ev) for ev in engine.handshake] == [Ready, Stat, HwInfo, Tiers, Emap]
    stat, hw, tiers, emap = engine.handshake[1:]
    assert (stat.emitted, stat.tok_s, stat.hit_pct) == (0, 0.0, 0.0) and stat.rss_gb > 0
    assert hw.cores >= 1 and hw.ram_total_gb >= hw.ram_avail_gb > 0 and hw.ngpu == _ngpu()
    cfg = ref.model.cfg
    assert (emap.rows, emap.cols) == (len(cfg.moe_layer_ids), cfg.moe.num_experts)
    assert tiers.vram + tiers.ram + tiers.disk == emap.rows * emap.cols


def test_round_trip_topk_hits_and_turn_block(engine, ref):
    prompt = "The quick brown fox"
    engine.submit(1, 0, prompt, max_tokens=20)
    evs = engine.collect(1)
    n_prompt = len(ref.tokenizer.encode(prompt))
    assert _accept(evs) == Accept(1, n_prompt, 0)
    assert text(evs, 1) == ref.text(prompt, 20)

    stream = [ev for ev in evs if isinstance(ev, Data | TopK)]
    assert [type(ev) for ev in stream] == [Data, TopK] * (len(stream) // 2)
    for data, topk in zip(stream[::2], stream[1::2], strict=True):
        lps = [lp for lp, _ in topk.entries]
        assert len(lps) == 5 and lps == sorted(lps, reverse=True) and lps[0] <= 0
        assert topk.entries[0][1] == data.payload  # greedy: the chosen token is the best

    assert [type(ev) for ev in evs[-len(TURN_BLOCK) :]] == TURN_BLOCK
    hw, perf, ent, gpus, tiers, emap, hits, prof, done = evs[-len(TURN_BLOCK) :]
    n_data = sum(isinstance(ev, Data) for ev in evs)
    assert done == Done(1, n_data, done.tok_s, done.hit_pct, done.rss_gb, n_prompt, n_data == 20)
    assert (prof.prompt_tokens, prof.completion_tokens) == (n_prompt, n_data)
    assert abs(prof.wall_s - perf.dt) < 2e-3 and prof.forwards >= n_data
    assert done.tok_s > 0 and 0 <= done.hit_pct <= 100
    assert perf.id == 1 and perf.dt > 0 and min(perf.t_edisk, perf.t_emm, perf.t_head) >= 0
    assert len(ent.values) == emap.rows
    assert all(0 <= h <= math.log2(emap.cols) + 1e-6 for h in ent.values)
    assert len(gpus.devices) == _ngpu() and hw.ngpu == _ngpu()

    # HITS every 6 decode steps: alone in the engine, one DATA per step
    between, gaps = None, []
    for ev in evs[1:-8]:
        if isinstance(ev, Hits):
            if between is not None:
                gaps.append(between)
            between = 0
        elif isinstance(ev, Data) and between is not None:
            between += 1
    assert gaps and set(gaps) == {6}

    # .coli_usage is rewritten at every turn end
    usage = (engine.state / ".coli_usage").read_text()
    assert usage.startswith(f"-1 {emap.rows} {emap.cols}\n-2 1 ")
    engine.submit(2, 0, "Der schnelle", max_tokens=3)
    engine.collect(2)
    assert (engine.state / ".coli_usage").read_text() != usage


def test_sixteen_prompts_batch_exactly_and_interleave(engine, ref):
    ids = list(range(100, 116))
    engine.send(
        b"".join(
            request(rid, s, p, 12) for s, (rid, p) in enumerate(zip(ids, PROMPTS, strict=True))
        )
    )
    evs = engine.collect(*ids)
    for rid, prompt in zip(ids, PROMPTS, strict=True):
        assert text(evs, rid) == ref.text(prompt, 12), prompt
        assert isinstance(of(evs, rid)[-1], Done)
    order = [ev.id for ev in evs if isinstance(ev, Data)]
    runs = 1 + sum(a != b for a, b in zip(order, order[1:], strict=False))
    assert runs > 4 * len(ids)  # frames of different requests alternate, step after step


def test_utf8_split_across_data_frames_reassembles(engine, ref):
    ids = [50, 51, 52]
    engine.send(b"".join(request(rid, 7 + i, PROMPTS[i], 100, 1.0) for i, rid in enumerate(ids)))
    evs = engine.collect(*ids)
    split = 0
    for rid in ids:
        frames = [ev.payload for ev in evs if isinstance(ev, Data) and ev.id == rid]
        joined = b"".join(frames)
        asm = UTF8Assembler()
        assembled = "".join(asm.feed(f) for f in frames) + asm.flush()
        assert assembled == joined.decode("utf-8", errors="replace")
        split += _split_chars(frames)
    assert split >= 1, "no multi-byte character straddled two DATA frames in these samples"


def _split_chars(frames: list[bytes]) -> int:
    """Valid multi-byte UTF-8 characters in the joined frames that straddle a frame boundary."""
    joined, cuts, at = b"".join(frames), set(), 0
    for f in frames:
        at += len(f)
        cuts.add(at)
    count, i = 0, 0
    while i < len(joined):
        lead = joined[i]
        n = 2 if 0xC2 <= lead < 0xE0 else 3 if 0xE0 <= lead < 0xF0 else 4 if lead < 0xF5 else 1
        n = 1 if lead < 0x80 else n
        try:
            joined[i : i + n].decode("utf-8")
        except UnicodeDecodeError:
            i += 1
            continue
        count += n > 1 and any(i < c < i + n for c in cuts)
        i += n
    return count


def test_prefix_reuse_prefills_only_the_suffix(engine, ref):
    enc = ref.tokenizer.encode
    p1 = "Le renard brun rapide"
    p2 = p1 + " saute par-dessus le chien paresseux."
    engine.submit(20, 3, p1, 10)
    first = engine.collect(20)
    assert _accept(first).prompt_tokens == len(enc(p1))  # slot 3 held "Le renard brun" before
    engine.submit(21, 3, p2, 10)
    second = engine.collect(21)
    reused = common_prefix(enc(p1), enc(p2))
    assert reused >= len(enc(p1)) - 1 and reused > 0
    assert _accept(second) == Accept(21, len(enc(p2)), reused)
    assert text(second, 21) == ref.text(p2, 10)  # reuse changes speed, never tokens
    engine.submit(22, 3, p2, 10)  # the same prompt again: all but its last token are cached
    again = engine.collect(22)
    assert _accept(again) == Accept(22, len(enc(p2)), len(enc(p2)) - 1)
    assert text(again, 22) == text(second, 21)
    engine.submit(23, 3, "Permission is hereby", 10)  # a different conversation truncates
    other = engine.collect(23)
    assert _accept(other).reused_tokens == common_prefix(enc(p2), enc("Permission is hereby"))
    assert text(other, 23) == ref.text("Permission is hereby", 10)


def test_a_huge_prompt_is_refused_without_being_tokenized(engine, ref):
    """Its byte count alone proves it longer than the context: refused at once (the detail is
    that lower bound, not a token count), while another request keeps decoding."""
    engine.submit(40, 5, "The quick brown fox", max_tokens=30)
    evs = engine.until(lambda ev: isinstance(ev, Data) and ev.id == 40)
    huge = b"colibri " * (10 << 17)  # 10 MiB: about 2.6M tokens
    engine.send(request(41, 6, huge))
    evs += engine.collect(40, 41)
    least = -(-len(huge) // (mux.FOLD * ref.tokenizer.max_token_bytes))
    assert Error(41, "CONTEXT_EXCEEDED", (str(least), str(CTX))) in evs
    assert text(evs, 40) == ref.text("The quick brown fox", 30)


def test_every_error_code(engine, ref):
    long_prompt = "x " * (CTX + 72)
    n_long = len(ref.tokenizer.encode(long_prompt))
    engine.send(
        b"HELLO\n"
        + request(30, 99, "hi")
        + request(31, 0, "hi", temperature=2.5)
        + b"SUBMIT 32 0 0 4 0.0 1.0\n\n"
        + b"CANCEL 33\n"
        + b"STOP 34\n"
        + request(35, 1, long_prompt)
        + request(36, 2, "The quick", max_tokens=400)
        + request(37, 2, "Other")
        + request(36, 4, "Other")
    )
    want = {
        (0, "BAD_REQUEST"),
        (30, "BAD_REQUEST"),
        (31, "BAD_REQUEST"),
        (32, "EMPTY_PROMPT"),
        (33, "NOT_FOUND"),
        (34, "NOT_FOUND"),
        (35, "CONTEXT_EXCEEDED"),
        (37, "SLOT_BUSY"),
        (36, "DUPLICATE_ID"),
    }
    seen: list = []
    evs = engine.until(lambda ev: _errors(seen, ev) >= want)
    assert Error(35, "CONTEXT_EXCEEDED", (str(n_long), str(CTX))) in evs
    engine.send(b"CANCEL 36\n")
    evs += engine.until(lambda ev: ev == Error(36, "CANCELLED"))
    assert not any(isinstance(ev, Done) and ev.id == 36 for ev in evs)

    engine.submit(38, 2, "The quick", max_tokens=400)  # the slot is free again
    engine.until(lambda ev: isinstance(ev, Data) and ev.id == 38)
    engine.send(b"STOP 38\n")
    done = engine.collect(38)[-1]
    assert isinstance(done, Done) and done.emitted < 400 and not done.length_limited


def _errors(seen: list, ev) -> set:
    if isinstance(ev, Error):
        seen.append((ev.id, ev.code))
    return set(seen)


# ---------------------------------------------------------------------------- own processes


def test_kv_persistence_restart_sigterm_and_determinism(model_dir, engine, ref, tmp_path):
    env = dict(SHARED, KVSAVE="1", STATE_DIR=str(tmp_path))
    p1 = "Der schnelle braune Fuchs"
    p2 = p1 + " springt über den faulen Hund."
    a = Mux(model_dir, **env)
    try:
        a.submit(1, 0, p1, 10)
        a.submit(2, 1, "The quick brown fox", 400)
        a.until(lambda ev: isinstance(ev, Data) and ev.id == 2)
        a.send(b"CANCEL 2\n")
        a.until(lambda ev: ev == Error(2, "CANCELLED"))
        saved = KVStore(tmp_path / "kv", fingerprint(model_dir)).load(1)  # persisted before the ack
        assert saved is not None and len(saved.tokens) > len(ref.tokenizer.encode("The quick"))
        a.submit(3, 2, "emoji 🐦", 20)
        assert a.close() == 0  # EOF right after a SUBMIT: it still finishes
        a.rest()
        rest = a.seen
        assert any(isinstance(ev, Done) and ev.id == 3 for ev in rest)
        assert any(isinstance(ev, Done) and ev.id == 1 for ev in rest)
    finally:
        a.kill()

    b = Mux(model_dir, **env)
    try:
        b.submit(4, 0, p2, 10)
        after_restart = b.collect(4)
        b.submit(5, 5, PROMPTS[0], 12)
        other_process = b.collect(5)
        b.submit(6, 6, "The quick", 400)
        b.until(lambda ev: isinstance(ev, Data) and ev.id == 6)
        t0 = time.monotonic()
        b.proc.send_signal(signal.SIGTERM)
        tail = b.rest()
        assert b.proc.wait(timeout=30) == 0 and time.monotonic() - t0 < 10
        done = [ev for ev in tail if isinstance(ev, Done)]
        assert [d.id for d in done] == [6] and done[0].emitted < 400
    finally:
        b.kill()
    assert "cached positions restored" in b.stderr()

    # the same two turns without a restart, in the shared engine
    engine.submit(40, 6, p1, 10)
    engine.collect(40)
    engine.submit(41, 6, p2, 10)
    no_restart = engine.collect(41)
    assert _accept(after_restart).reused_tokens == _accept(no_restart).reused_tokens > 0
    assert text(after_restart, 4) == text(no_restart, 41)
    assert text(other_process, 5) == ref.text(PROMPTS[0], 12)  # greedy across processes


def test_bursts_cut_by_input_keep_every_token_and_tick(model_dir, ref):
    """BURST_MS=0: every burst is cuttable. Alone, a request's bursts run
    whole and HITS comes every 6 tokens; requests sent while another decodes cut the burst
    running, and every request, a CANCELled one too, gives the tokens it gives alone. (Requests
    of hundreds of tokens: bursts decode a short one faster than a loaded client answers.)"""
    e = Mux(model_dir, BURST_MS="0", KV_SLOTS="3", CTX=str(CTX))
    try:
        e.submit(1, 0, "The quick brown fox", 40)
        alone = e.collect(1)
        e.submit(2, 0, "Permission is hereby", 480)
        evs = e.until(lambda ev: isinstance(ev, Data) and ev.id == 2)
        e.submit(3, 1, "Der schnelle", 12)
        e.submit(4, 2, "naïve café", 480)
        evs += e.until(lambda ev: isinstance(ev, Data) and ev.id == 4)
        e.send(b"CANCEL 4\n")
        evs += e.collect(*(i for i in (2, 3, 4) if not ended(evs, i)))
        assert e.close() == 0
    finally:
        e.kill()
    assert text(alone, 1) == ref.text("The quick brown fox", 40)
    lines = [ev for ev in alone if isinstance(ev, Data | Hits)][:-1]  # (the turn's own HITS)
    at = [i for i, ev in enumerate(lines) if isinstance(ev, Hits)]
    assert len(at) == 40 // 6 and set(np.diff(at)) == {7}  # 6 DATA lines, then HITS
    kinds = [(type(ev), getattr(ev, "id", None)) for ev in evs]
    assert kinds.index((Accept, 4)) < kinds.index((Done, 2))  # (sent while 2 decoded)
    assert text(evs, 2) == ref.text("Permission is hereby", 480)
    assert text(evs, 3) == ref.text("Der schnelle", 12)
    assert Error(4, "CANCELLED") in evs
    cut = sum(isinstance(ev, Data) and ev.id == 4 for ev in evs)
    assert 0 < cut < 480 and text(evs, 4) == ref.text("naïve café", cut)


def test_bad_frame_is_fatal_and_in_flight_work_finishes(model_dir):
    e = Mux(model_dir, **SMALL)
    try:
        e.send(
            request(1, 0, "The quick", 20)
            + b"SUBMIT 2 1 3 4 0.0 1.0\nabcX"  # the byte after the payload is not a newline
            + request(3, 1, "never read")
        )
        evs = e.rest()
        assert e.proc.wait(timeout=30) == 0  # exits although stdin is still open
    finally:
        e.kill()
    assert Error(2, "BAD_FRAME") in evs
    assert isinstance(of(evs, 1)[-1], Done)
    assert of(evs, 3) == []


def _mutate(data: bytes, at: int, op: int, byte: int) -> bytes:
    at %= len(data) + 1
    if op == 0:
        return data[:at] + bytes([byte]) + data[at + 1 :]
    if op == 1:
        return data[:at] + data[at + 1 :]
    return data[:at] + bytes([byte]) + data[at:]


_valid = st.builds(
    request,
    rid=st.integers(1, 5),
    slot=st.integers(0, 2),
    prompt=st.text(min_size=0, max_size=12),
    max_tokens=st.integers(0, 6),
    temperature=st.sampled_from([0.0, 0.7, 2.5]),
)
_frame = st.one_of(
    _valid,
    st.builds(
        lambda k, i: b"%s %d\n" % (k, i), st.sampled_from([b"CANCEL", b"STOP"]), st.integers(0, 9)
    ),
    st.binary(max_size=40),
    st.builds(_mutate, _valid, st.integers(0, 80), st.integers(0, 2), st.integers(0, 255)),
)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=st.lists(_frame, max_size=6))
def test_fuzzed_input_never_crashes_or_hangs(model_dir, frames):
    e = Mux(model_dir, **SMALL)
    try:
        try:
            e.send(b"".join(frames))
        except BrokenPipeError:  # a fatal frame may end the engine before all is written
            pass
        status = e.close(timeout=60)
        evs = e.rest(timeout=10)  # every line parses (a malformed one raises)
    finally:
        e.kill()
    assert status == 0, e.stderr()
    assert not any(isinstance(ev, Unknown) for ev in evs)
    assert "Traceback" not in e.stderr()


def test_every_engine_event_has_its_wire_lines():
    hits = np.zeros((2, 8), bool)
    hits[0, 0] = hits[1, 7] = True
    assert mux.lines(Accepted(3, 10, 4)) == [Accept(3, 10, 4)]
    assert mux.lines(Token(3, 65, b"A")) == [Data(3, b"A")]
    assert mux.lines(Token(3, 65, b"A", ((-0.1, b"A"),))) == [
        Data(3, b"A"),
        TopK(3, ((-0.1, b"A"),)),
    ]
    assert mux.lines(Failed(3, "CONTEXT_EXCEEDED", ("9", "8"))) == [
        Error(3, "CONTEXT_EXCEEDED", ("9", "8"))
    ]
    assert mux.lines(HitsTick(hits)) == [Hits.from_set(2, 8, [(0, 0), (1, 7)])]
    assert mux.lines(RepinEvent(1, 5, 0, 0)) == [Repin(1, 5, 0, 0)]


# ---------------------------------------------------------------------------- settings


def test_the_inbox_flag_is_up_while_a_frame_waits_untaken():
    """What cuts decode bursts: Inbox raises `wake` after queuing a frame and lowers it when
    `take` looks at the queue; the end of input leaves it down (a flag left up would cut
    every burst of the work still to finish)."""
    frames: queue.Queue[str | None] = queue.Queue()
    flag = threading.Event()
    inbox = Inbox(frames.get, wake=lambda up: flag.set() if up else flag.clear())
    assert inbox.take(0.0) == [] and not flag.is_set()
    frames.put("a")
    assert flag.wait(10)
    assert inbox.take(1.0) == ["a"] and not flag.is_set()
    frames.put(None)  # end of input: the engine finishes its work, no burst is cut for it
    assert inbox.take(10.0) == [None]
    time.sleep(0.1)
    assert not flag.is_set()


def test_settings_name_the_variable_and_value():
    s = EngineSettings.from_env({"SERVE_BATCH": "1", "KV_SLOTS": "16", "CTX": "64", "NGEN": "8"})
    assert (s.serve_batch, s.kv_slots, s.ctx, s.ngen, s.kvsave) == (True, 16, 64, 8, False)
    assert EngineSettings.from_env({}) == EngineSettings()
    bad = [
        ("KV_SLOTS", "17"),
        ("KV_SLOTS", "0"),
        ("CTX", "big"),
        ("SERVE_BATCH", "yes"),
        ("SEED", "-3"),
        ("BURST_MS", "-1"),
        ("STREAM_MS", "soon"),
    ]
    for name, value in bad:
        with pytest.raises(SettingsError, match=f"{name}='{value}'"):
            EngineSettings.from_env({name: value})
    for name, value in [("DEVICE_GB", "-1"), ("RAM_GB", "nan"), ("CAP", "1.5"), ("POLICY", "x")]:
        with pytest.raises(ValueError, match=f"{name}='{value}'"):
            TierConfig.from_env({name: value})


def test_engine_refuses_bad_settings_before_loading(model_dir, tmp_path):
    p = spawn(model_dir, KV_SLOTS="17", STATE_DIR=str(tmp_path))
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2 and out == b""
    assert b"KV_SLOTS='17'" in err


def test_cli_lists_engine_and_chat():
    r = subprocess.run(
        [sys.executable, "-m", "colibri.cli", "--help"], capture_output=True, timeout=60
    )
    assert b"engine" in r.stdout and b"chat" in r.stdout


def test_prompts_are_prepared_on_the_reader_thread(ref):
    """`mux.Preparer` (run by the stdin reader) tokenizes a SUBMIT into the scheduler's
    request, refuses a payload too long by its byte count alone, and passes other frames on."""
    from colibri.protocol.codec import Cancel, Submit

    prepare = mux.Preparer(ref.tokenizer, capacity=CTX)
    req = prepare(Submit(3, 1, 8, 0.5, 0.9, b"The quick", b"root ::= x"))
    assert isinstance(req, GenRequest) and req.grammar == "root ::= x"
    assert req.prompt == tuple(ref.tokenizer.encode("The quick")) and req.slot == 1
    too_long = prepare(Submit(4, 0, 8, 0.0, 1.0, b"x" * (10 << 20)))
    assert isinstance(too_long, Failed) and too_long.code == "CONTEXT_EXCEEDED"
    assert prepare(Cancel(5)) == Cancel(5) and prepare(None) is None
