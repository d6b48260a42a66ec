"""Drive a `colibri engine` subprocess from Python: typed events per request, telemetry as tables.

`Engine` spawns the engine on the mux protocol, waits for its handshake and reads its stdout on
one thread. Each `submit` returns a `Request` (a queue of that request's events, its text with
UTF-8 reassembled, `wait()` for the finished `Turn`; with `gates`, every token's routing, which
`gates_df()` tabulates); engine-wide telemetry (EMAP, TIERS, HITS, GPUS, HWINFO, REPIN) updates
the session's latest state and reaches subscribers, which is how the live widgets in
`colibri.widgets` redraw. Unknown line kinds are ignored (the protocol's
forward-compatibility rule).

Which request each line belongs to is `colibri.protocol.session`'s rule, shared with the
gateway.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from colibri.engine.settings import EngineSettings, child_env
from colibri.experts.budget import TierConfig
from colibri.protocol import codec
from colibri.protocol.codec import (
    Accept,
    Cancel,
    Data,
    Done,
    Emap,
    Entropy,
    Error,
    Gates,
    Gpus,
    Hits,
    HwInfo,
    Perf,
    Prof,
    Repin,
    Stop,
    Submit,
    Tiers,
    TopK,
    Unknown,
    UTF8Assembler,
    format_request,
)
from colibri.protocol.session import Handshake
from colibri.protocol.session import Session as WireSession

log = logging.getLogger("colibri")

REPO = Path(__file__).resolve().parent.parent
DEMO_MODEL = REPO / "data" / "models" / "demo"
SYNTH_MODEL = REPO / ".cache" / "synth-workbench"
TIER_NAMES = {2: "device", 1: "ram", 0: "disk"}  # EMAP's 2-bit tier
ENGINE_EXITED = "ENGINE_EXITED"  # error code of requests still open when the engine went away
_STDERR_LINES = 200  # engine log lines kept for error messages


class EngineError(RuntimeError):
    """The engine could not start, or went away."""


class RequestError(RuntimeError):
    """A request ended with ERROR instead of DONE."""

    def __init__(self, turn: Turn):
        self.turn = turn
        err = turn.error
        detail = f" {' '.join(err.detail)}" if err and err.detail else ""
        super().__init__(f"request {turn.id} failed: {err.code if err else '?'}{detail}")


# ---------------------------------------------------------------------------- default model


def default_model() -> Path:
    """The model the notebooks run: `COLIBRI_MODEL` if set, else the trained demo model once it
    is complete (its config.json is written last), else a synthetic checkpoint of the same layout
    (qwen3_moe, 6 MoE layers, 32 experts, top-4), built once into `.cache/`."""
    if os.environ.get("COLIBRI_MODEL"):
        return Path(os.environ["COLIBRI_MODEL"])
    if (DEMO_MODEL / "config.json").exists() and (DEMO_MODEL / "tokenizer.json").exists():
        return DEMO_MODEL
    return synthetic_model(SYNTH_MODEL)


def synthetic_model(out: str | Path, **spec) -> Path:
    """A random checkpoint in `out` (built once; `spec` overrides SynthSpec fields).

    Built in a sibling folder and renamed into place, so concurrent callers never see half a
    checkpoint.
    """
    from colibri.synth import SynthSpec, synthesize

    out = Path(out)
    if (out / "config.json").exists():
        return out
    fields = dict(layers=6, experts=32, top_k=4, hidden=128, moe_ff=64, vocab=512, seed=0)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    synthesize(SynthSpec(**{**fields, **spec}), tmp, progress=False)
    try:
        tmp.rename(out)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def routed_expert_gb(model: str | Path) -> float:
    """GiB of all routed experts as the engine holds them (float32), to size tier budgets."""
    from colibri.config import load_config

    cfg = load_config(Path(model))
    per_expert = 3 * cfg.moe.moe_ff * cfg.hidden * 4  # gate, up, down; as ExpertStore counts
    return per_expert * cfg.moe.num_experts * len(cfg.moe_layer_ids) / 2**30


# ---------------------------------------------------------------------------- maps as arrays


def tier_grid(emap: Emap) -> np.ndarray:
    """uint8 [L, E]: 2 device, 1 RAM, 0 disk."""
    return np.frombuffer(emap.data, np.uint8).reshape(emap.rows, emap.cols) >> 6


def heat_grid(emap: Emap) -> np.ndarray:
    """uint8 [L, E]: bit length of each expert's cumulative selection count (0 = never)."""
    return np.frombuffer(emap.data, np.uint8).reshape(emap.rows, emap.cols) & 0x3F


def hits_grid(hits: Hits) -> np.ndarray:
    """bool [L, E]: experts routed in the HITS window (bits are row-major, LSB first)."""
    n = hits.rows * hits.cols
    bits = np.unpackbits(np.frombuffer(hits.bits, np.uint8), bitorder="little")[:n]
    return bits.astype(bool).reshape(hits.rows, hits.cols)


def hits_union(hits: list[Hits] | tuple[Hits, ...]) -> np.ndarray | None:
    """bool [L, E]: experts routed in any of the windows; None without any."""
    grids = [hits_grid(h) for h in hits]
    return np.logical_or.reduce(grids) if grids else None


# ---------------------------------------------------------------------------- results


_PHASES = ("t_edisk", "t_ewait", "t_emm", "t_attn", "t_kvb", "t_head")  # PERF after dt
PERF_PARTS = ("disk wait", "expert matmul", "attention", "kv expansion", "head", "other")


def perf_parts(perf: Perf) -> dict[str, float]:
    """The turn's dt split into PERF_PARTS, seconds, summing to dt.

    Disk wait is `t_ewait` (the compute thread waiting for expert bytes; `t_edisk` counts reader
    threads and overlaps compute, so it is not a slice of dt). Attention excludes `t_kvb`, which
    `t_attn` includes (docs/design.md). Other is what the timers do not cover (sampling, host
    work, other slots' prefill), never negative.
    """
    parts = {
        "disk wait": perf.t_ewait,
        "expert matmul": perf.t_emm,
        "attention": max(0.0, perf.t_attn - perf.t_kvb),
        "kv expansion": perf.t_kvb,
        "head": perf.t_head,
    }
    parts["other"] = max(0.0, perf.dt - sum(parts.values()))
    return parts


@dataclass(frozen=True)
class Clock:
    """When this client saw a request's milestones, `time.monotonic()` seconds (None: not
    seen): `submit` its SUBMIT written, `accept` its ACCEPT read, `first` and `last` its first
    and latest DATA read, `end` its DONE or ERROR read. The engine's own times are PERF's `dt`
    and DONE's `tok_s` (`TURN_COLUMNS` says which column comes from which)."""

    submit: float
    accept: float | None = None
    first: float | None = None
    last: float | None = None
    end: float | None = None

    @property
    def queue_s(self) -> float | None:
        """SUBMIT written to ACCEPT read: waiting for the engine (reading, tokenizing, a free
        slot or prefill budget, other work of its loop such as a WARMUP compile); not in dt."""
        return None if self.accept is None else self.accept - self.submit

    @property
    def wall_s(self) -> float | None:
        """SUBMIT written to DONE (or ERROR) read: what the caller waited."""
        return None if self.end is None else self.end - self.submit


@dataclass(frozen=True)
class Turn:
    """One finished request: its text and everything the engine reported about it."""

    id: int
    slot: int
    prompt: str
    tag: str | None  # the caller's label (for grouping turns in tables)
    text: str
    tokens: tuple[bytes, ...]  # each DATA payload
    accept: Accept | None
    done: Done | None
    error: Error | None
    perf: Perf | None
    entropy: tuple[float, ...]  # [L] bits
    topk: tuple[TopK, ...]  # one per token (SERVE_TOPK)
    hits: tuple[Hits, ...]  # every HITS seen while in flight (engine-wide windows)
    emap: Emap | None
    tiers: Tiers | None
    gpus: Gpus | None
    hwinfo: HwInfo | None
    repins: tuple[Repin, ...]  # REPIN swaps while in flight
    prof: Prof | None = None  # the turn's PROF line (colibrì's profiling numbers)
    clock: Clock | None = None  # when this client saw its milestones
    gates: tuple[Gates, ...] = ()  # GATES lines in arrival order (SERVE_GATES), by position

    @property
    def ok(self) -> bool:
        return self.done is not None

    @property
    def decode_s(self) -> float:
        """Engine seconds from the first token to the end (`decode_seconds`); NaN without DONE."""
        return decode_seconds(self.done) if self.done is not None else float("nan")

    @property
    def prefill_s(self) -> float:
        """Engine seconds from acceptance to the first token: dt - decode_s (`prefill_seconds`)."""
        if self.done is None or self.perf is None:
            return float("nan")
        return prefill_seconds(self.perf.dt, self.done)

    def routed(self) -> np.ndarray | None:
        """bool [L, E]: experts the HITS windows of this turn saw routed (any request)."""
        return hits_union(self.hits)

    def topk_df(self) -> pd.DataFrame:
        """One row per (token, candidate): step, rank, logprob, candidate text."""
        rows = [
            {
                "step": step,
                "rank": rank,
                "logprob": lp,
                "candidate": tok.decode("utf-8", errors="replace"),
            }
            for step, t in enumerate(self.topk)
            for rank, (lp, tok) in enumerate(t.entries)
        ]
        return pd.DataFrame(rows, columns=["step", "rank", "logprob", "candidate"])

    def gates_df(self) -> pd.DataFrame:
        """This turn's GATES (SERVE_GATES), laid out as `gates_frame` lays them (turn 0)."""
        return _gates_table([(0, self)])


class Request:
    """A submitted prompt: its events as they arrive, its text so far, and `wait()`.

    `events` is a queue with one consumer in mind (iterate the request, or `iter_text`); the
    text, tokens and the finished Turn are kept regardless.
    """

    def __init__(
        self, engine: Engine | None, rid: int, slot: int, prompt: str, tag: str | None = None
    ):
        self.engine, self.id, self.slot, self.prompt, self.tag = engine, rid, slot, prompt, tag
        self.events: queue.Queue[codec.Event] = queue.Queue()
        self._asm = UTF8Assembler()
        self._text: list[str] = []
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._turn: Turn | None = None
        self._got: dict[str, object] = {}
        self._tokens: list[bytes] = []
        self._topk: list[TopK] = []
        self._gates: list[Gates] = []
        self._hits: list[Hits] = []
        self._repins: list[Repin] = []
        self.t_submit = time.monotonic()  # milestones as `Clock` names them (Engine.submit
        self.t_accept: float | None = None  # sets t_submit again just before it writes)
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.t_end: float | None = None

    def __repr__(self) -> str:
        state = "done" if self.done else "in flight"
        return f"<Request {self.id} slot {self.slot} {state}: {len(self.text)} chars>"

    @property
    def text(self) -> str:
        with self._lock:
            return "".join(self._text)

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    @property
    def emitted(self) -> int:
        """Tokens (DATA frames) received so far."""
        with self._lock:
            return len(self._tokens)

    def clock(self) -> Clock:
        """The milestones seen so far."""
        return Clock(self.t_submit, self.t_accept, self.t_first, self.t_last, self.t_end)

    def running_s(self, now: float | None = None) -> float | None:
        """Client seconds since its ACCEPT (to its end once it ended); None before ACCEPT."""
        if self.t_accept is None:
            return None
        end = self.t_end if self.t_end is not None else time.monotonic() if now is None else now
        return end - self.t_accept

    def live_tok_s(self) -> float | None:
        """Decode rate so far on this client's clock: (tokens - 1) over first to latest DATA
        (DONE's `tok_s` is the engine's figure for the whole turn); None before two tokens."""
        with self._lock:
            n = len(self._tokens)
        if n < 2 or self.t_first is None or self.t_last is None or self.t_last <= self.t_first:
            return None
        return (n - 1) / (self.t_last - self.t_first)

    def wait(self, timeout: float | None = None) -> Turn:
        """The finished turn (DONE or ERROR); TimeoutError if it takes longer than timeout."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"request {self.id} not finished after {timeout} s")
        assert self._turn is not None
        return self._turn

    def __iter__(self) -> Iterator[codec.Event]:
        """The request's events as they arrive, ending with its DONE or ERROR."""
        while True:
            ev = self.events.get()
            yield ev
            if isinstance(ev, Done | Error):
                return

    def iter_text(self) -> Iterator[str]:
        """Text as it streams (UTF-8 characters split across tokens come out whole)."""
        asm = UTF8Assembler()
        for ev in self:
            if isinstance(ev, Data):
                if piece := asm.feed(ev.payload):
                    yield piece
        if tail := asm.flush():
            yield tail

    def cancel(self) -> None:
        """Abort; the request ends with ERROR CANCELLED."""
        if self.engine is not None:
            self.engine.send(Cancel(self.id))

    def stop(self) -> None:
        """End the turn early; it still ends with DONE and its telemetry."""
        if self.engine is not None:
            self.engine.send(Stop(self.id))

    # -- fed by the session (reader thread) ----------------------------------------------

    def _add(self, ev: codec.Event) -> None:
        now = time.monotonic()
        with self._lock:
            if isinstance(ev, Accept) and self.t_accept is None:
                self.t_accept = now
            if isinstance(ev, Data):
                if self.t_first is None:
                    self.t_first = now
                self.t_last = now
                self._tokens.append(ev.payload)
                self._text.append(self._asm.feed(ev.payload))
            elif isinstance(ev, TopK):
                self._topk.append(ev)
            elif isinstance(ev, Gates):
                self._gates.append(ev)
            elif isinstance(ev, Hits):
                self._hits.append(ev)
            elif isinstance(ev, Repin):
                self._repins.append(ev)
            else:
                self._got[type(ev).__name__] = ev
        self.events.put(ev)

    def _finish(self, ev: Done | Error) -> Turn:
        with self._lock:
            self.t_end = time.monotonic()
            self._text.append(self._asm.flush())
            g = self._got
            entropy = g.get("Entropy")
            self._turn = Turn(
                id=self.id,
                slot=self.slot,
                prompt=self.prompt,
                tag=self.tag,
                text="".join(self._text),
                tokens=tuple(self._tokens),
                accept=g.get("Accept"),
                done=ev if isinstance(ev, Done) else None,
                error=ev if isinstance(ev, Error) else None,
                perf=g.get("Perf"),
                entropy=entropy.values if isinstance(entropy, Entropy) else (),
                topk=tuple(self._topk),
                hits=tuple(self._hits),
                emap=g.get("Emap"),
                tiers=g.get("Tiers"),
                gpus=g.get("Gpus"),
                hwinfo=g.get("HwInfo"),
                repins=tuple(self._repins),
                prof=g.get("Prof"),
                clock=Clock(self.t_submit, self.t_accept, self.t_first, self.t_last, self.t_end),
                gates=tuple(self._gates),
            )
        self.events.put(ev)
        self._finished.set()
        return self._turn


# ---------------------------------------------------------------------------- session state


Subscriber = Callable[[codec.Event, "Request | None"], None]


class Session:
    """Everything the engine said, attributed to requests or kept as the latest telemetry.

    The attribution and the telemetry are the wire session's (`colibri.protocol.session`); this
    adds the request objects, the finished turns and the subscribers. `dispatch` takes parsed
    events (from the reader thread); no I/O.
    """

    def __init__(self) -> None:
        self.wire = WireSession()
        self.turns: list[Turn] = []  # in the order they finished
        self.stray: list[codec.Event] = []  # id-carrying lines of no open request
        self.ready = threading.Event()
        self.closed = threading.Event()
        self._requests: dict[int, Request] = {}
        self._subscribers: list[Subscriber] = []
        self._lock = threading.Lock()

    # -- the latest telemetry -------------------------------------------------------------

    @property
    def handshake(self) -> Handshake:
        return self.wire.handshake

    @property
    def emap(self) -> Emap | None:
        return self.wire.telemetry.emap

    @property
    def tiers(self) -> Tiers | None:
        return self.wire.telemetry.tiers

    @property
    def hits(self) -> Hits | None:
        return self.wire.telemetry.hits

    @property
    def gpus(self) -> Gpus | None:
        return self.wire.telemetry.gpus

    @property
    def hwinfo(self) -> HwInfo | None:
        return self.wire.telemetry.hwinfo

    @property
    def repins(self) -> list[Repin]:
        return list(self.wire.telemetry.repins)

    @property
    def unknown(self) -> int:
        """Lines of kinds this client does not know (ignored)."""
        return self.wire.unknown

    # -- requests and subscribers --------------------------------------------------------

    def register(self, req: Request) -> None:
        with self._lock:
            self.wire.open(req.id)
            self._requests[req.id] = req

    def in_flight(self) -> list[Request]:
        with self._lock:
            return list(self._requests.values())

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        """Call fn(event, request or None) for every event, on the reader thread; returns the
        function that unsubscribes."""
        with self._lock:
            self._subscribers.append(fn)

        def unsubscribe() -> None:
            with self._lock:
                if fn in self._subscribers:
                    self._subscribers.remove(fn)

        return unsubscribe

    # -- the dispatcher ------------------------------------------------------------------

    def dispatch(self, ev: codec.Event) -> Request | None:
        """Attribute one event; returns the request it went to (None for engine-wide lines)."""
        with self._lock:
            routed = self.wire.route(ev)
            reqs = [self._requests[rid] for rid in routed.to]
            if routed.ends:
                del self._requests[routed.to[0]]
        if self.wire.ready:
            self.ready.set()
        if isinstance(ev, Unknown):
            return None
        if routed.stray:
            self.stray.append(ev)
        for req in reqs:
            for earlier in routed.before:
                req._add(earlier)
            if routed.ends:
                self.turns.append(req._finish(ev))
            else:
                req._add(ev)
        owner = reqs[0] if reqs and not isinstance(ev, Hits | Repin) else None
        self._notify(ev, owner)
        return owner

    def _notify(self, ev: codec.Event, req: Request | None) -> None:
        with self._lock:
            subs = list(self._subscribers)
        for fn in subs:
            try:
                fn(ev, req)
            except Exception:
                log.exception("telemetry subscriber %r failed", fn)

    def end(self) -> None:
        """The engine's stdout ended: every open request ends with ERROR ENGINE_EXITED."""
        for req in self.in_flight():
            self.dispatch(Error(req.id, ENGINE_EXITED))
        self.closed.set()

    # -- tables --------------------------------------------------------------------------

    def turns_df(self) -> pd.DataFrame:
        return turns_frame(self.turns)

    def entropy_df(self) -> pd.DataFrame:
        return entropy_frame(self.turns)

    def gates_df(self) -> pd.DataFrame:
        frame = gates_frame(self.turns)
        if self.emap is not None:
            frame.attrs["n_experts"] = self.emap.cols
        return frame

    def emap_df(self) -> pd.DataFrame:
        return emap_frame(self.emap, self.hits) if self.emap else emap_frame(None)


# ---------------------------------------------------------------------------- tables

# The turn table's columns and what each one means: the one place where dt, tok_s and the
# prefill time are defined (`Engine.turns_df`, `turns_frame`; `turn_columns()` as a table).
TURN_COLUMNS: dict[str, str] = {
    "turn": "index of the turn among this session's finished (DONE) turns",
    "id": "request id",
    "slot": "KV slot",
    "tag": "the caller's label (submit's tag)",
    "prompt_tokens": "prompt length, tokens (DONE)",
    "reused_tokens": "prompt tokens taken from the slot's KV cache, not prefilled (ACCEPT)",
    "emitted": "tokens sent, DATA frames (DONE)",
    "dt": "engine: wall seconds from acceptance to the end, prefill + decode (PERF's dt; "
    "PERF's phases split it); time queued before acceptance is not in it (queue_s)",
    "prefill_s": "engine: acceptance to the first token, dt - decode_s: prefilling "
    "prompt_tokens - reused_tokens tokens and choosing the first one (plus any compile "
    "these shapes meet: warm up first)",
    "decode_s": "engine: the first token to the end, (emitted - 1) / tok_s (0 below 2 tokens)",
    "tok_s": "engine: decode rate, (emitted - 1) / decode_s (DONE's tok_s): no prefill, no "
    "first token; 0 below 2 tokens",
    "prefill_tok_s": "engine: prompt tokens prefilled per second, "
    "(prompt_tokens - reused_tokens) / prefill_s",
    "queue_s": "client: SUBMIT written to ACCEPT read (the pipe, tokenizing, waiting for a "
    "slot or the prefill budget, the engine loop's other work such as WARMUP compiles)",
    "wall_s": "client: SUBMIT written to DONE read, what the caller waited (about queue_s + dt)",
    "hit_pct": "share of expert lookups that were hits while it ran, engine-wide (DONE)",
    "rss_gb": "the engine's peak resident memory, GiB (DONE)",
    "length_limited": "max_tokens, NGEN or the context ended it (DONE)",
    "t_edisk": "PERF: reader-thread seconds reading experts (overlaps compute: not a part of dt)",
    "t_ewait": "PERF: the compute thread waiting for expert bytes",
    "t_emm": "PERF: routed-expert matmuls and their combination",
    "t_attn": "PERF: attention, t_kvb included",
    "t_kvb": "PERF: MLA kv_b expansion",
    "t_head": "PERF: final norm and lm_head",
}
_TURN_COLUMNS = list(TURN_COLUMNS)


def turn_columns() -> pd.DataFrame:
    """`TURN_COLUMNS` as a table: column, meaning."""
    return pd.DataFrame(list(TURN_COLUMNS.items()), columns=["column", "meaning"]).set_index(
        "column"
    )


def decode_seconds(done: Done) -> float:
    """Engine seconds from the first token to the end: (emitted - 1) / tok_s, the window DONE's
    tok_s is measured over (0 below 2 tokens; NaN if a rate of 0 was reported for more)."""
    if done.emitted < 2:
        return 0.0
    return (done.emitted - 1) / done.tok_s if done.tok_s > 0 else float("nan")


def prefill_seconds(dt: float, done: Done) -> float:
    """Engine seconds from acceptance to the first token: dt - decode_seconds, at least 0
    (DONE's tok_s has 2 decimals on the wire)."""
    return max(0.0, dt - decode_seconds(done))


def turns_frame(turns: list[Turn]) -> pd.DataFrame:
    """One row per finished (DONE) turn, the columns of `TURN_COLUMNS` (seconds)."""
    rows = []
    for i, t in enumerate(x for x in turns if x.ok):
        d, p, c = t.done, t.perf, t.clock
        assert d is not None
        reused = t.accept.reused_tokens if t.accept else 0
        dt = p.dt if p else float("nan")
        prefill = prefill_seconds(dt, d) if p else float("nan")
        fed = d.prompt_tokens - reused
        row = {
            "turn": i,
            "id": t.id,
            "slot": t.slot,
            "tag": t.tag,
            "prompt_tokens": d.prompt_tokens,
            "reused_tokens": reused,
            "emitted": d.emitted,
            "dt": dt,
            "prefill_s": prefill,
            "decode_s": decode_seconds(d),
            "tok_s": d.tok_s,
            "prefill_tok_s": fed / prefill if prefill > 0 else float("nan"),
            "queue_s": _or_nan(c.queue_s if c else None),
            "wall_s": _or_nan(c.wall_s if c else None),
            "hit_pct": d.hit_pct,
            "rss_gb": d.rss_gb,
            "length_limited": d.length_limited,
        }
        row.update({k: getattr(p, k) if p else float("nan") for k in _PHASES})
        rows.append(row)
    return pd.DataFrame(rows, columns=_TURN_COLUMNS)


def _or_nan(x: float | None) -> float:
    return float("nan") if x is None else float(x)


def entropy_frame(turns: list[Turn]) -> pd.DataFrame:
    """One row per (finished turn, MoE layer): routing entropy in bits."""
    rows = [
        {"turn": i, "id": t.id, "tag": t.tag, "layer": layer, "entropy_bits": h}
        for i, t in enumerate(x for x in turns if x.ok)
        for layer, h in enumerate(t.entropy)
    ]
    return pd.DataFrame(rows, columns=["turn", "id", "tag", "layer", "entropy_bits"])


# The gates table's columns (`gates_frame`): trace_corpus's layout, a request in place of a doc
GATES_COLUMNS = (
    "turn",
    "id",
    "tag",
    "position",
    "token",
    "token_text",
    "step",
    "layer",
    "rank",
    "expert",
    "weight",
    "entropy",
    "margin",
)
_GATES_DTYPES = dict(
    turn=np.int32, id=np.int64, tag=object, position=np.int32, token=np.int32,
    token_text=object, step=np.int32, layer=np.int16, rank=np.int8, expert=np.int32,
    weight=np.float32, entropy=np.float32, margin=np.float32,
)  # fmt: skip


def gates_frame(turns: list[Turn]) -> pd.DataFrame:
    """One row per (finished turn, GATES line, MoE layer, rank), in that order: the routing of
    every token the engine fed with SERVE_GATES on, laid out as `analysis.trace_corpus` lays
    out a corpus (`routing_stats` takes it with ``df.rename(columns={"id": "doc"})``).

    `position` is the fed token's position in its slot and `token` its id; `token_text` the
    text it adds where this client saw it as a DATA (generated tokens; None for the prompt's);
    `step` the index of the token that forward chose (its DATA), -1 for the prompt tokens
    before the last (SERVE_GATES=2). `layer` the MoE layer, `rank` 0 .. K-1 by descending
    gate weight, `expert`, `weight` (float32); the router's `entropy` (bits) and `margin`
    belong to (position, layer) and repeat over its K rows.
    """
    return _gates_table(list(enumerate(x for x in turns if x.ok)))


def _gates_table(turns: list[tuple[int, Turn]]) -> pd.DataFrame:
    """`gates_frame` of (turn number, turn) pairs."""
    parts: dict[str, list] = {c: [] for c in GATES_COLUMNS}
    for i, t in turns:
        _gates_rows(parts, i, t)
    cols = {
        c: np.concatenate(p).astype(_GATES_DTYPES[c]) if p else np.zeros(0, _GATES_DTYPES[c])
        for c, p in parts.items()
    }
    cols["token_text"] = pd.Categorical(cols["token_text"])
    frame = pd.DataFrame(cols, columns=list(GATES_COLUMNS))
    k = next((t.gates[0].k for _, t in turns if t.gates), None)
    if k is not None:
        frame.attrs["top_k"] = k
    return frame


def _gates_rows(parts: dict[str, list], turn: int, t: Turn) -> None:
    """Append turn `t`'s GATES rows to the columns in `parts`."""
    if not t.gates:
        return
    g0 = t.gates[0]
    L, K, G = len(g0.experts), g0.k, len(t.gates)
    per = L * K
    n = G * per
    n_prompt = t.accept.prompt_tokens if t.accept else t.done.prompt_tokens if t.done else None
    pos = np.asarray([g.pos for g in t.gates], np.int64)
    texts = _token_texts(t.tokens)
    if n_prompt is None:
        step, said = np.full(G, -1), [None] * G
    else:
        step = np.where(pos >= n_prompt - 1, pos - n_prompt + 1, -1)
        said = [texts[p - n_prompt] if 0 <= p - n_prompt < len(texts) else None for p in pos]
    tag = np.empty(n, object)
    tag[:] = [t.tag] * n
    parts["turn"].append(np.full(n, turn))
    parts["id"].append(np.full(n, t.id))
    parts["tag"].append(tag)
    parts["position"].append(np.repeat(pos, per))
    parts["token"].append(np.repeat([g.token for g in t.gates], per))
    parts["token_text"].append(np.repeat(np.asarray(said, object), per))
    parts["step"].append(np.repeat(step, per))
    parts["layer"].append(np.tile(np.repeat(np.arange(L), K), G))
    parts["rank"].append(np.tile(np.arange(K), G * L))
    parts["expert"].append(np.asarray([g.experts for g in t.gates]).reshape(-1))
    parts["weight"].append(np.asarray([g.weights for g in t.gates], np.float32).reshape(-1))
    for col in ("entropy", "margin"):
        per_layer = np.asarray([getattr(g, col) for g in t.gates], np.float32).reshape(-1)
        parts[col].append(np.repeat(per_layer, K))


def _token_texts(payloads: tuple[bytes, ...]) -> list[str]:
    """The text each DATA payload adds: a character split over several tokens belongs to the
    token that completes it (as `analysis.token_texts`)."""
    asm = UTF8Assembler()
    out = [asm.feed(p) for p in payloads]
    if out:
        out[-1] += asm.flush()
    return out


def emap_frame(emap: Emap | None, hits: Hits | np.ndarray | None = None) -> pd.DataFrame:
    """One row per (layer, expert): tier (2 device, 1 RAM, 0 disk), its name, heat, hit."""
    cols = ["layer", "expert", "tier", "tier_name", "heat", "hit"]
    if emap is None:
        return pd.DataFrame(columns=cols)
    tier, heat = tier_grid(emap), heat_grid(emap)
    hit = hits_grid(hits) if isinstance(hits, Hits) else hits
    if hit is None or hit.shape != tier.shape:
        hit = np.zeros(tier.shape, bool)
    layer, expert = np.indices(tier.shape)
    return pd.DataFrame(
        {
            "layer": layer.ravel(),
            "expert": expert.ravel(),
            "tier": tier.ravel(),
            "tier_name": [TIER_NAMES[int(t)] for t in tier.ravel()],
            "heat": heat.ravel(),
            "hit": hit.ravel(),
        },
        columns=cols,
    )


def perf_frame(turns: pd.DataFrame) -> pd.DataFrame:
    """PERF_PARTS columns per row of `turns_frame` (seconds; each row sums to its dt)."""
    parts = [
        perf_parts(Perf(0, *(float(r[k]) for k in ("dt", *_PHASES)))) for _, r in turns.iterrows()
    ]
    return pd.DataFrame(parts, index=turns.index, columns=list(PERF_PARTS))


# ---------------------------------------------------------------------------- the engine


def read_loop(stream: codec.ByteStream, session: Session) -> None:
    """Parse engine lines into the session until EOF; then end every open request."""
    try:
        while True:
            try:
                ev = codec.read_event(stream)
            except codec.ProtocolError as e:  # one bad line: report it and read on
                log.warning("engine: %s", e)
                continue
            if ev is None:
                break
            session.dispatch(ev)
    except (OSError, ValueError) as e:  # the pipe broke or was closed under us
        log.debug("engine stdout: %s", e)
    finally:
        session.end()


def engine_env(
    *,
    slots: int = 1,
    ctx: int | None = None,
    ngen: int | None = None,
    topk: bool = True,
    gates: int = 0,
    seed: int = 0,
    device_gb: float | None = None,
    ram_gb: float | None = None,
    pin_gb: float | None = None,
    cap: int | None = None,
    policy: str | None = None,
    repin: int | None = None,
    pilot: bool = False,
    profile: bool = False,
    state_dir: str | Path | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The engine's environment: `base` (default os.environ) without engine settings, plus
    these (the mux protocol, every line kind; `gates` is SERVE_GATES); budgets left None are
    auto-sized."""
    tiers = TierConfig.of_gb(
        device_gb, ram_gb, pin_gb, cap=cap, policy=policy, repin=repin, pilot=pilot
    )
    settings = EngineSettings(
        serve_batch=True,
        wire="full",
        kv_slots=slots,
        ctx=ctx,
        ngen=ngen or 0,
        serve_topk=topk,
        serve_gates=gates,
        seed=seed,
        profile=profile,
        state_dir=None if state_dir is None else str(state_dir),
        tiers=tiers,
    )
    return child_env(settings, base)


class Engine:
    """A `colibri engine` subprocess on the mux protocol, with its session state.

    ``Engine(model, slots=2, device_gb=0.01)`` starts it and waits for the handshake. Budgets
    left None are auto-sized by the engine; `profile=True` sets PROFILE=1, asking for the
    layer-by-layer path (phase timers in PERF) even when every expert fits. `gates=1` sets
    SERVE_GATES=1: the routing of the forward behind every token (`gates_df`; 2: of every
    prompt token too), decoding one step a forward meanwhile. `state_dir` holds
    `.coli_usage` (pins are learned from it): by default a fresh temporary folder, removed at
    close, so runs neither depend on each other nor write into the model folder. `env` entries
    override everything. Close with `close()`, a `with` block, or let interpreter exit do it.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        slots: int = 1,
        ctx: int | None = None,
        ngen: int | None = None,
        topk: bool = True,
        gates: int = 0,
        seed: int = 0,
        device_gb: float | None = None,
        ram_gb: float | None = None,
        pin_gb: float | None = None,
        cap: int | None = None,
        policy: str | None = None,
        repin: int | None = None,
        pilot: bool = False,
        profile: bool = False,
        state_dir: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        start_timeout: float = 300.0,
    ):
        self.model = Path(model) if model is not None else default_model()
        self.slots = slots
        scratch = None if state_dir else tempfile.mkdtemp(prefix="colibri-state-")
        full = engine_env(
            slots=slots,
            ctx=ctx,
            ngen=ngen,
            topk=topk,
            gates=gates,
            seed=seed,
            device_gb=device_gb,
            ram_gb=ram_gb,
            pin_gb=pin_gb,
            cap=cap,
            policy=policy,
            repin=repin,
            pilot=pilot,
            profile=profile,
            state_dir=state_dir or scratch,
        )
        full.update(env or {})
        self.env = full
        self.session = Session()
        self._scratch = scratch
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=_STDERR_LINES)
        self._ids = itertools.count(1)
        self._write_lock = threading.Lock()
        cmd = [sys.executable, "-m", "colibri.cli", "engine", "--model", str(self.model)]
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=full,
            start_new_session=True,  # a Ctrl-C meant for the notebook does not kill the engine
        )
        self._threads = [
            _thread(read_loop, self._proc.stdout, self.session, name="colibri-engine-stdout"),
            _thread(_drain, self._proc.stderr, self.stderr_tail, name="colibri-engine-stderr"),
        ]
        self._finalizer = weakref.finalize(
            self, _shutdown, self._proc, self._write_lock, self._threads, scratch, 30.0
        )
        self._wait_ready(start_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.session.ready.wait(0.05):
            if self._proc.poll() is not None or self.session.closed.is_set():
                self._threads[1].join(2.0)
                self.close()
                raise EngineError(f"engine exited before its handshake:\n{self.stderr()}")
            if time.monotonic() > deadline:
                self.close()
                raise EngineError(f"no handshake within {timeout:.0f} s:\n{self.stderr()}")

    def __repr__(self) -> str:
        state = "running" if self.alive else "closed"
        return f"<Engine {self.model} slots={self.slots} {state}>"

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None and not self.session.closed.is_set()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    def stderr(self) -> str:
        """The engine's recent log lines."""
        return "".join(self.stderr_tail)

    # -- requests ------------------------------------------------------------------------

    def submit(
        self,
        prompt: str,
        *,
        slot: int = 0,
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        tag: str | None = None,
    ) -> Request:
        """Send one prompt (thread-safe; ids are unique); returns at once with its handle."""
        rid = next(self._ids)  # itertools.count is atomic under the GIL
        req = Request(self, rid, slot, prompt, tag)
        self.session.register(req)
        payload = prompt.encode("utf-8")
        req.t_submit = time.monotonic()
        try:
            self.send(Submit(rid, slot, max_tokens, temperature, top_p, payload))
        except EngineError:
            self.session.dispatch(Error(rid, ENGINE_EXITED))
            raise
        return req

    def generate(self, prompt: str, *, timeout: float | None = None, **kw) -> Turn:
        """Submit and wait; RequestError if the engine answers ERROR."""
        turn = self.submit(prompt, **kw).wait(timeout)
        if not turn.ok:
            raise RequestError(turn)
        return turn

    def send(self, req: codec.Request) -> None:
        """Write one request frame (the engine parses frames in the order they arrive)."""
        data = format_request(req)
        with self._write_lock:
            try:
                self._proc.stdin.write(data)
                self._proc.stdin.flush()
            except (BrokenPipeError, ValueError, OSError) as e:
                raise EngineError(f"the engine is not running:\n{self.stderr()}") from e

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        """fn(event, request or None) for every event (reader thread); returns unsubscribe."""
        return self.session.subscribe(fn)

    # -- state and tables ----------------------------------------------------------------

    @property
    def turns(self) -> list[Turn]:
        return self.session.turns

    def turns_df(self) -> pd.DataFrame:
        """One row per finished turn: id, slot, tag, tokens, times (dt, prefill_s, decode_s,
        tok_s, queue_s, wall_s), hit_pct, PERF phases; `TURN_COLUMNS` defines each column
        (`turn_columns()` shows them as a table)."""
        return self.session.turns_df()

    def entropy_df(self) -> pd.DataFrame:
        """One row per (turn, MoE layer): routing entropy in bits."""
        return self.session.entropy_df()

    def gates_df(self) -> pd.DataFrame:
        """One row per (finished turn, fed token, MoE layer, rank): the experts and gate weights
        of every token, the router's entropy and margin (`gates_frame`; needs `gates`)."""
        return self.session.gates_df()

    def emap_df(self) -> pd.DataFrame:
        """One row per (layer, expert) of the latest EMAP: tier, heat, and the latest HITS bit."""
        return self.session.emap_df()

    def repin_df(self) -> pd.DataFrame:
        rows = [(r.layer, r.expert, r.old_tier, r.gpu) for r in self.session.repins]
        return pd.DataFrame(rows, columns=["layer", "expert", "old_tier", "gpu"])

    # -- shutdown ------------------------------------------------------------------------

    def close(self, timeout: float = 30.0) -> int | None:
        """EOF to the engine (in-flight requests finish), wait; SIGTERM, then kill, if it
        lingers past timeout. Returns the exit status. Also runs at interpreter exit."""
        if self._finalizer.detach() is not None:
            _shutdown(self._proc, self._write_lock, self._threads, self._scratch, timeout)
        return self._proc.returncode


def _thread(target, *args, name: str) -> threading.Thread:
    t = threading.Thread(target=target, args=args, name=name, daemon=True)
    t.start()
    return t


def _drain(stream, tail: collections.deque[str]) -> None:
    """Keep the engine's last log lines; also stops a full stderr pipe from blocking it."""
    for line in iter(stream.readline, b""):
        tail.append(line.decode("utf-8", errors="replace"))


def _shutdown(
    proc: subprocess.Popen,
    write_lock: threading.Lock,
    threads: list[threading.Thread],
    scratch: str | None,
    timeout: float,
) -> None:
    """Close stdin, wait for the exit; escalate to SIGTERM, then SIGKILL. Never raises."""
    with write_lock:
        try:
            proc.stdin.close()
        except OSError:
            pass
    for step in (proc.terminate, proc.kill):
        try:
            proc.wait(timeout)
            break
        except subprocess.TimeoutExpired:
            log.warning("engine %d did not exit in %.0f s; escalating", proc.pid, timeout)
            step()
            timeout = 10.0
    else:
        proc.wait()
    for t in threads:
        t.join(5.0)
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None and not any(t.is_alive() for t in threads):
            pipe.close()
    if scratch:
        shutil.rmtree(scratch, ignore_errors=True)
