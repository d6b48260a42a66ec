"""The legacy protocol loop: one conversation at a time, answers as raw text plus END and STAT.

Input frames, one per line: a plain line is the next user prompt of the conversation;
``\\x02RESET`` clears the conversation (no reply); ``\\x02MORE`` continues an answer that NGEN cut
short; ``\\x02PROMPT <bytes> <max_tokens> <temperature> <top_p> [kv_slot]\\n<prompt>\\n`` starts
a new conversation from a fully rendered prompt (the pre-mux API). Every prompt, MORE included,
is answered with the answer's bytes as they are generated, then ``\\x01\\x01END\\x01\\x01`` on
its own line and ``STAT <emitted> <tok_s> <hit_pct> <rss_gb>``. A refused frame is logged on
stderr and answered with an empty answer, so a client never waits forever. Startup writes the
READY sentinel and a STAT line. The conversation is kept as token ids; a plain line appends
the tokens of ``line + "\\n"``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from colibri.engine import hwinfo
from colibri.engine.scheduler import Failed, Finished, GenRequest, Scheduler, Token
from colibri.protocol.codec import READY_LINE, ByteStream, Stat, format_event
from colibri.protocol.stdio import Inbox, LineWriter, Termination
from colibri.tokenizer import Tokenizer

log = logging.getLogger("colibri")

END_LINE = b"\x01\x01END\x01\x01\n"
DEFAULT_NGEN = 256  # answer length of a plain line or MORE when NGEN is not set
MAX_LINE = 1 << 20  # a plain prompt line; longer lines are drained and refused
MAX_PAYLOAD = 64 << 20
IDLE_POLL_S = 0.1


# ---------------------------------------------------------------------------- frames


@dataclass(frozen=True)
class Line:
    text: bytes  # a plain prompt line, without its newline


@dataclass(frozen=True)
class Reset:
    pass


@dataclass(frozen=True)
class More:
    pass


@dataclass(frozen=True)
class Prompt:
    payload: bytes
    max_tokens: int
    temperature: float
    top_p: float
    slot: int = 0


@dataclass(frozen=True)
class Refused:
    reason: str
    fatal: bool = False  # the stream lost its framing: stop reading


Frame = Line | Reset | More | Prompt | Refused


def read_frame(stream: ByteStream, kv_slots: int) -> Frame | None:
    """The next legacy frame, or None at end of input."""
    line = stream.readline(MAX_LINE + 1)
    if not line.endswith(b"\n"):
        if len(line) <= MAX_LINE:
            return None  # EOF, possibly after a partial line
        while (chunk := stream.readline(1 << 16)) and not chunk.endswith(b"\n"):
            pass
        return Refused(f"line longer than {MAX_LINE} bytes")
    line = line[:-1]
    if line == b"\x02RESET":
        return Reset()
    if line == b"\x02MORE":
        return More()
    if line.startswith(b"\x02PROMPT"):
        return _read_prompt(stream, line.split(b" ")[1:], kv_slots)
    if line.startswith(b"\x02"):
        return Refused(f"unknown control frame {line[:40]!r}")
    return Line(line)


def _read_prompt(stream: ByteStream, words: list[bytes], kv_slots: int) -> Frame:
    """A PROMPT frame; with a readable byte count its payload is consumed even if refused."""
    if not words or not words[0].isdigit():
        return Refused("\\x02PROMPT header without a byte count")
    n = int(words[0])
    if n > MAX_PAYLOAD:
        return Refused(f"payload of {n} bytes exceeds {MAX_PAYLOAD}", fatal=True)
    payload = stream.read(n) if n else b""
    while len(payload) < n and (more := stream.read(n - len(payload))):
        payload += more
    if len(payload) < n or stream.read(1) != b"\n":
        return Refused("\\x02PROMPT payload not followed by a newline", fatal=True)
    try:
        if len(words) not in (4, 5):
            raise ValueError("expected <bytes> <max_tokens> <temperature> <top_p> [kv_slot]")
        max_tokens, temperature, top_p = int(words[1]), float(words[2]), float(words[3])
        slot = int(words[4]) if len(words) == 5 else 0
    except ValueError as e:
        return Refused(f"bad \\x02PROMPT header: {e}")
    frame = Prompt(payload, max_tokens, temperature, top_p, slot)
    problem = _check(frame, kv_slots)
    return Refused(problem) if problem else frame


def _check(p: Prompt, kv_slots: int) -> str | None:
    if not 0 <= p.slot < kv_slots:
        return f"kv_slot {p.slot} outside 0..{kv_slots - 1}"
    if not (0.0 <= p.temperature <= 2.0 and 0.0 < p.top_p <= 1.0 and p.max_tokens >= 1):
        return "sampling values out of range"
    if b"\0" in p.payload:
        return "payload contains a NUL byte"
    try:
        p.payload.decode("utf-8")
    except UnicodeDecodeError:
        return "payload is not valid UTF-8"
    return None


# ---------------------------------------------------------------------------- the loop


@dataclass
class _Conversation:
    tokens: list[int] = field(default_factory=list)  # prompt and answers so far
    slot: int = 0
    truncated: bool = False  # the last answer ended at its length limit


class _Loop:
    def __init__(self, sched: Scheduler, tokenizer: Tokenizer, ngen: int, out: LineWriter):
        self.sched, self.tokenizer, self.out = sched, tokenizer, out
        self.answer_len = ngen or DEFAULT_NGEN
        self.conv = _Conversation()
        self.next_id = 1

    def handle(self, frame: Frame, term: Termination) -> None:
        if isinstance(frame, Reset):
            self.conv = _Conversation()
        elif isinstance(frame, Refused):
            log.warning("refused frame: %s", frame.reason)
            self._end(0, 0.0)
        elif isinstance(frame, More):
            if self.conv.truncated:
                self._turn(self.conv.tokens, self.conv.slot, self.answer_len, 0.0, 1.0, term)
            else:
                log.warning("\\x02MORE without a truncated answer to continue")
                self._end(0, 0.0)
        elif isinstance(frame, Line):
            tokens = self.conv.tokens + self._encode(frame.text + b"\n")
            self._turn(tokens, self.conv.slot, self.answer_len, 0.0, 1.0, term)
        else:
            self.conv = _Conversation(slot=frame.slot)
            max_tokens = min(frame.max_tokens, self.answer_len)
            tokens = self._encode(frame.payload)
            self._turn(tokens, frame.slot, max_tokens, frame.temperature, frame.top_p, term)

    def _encode(self, text: bytes) -> list[int]:
        return self.tokenizer.encode(text.decode("utf-8", errors="replace"))

    def _turn(self, prompt, slot, max_tokens, temperature, top_p, term: Termination) -> None:
        """Generate one answer, streaming its bytes; the conversation grows only on success."""
        req = GenRequest(self.next_id, slot, tuple(prompt), max_tokens, temperature, top_p)
        self.next_id += 1
        answer: list[int] = []
        events = self.sched.submit(req)
        while True:
            for ev in events:
                if isinstance(ev, Token):
                    answer.append(ev.token)
                    self.out.send(ev.text)
                elif isinstance(ev, Finished):
                    self.conv = _Conversation(list(prompt) + answer, slot, ev.report.length_limited)
                    return self._end(ev.report.emitted, ev.report.tok_s, ev.report.hit_pct)
                elif isinstance(ev, Failed):
                    log.warning("request refused: %s %s", ev.code, " ".join(ev.detail))
                    return self._end(len(answer), 0.0)
            events = self.sched.stop_all() if term.requested() else self.sched.step()

    def _end(self, emitted: int, tok_s: float, hit_pct: float = 0.0) -> None:
        self.out.send(END_LINE)
        stat = Stat(emitted, tok_s if math.isfinite(tok_s) else 0.0, hit_pct, hwinfo.peak_rss_gb())
        self.out.send(format_event(stat))


def serve(
    sched: Scheduler, tokenizer: Tokenizer, ngen: int, stdin: ByteStream, out: LineWriter
) -> int:
    """Run the legacy protocol until input ends (or SIGTERM); the exit status."""
    out.send(READY_LINE + b"\n")
    out.send(format_event(Stat(0, 0.0, 0.0, hwinfo.peak_rss_gb())))
    kv_slots = len(sched.slots)
    inbox: Inbox[Frame] = Inbox(
        lambda: read_frame(stdin, kv_slots), last=lambda f: isinstance(f, Refused) and f.fatal
    )
    loop, term = _Loop(sched, tokenizer, ngen, out), Termination()
    while not term.requested():
        for frame in inbox.take(IDLE_POLL_S):
            if frame is None:
                return 0
            loop.handle(frame, term)
            if isinstance(frame, Refused) and frame.fatal:
                return 0
    return 0
