"""`colibri chat`: a terminal client that talks to an engine subprocess over the legacy protocol."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path

from colibri.engine.settings import EngineSettings, child_env
from colibri.protocol.codec import READY_LINE, Stat
from colibri.protocol.legacy import END_LINE

HELP = "/reset clears the conversation, /more continues a cut answer, /quit (or EOF) ends"


class LegacyEngine:
    """`colibri engine` on the legacy protocol: send a frame, stream back its answer."""

    def __init__(self, model_dir: str | Path, env: Mapping[str, str] | None = None):
        base = os.environ if env is None else env
        env = child_env(replace(EngineSettings.from_env(base), serve_batch=False), base)
        cmd = [sys.executable, "-m", "colibri.cli", "engine", "--model", str(model_dir)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._buf = b""
        self.last: Stat | None = None
        self._until(READY_LINE + b"\n")
        self.last = self._stat()

    def send(self, frame: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(frame)
        self.proc.stdin.flush()

    def ask(self, frame: bytes) -> Iterator[bytes]:
        """Send a prompt frame; yield the answer's bytes as they come; `last` is its STAT."""
        self.send(frame)
        while (end := self._buf.find(END_LINE)) < 0:
            keep = _sentinel_prefix(self._buf)
            if len(self._buf) > keep:
                yield self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep :]
            self._read()
        if end:
            yield self._buf[:end]
        self._buf = self._buf[end + len(END_LINE) :]
        self.last = self._stat()

    def close(self) -> int:
        """End of input: the engine finishes and exits; its exit status."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        return self.proc.wait(timeout=60)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
        if not chunk:
            raise EOFError(f"the engine exited (status {self.proc.wait()})")
        self._buf += chunk

    def _until(self, marker: bytes) -> None:
        """Consume output up to and including marker."""
        while (at := self._buf.find(marker)) < 0:
            self._read()
        self._buf = self._buf[at + len(marker) :]

    def _stat(self) -> Stat:
        while b"\n" not in self._buf:
            self._read()
        line, _, self._buf = self._buf.partition(b"\n")
        kind, *fields = line.split(b" ")
        if kind != b"STAT":
            raise EOFError(f"expected a STAT line from the engine, got {line[:80]!r}")
        return Stat.from_fields(fields)


def _sentinel_prefix(buf: bytes) -> int:
    """Length of the longest tail of buf that could start the END sentinel (held back)."""
    for k in range(min(len(buf), len(END_LINE) - 1), 0, -1):
        if buf.endswith(END_LINE[:k]):
            return k
    return 0


def _frame(line: str) -> bytes | None:
    """The legacy frame for one line the user typed; None for commands handled here or blanks."""
    cmd = line.strip()
    if cmd == "/more":
        return b"\x02MORE\n"
    if cmd == "/reset":
        return b"\x02RESET\n"
    text = "".join(ch for ch in line if ch == "\t" or ch >= " ")  # no forged control frames
    return text.encode() + b"\n" if text.strip() else None


def chat(model_dir: str | Path, verbose: bool = False) -> int:
    """Read lines from stdin, print each answer as it streams; returns the engine's exit status."""
    try:
        engine = LegacyEngine(model_dir)
        tty = sys.stdin.isatty()
        if tty:
            print(HELP, file=sys.stderr)
        _converse(engine, show_stats=tty or verbose)
    except KeyboardInterrupt:  # the engine got the same Ctrl-C and exits by itself
        return 130
    except EOFError as e:  # the engine died: its own error is already on stderr
        print(f"colibri chat: {e}", file=sys.stderr)
        return 1
    return engine.close()


def _converse(engine: LegacyEngine, show_stats: bool) -> None:
    """One answer per line typed, until EOF or /quit."""
    out = sys.stdout.buffer
    while True:
        try:
            line = input("> " if sys.stdin.isatty() else "")
        except EOFError:
            return
        if line.strip() in ("/quit", "/exit"):
            return
        frame = _frame(line)
        if frame is None:
            continue
        if frame == b"\x02RESET\n":
            engine.send(frame)
            continue
        for chunk in engine.ask(frame):
            out.write(chunk)
            out.flush()
        out.write(b"\n")
        out.flush()
        if show_stats and engine.last is not None:
            s = engine.last
            print(f"[{s.emitted} tokens, {s.tok_s:.1f} tok/s]", file=sys.stderr)
