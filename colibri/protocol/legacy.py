"""The legacy protocol's wire format: its input frames and the END sentinel (no engine here).

One conversation at a time. Input frames, one per line: a plain line is the next user prompt
of the conversation; ``\\x02RESET`` clears the conversation (no reply); ``\\x02MORE``
continues an answer that NGEN cut short; ``\\x02PROMPT <bytes> <max_tokens> <temperature>
<top_p> [kv_slot]\\n<prompt>\\n`` starts a new conversation from a fully rendered prompt
(the pre-mux API). Every prompt, MORE included, is answered with the answer's bytes as they
are generated, then ``\\x01\\x01END\\x01\\x01`` on its own line and ``STAT <emitted>
<tok_s> <hit_pct> <rss_gb>``. Startup writes the READY sentinel and a STAT line. The loop that
serves it is `colibri.serve.legacy`.
"""

from __future__ import annotations

from dataclasses import dataclass

from colibri.protocol.codec import ByteStream

END_LINE = b"\x01\x01END\x01\x01\n"  # ends every answer, followed by a STAT line
MAX_LINE = 1 << 20  # a plain prompt line; longer lines are drained and refused
MAX_PAYLOAD = 64 << 20


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
