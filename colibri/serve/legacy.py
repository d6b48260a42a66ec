"""The legacy protocol loop: one conversation at a time, answers as raw text plus END and STAT.

The frames and their rules are `colibri.protocol.legacy`'s; this is the engine's side: a plain
line continues the conversation, MORE continues an answer NGEN cut short, PROMPT starts a new
one, RESET clears it; a refused frame is answered with an empty answer, so a client never
waits forever.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from colibri.engine import hwinfo
from colibri.engine.scheduler import Failed, Finished, GenRequest, Scheduler, Token
from colibri.protocol.codec import READY_LINE, ByteStream, Stat, format_event
from colibri.protocol.legacy import END_LINE, Frame, Line, More, Refused, Reset, read_frame
from colibri.serve.stdio import Inbox, LineWriter, Termination
from colibri.tokenizer import Tokenizer

log = logging.getLogger("colibri")

DEFAULT_NGEN = 256  # answer length of a plain line or MORE when NGEN is not set
IDLE_POLL_S = 0.1


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
