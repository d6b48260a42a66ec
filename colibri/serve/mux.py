"""The mux protocol loop: requests from stdin, continuously batched turns, protocol lines out.

The wire profile (`WIRE`) says which line kinds go out: `full` writes every kind, `upstream` only
the ten that colibrì's own gateway parses (it fails on any other), so it can drive this engine
unchanged. Both read every request form.

One thread reads and parses frames (`Inbox`); the main thread alternates between handling every
frame that has arrived (submit, cancel, stop: they take effect between steps) and one scheduler
step (admission with serial prefill, then one decode forward over all active slots), and is the
only writer of stdout. End of input or a fatal frame stops the reading; in-flight requests
finish, then `serve` returns 0. SIGTERM stops every in-flight request through DONE at once.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from colibri import kernels
from colibri.engine import hwinfo
from colibri.engine.scheduler import (
    CONTEXT_EXCEEDED,
    INTERNAL,
    Accepted,
    Event,
    Failed,
    Finished,
    GenRequest,
    HitsTick,
    Scheduler,
    Token,
    TokenGates,
    TurnReport,
)
from colibri.experts.stats import ExpertStats, RepinEvent
from colibri.protocol import codec
from colibri.protocol.codec import (
    Accept,
    ByteStream,
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
    Ready,
    Repin,
    Stat,
    Submit,
    Tiers,
    TopK,
    format_event,
)
from colibri.serve.stdio import Inbox, LineWriter, Termination
from colibri.tokenizer import Tokenizer

log = logging.getLogger("colibri")

IDLE_POLL_S = 0.1  # how often an idle loop looks at the SIGTERM flag
FOLD = 4  # bytes of input a normalizer may fold into one byte of a token (a 4-byte UTF-8 char)
UPSTREAM_KINDS = (Ready, Stat, HwInfo, Tiers, Emap, Hits, Data, Prof, Error, Done)
WIRE_KINDS: dict[str, tuple[type, ...] | None] = {"full": None, "upstream": UPSTREAM_KINDS}


def serve(
    sched: Scheduler,
    tokenizer: Tokenizer,
    kv_slots: int,
    stdin: ByteStream,
    out: LineWriter,
    wire: str = "full",
    warmup: bool = False,
) -> int:
    """Run the mux protocol until input ends and every request is done; the exit status.
    `warmup`: after READY, compile the programs traffic can reach (`Scheduler.warmup`), one
    after each step, while input is read."""
    loop = _Loop(sched, tokenizer, out, WIRE_KINDS[wire])
    loop.send(*handshake(sched.runner.stats))
    warm = Warmup(sched) if warmup else None
    prepare = Preparer(tokenizer, sched.runner.capacity)

    def read() -> Item | None:  # on the reader thread: prompts are tokenized there
        return prepare(codec.read_request(stdin, kv_slots))

    inbox: Inbox[Item] = Inbox(read, last=_loses_framing, wake=kernels.request_cut)
    # (a frame that comes in cuts the decode burst running short: Scheduler.step)
    term = Termination()
    while loop.reading or sched.busy:
        if term.requested() and loop.reading:
            log.info("SIGTERM: stopping %d requests", len(sched.in_flight()))
            loop.reading = False
            loop.emit(sched.stop_all())
        if loop.reading:
            for item in inbox.take(0.0 if sched.busy or warm else IDLE_POLL_S):
                loop.handle(item)
        loop.emit(sched.step())
        if warm and loop.reading:
            warm.one()
    return 0


class Warmup:
    """`Scheduler.warmup` run one program at a time between steps; false once it is done (or
    failed: then traffic compiles what it reaches, as without it)."""

    def __init__(self, sched: Scheduler):
        self.programs, self.done, self.t0 = sched.warmup(), 0, time.perf_counter()

    def __bool__(self) -> bool:
        return self.programs is not None

    def one(self) -> None:
        assert self.programs is not None
        try:
            next(self.programs)
            self.done += 1
            return
        except StopIteration:
            took = time.perf_counter() - self.t0
            log.info("warm-up: %d programs compiled in %.1f s", self.done, took)
        except Exception:
            log.exception("warm-up failed after %d programs; traffic compiles the rest", self.done)
        self.programs = None


def handshake(stats: ExpertStats) -> list[codec.Event]:
    """READY, STAT, HWINFO, TIERS, EMAP: the startup lines, in the order the spec fixes."""
    return [
        Ready(),
        Stat(0, 0.0, 0.0, hwinfo.peak_rss_gb()),
        hwinfo_line(),
        Tiers(*stats.tier_counts()),
        Emap(stats.rows, stats.cols, stats.emap()),
    ]


def hwinfo_line() -> HwInfo:
    h = hwinfo.host()
    return HwInfo(
        h.cores, h.ram_total_gb, h.ram_avail_gb, h.ngpu, h.vram_total_gb, h.cpu_name, h.gpu_name
    )


def turn_block(rid: int, r: TurnReport) -> list[codec.Event]:
    """HWINFO PERF ENTROPY GPUS TIERS EMAP HITS PROF, then DONE: the end of one request."""
    ph = r.phases
    phases = [ph.get(k, 0.0) for k in ("t_edisk", "t_ewait", "t_emm", "t_attn", "t_kvb", "t_head")]
    rows, cols = r.hits.shape
    on = hwinfo.devices(r.tiers[0], r.emap, cols)
    gpus = tuple((d.used_gb, d.total_gb, d.experts) for d in on)
    return [
        hwinfo_line(),
        Perf(rid, r.dt, *phases),
        Entropy(r.entropy),
        Gpus(gpus),
        Tiers(*r.tiers),
        Emap(rows, cols, r.emap),
        hits_line(r.hits),
        Prof(
            r.dt,
            r.prompt_tokens,
            r.emitted,
            *(ph.get(k, 0.0) for k in ("t_edisk", "t_ewait", "t_emm", "t_attn", "t_head")),
            forwards=r.forwards,
        ),
        Done(
            rid,
            r.emitted,
            r.tok_s,
            r.hit_pct,
            hwinfo.peak_rss_gb(),
            r.prompt_tokens,
            r.length_limited,
        ),
    ]


def hits_line(hits: np.ndarray) -> Hits:
    """HITS from bool [rows, cols]: row-major, least significant bit first."""
    rows, cols = hits.shape
    return Hits(rows, cols, np.packbits(hits.reshape(-1), bitorder="little").tobytes())


def gates_line(g: TokenGates) -> Gates:
    """GATES of one fed token's routing."""
    experts = tuple(map(tuple, g.experts.tolist()))
    weights = tuple(map(tuple, g.weights.tolist()))
    entropy, margin = tuple(g.entropy.tolist()), tuple(g.margin.tolist())
    return Gates(g.id, g.pos, g.token, experts, weights, entropy, margin)


def lines(ev: Event) -> list[codec.Event]:
    """The wire lines of one engine event."""
    if isinstance(ev, Token):
        topk = [TopK(ev.id, ev.topk)] if ev.topk else []
        gates = [gates_line(ev.gates)] if ev.gates is not None else []
        return [Data(ev.id, ev.text), *topk, *gates]
    if isinstance(ev, TokenGates):
        return [gates_line(ev)]
    if isinstance(ev, Accepted):
        return [Accept(ev.id, ev.prompt_tokens, ev.reused_tokens)]
    if isinstance(ev, Finished):
        return turn_block(ev.id, ev.report)
    if isinstance(ev, Failed):
        return [Error(ev.id, ev.code, ev.detail)]
    if isinstance(ev, HitsTick):
        return [hits_line(ev.hits)]
    if isinstance(ev, RepinEvent):
        return [Repin(ev.layer, ev.expert, ev.old_tier, ev.gpu)]
    raise TypeError(f"unknown engine event {ev!r}")


class Preparer:
    """Turns a SUBMIT into the request the scheduler takes, or the refusal to answer, on the
    reader thread: tokenizing a long prompt there stalls no decode step. A payload whose byte
    count alone proves it longer than the context is refused without tokenizing it."""

    def __init__(self, tokenizer: Tokenizer, capacity: int):
        self.tokenizer, self.capacity = tokenizer, capacity

    def __call__(self, item: codec.Request | FrameError | None) -> Item | None:
        return self.prepare(item) if isinstance(item, Submit) else item

    def prepare(self, s: Submit) -> GenRequest | Failed:
        least = -(-len(s.payload) // (FOLD * max(1, self.tokenizer.max_token_bytes)))
        if least + 1 > self.capacity:
            return Failed(s.id, CONTEXT_EXCEEDED, (str(least), str(self.capacity)))
        try:
            prompt = tuple(self.tokenizer.encode(s.payload.decode("utf-8")))
        except Exception:
            log.exception("request %d: tokenizing the prompt failed", s.id)
            return Failed(s.id, INTERNAL)
        grammar = s.grammar.decode("utf-8")  # (validated by the reader)
        return GenRequest(s.id, s.slot, prompt, s.max_tokens, s.temperature, s.top_p, grammar)


Item = GenRequest | Failed | Cancel | codec.Stop | FrameError  # what the reader hands on


def _loses_framing(item: Item) -> bool:
    return isinstance(item, FrameError) and item.fatal


class _Loop:
    """The main thread's state: whether input is still read, and the one stdout writer (which
    writes only the line kinds of its wire profile; None: all)."""

    def __init__(
        self,
        sched: Scheduler,
        tokenizer: Tokenizer,
        out: LineWriter,
        kinds: tuple[type, ...] | None = None,
    ):
        self.sched, self.tokenizer, self.out, self.kinds = sched, tokenizer, out, kinds
        self.reading = True

    def send(self, *events: codec.Event) -> None:
        for ev in events:
            if self.kinds is None or isinstance(ev, self.kinds):
                self.out.send(format_event(ev))

    def emit(self, events: list[Event]) -> None:
        for ev in events:
            plain = type(ev) is Token and not ev.topk and ev.gates is None
            if plain:  # most lines, built without a Data object
                self.out.send(codec.format_data(ev.id, ev.text))
            else:
                self.send(*lines(ev))

    def handle(self, item: Item | None) -> None:
        """One frame from the reader; nothing here may end the loop but the end of input."""
        if item is None:
            self.reading = False
        elif isinstance(item, FrameError):
            log.warning("refused frame (%s): %s", item.code, item.reason)
            self.send(item.to_event())
            self.reading = self.reading and not item.fatal
        elif isinstance(item, GenRequest):
            self.emit(self.sched.submit(item))
        elif isinstance(item, Failed):  # refused while being prepared
            self.emit([item])
        elif isinstance(item, Cancel):
            self.emit(self.sched.cancel(item.id))
        else:
            self.emit(self.sched.stop(item.id))
