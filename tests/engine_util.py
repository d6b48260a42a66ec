"""Drive a real `colibri engine` subprocess in tests: spawn with env, send frames, read events."""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from colibri.engine.settings import EngineSettings
from colibri.protocol import codec
from colibri.protocol.codec import Data, Done, Error, Submit, format_request

TIMEOUT = 120.0  # generous: a cold compile cache on a busy 2-core box
ENGINE_VARS = EngineSettings.VARIABLES  # a test's shell must not slip any into its engines


def spawn(model_dir: Path, **env: str) -> subprocess.Popen:
    """`colibri engine --model model_dir` with os.environ (the shared compile cache) plus env."""
    full = {k: v for k, v in os.environ.items() if k not in ENGINE_VARS}
    full.update({k: str(v) for k, v in env.items()})
    scratch = None
    if "STATE_DIR" not in env:  # usage counts go to a scratch folder, not the checkpoint's
        scratch = full["STATE_DIR"] = tempfile.mkdtemp(prefix="colibri-state-")
    cmd = [sys.executable, "-m", "colibri.cli", "engine", "--model", str(model_dir)]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full
    )
    proc.scratch = scratch
    return proc


class _Pump:
    """Reads a stream on a thread into a queue, so reads in tests can time out."""

    def __init__(self, read, name: str):
        self.queue: queue.Queue = queue.Queue()
        self._read = read
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                item = self._read()
            except Exception as e:  # a protocol violation: the test sees it
                self.queue.put(e)
                return
            self.queue.put(item)
            if item is None:
                return

    def get(self, timeout: float):
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no output within {timeout:.0f} s") from None


class _Proc:
    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self._err = _Pump(lambda: proc.stderr.read1(1 << 16) or None, "stderr")
        self.stderr_chunks: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def stderr(self) -> str:
        while True:
            try:
                chunk = self._err.queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(chunk, bytes):
                self.stderr_chunks.append(chunk)
        return b"".join(self.stderr_chunks).decode(errors="replace")

    def close(self, timeout: float = TIMEOUT) -> int:
        """Close stdin (EOF) and wait for the exit status."""
        if not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def kill(self) -> None:
        """Kill the engine if it still runs; remove its scratch state folder."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc.scratch:
            shutil.rmtree(self.proc.scratch, ignore_errors=True)


class Mux(_Proc):
    """A mux-protocol engine: every stdout line parsed with codec.read_event."""

    def __init__(self, model_dir: Path, **env: str):
        super().__init__(spawn(model_dir, SERVE_BATCH="1", **env))
        self._out = _Pump(lambda: codec.read_event(self.proc.stdout), "stdout")
        self.seen: list[codec.Event] = []
        self.handshake = [self.next() for _ in range(5)]
        if None in self.handshake:
            self.proc.wait(timeout=10)
            raise RuntimeError(f"engine did not start:\n{self.stderr()}")

    def next(self, timeout: float = TIMEOUT) -> codec.Event | None:
        """The next event; None at EOF. A malformed line raises ProtocolError."""
        ev = self._out.get(timeout)
        if isinstance(ev, Exception):
            raise ev
        if ev is not None:
            self.seen.append(ev)
        return ev

    def submit(self, rid: int, slot: int, prompt: str | bytes, max_tokens: int = 8, **kw) -> None:
        self.send(request(rid, slot, prompt, max_tokens, **kw))

    def collect(self, *ids: int, timeout: float = TIMEOUT) -> list[codec.Event]:
        """Events until every id in ids has ended (DONE or ERROR), in arrival order."""
        open_ids, out = set(ids), []
        deadline = time.monotonic() + timeout
        while open_ids:
            try:
                ev = self.next(max(0.1, deadline - time.monotonic()))
            except TimeoutError as e:
                gone = sorted(i for i in open_ids if ended(self.seen[: -len(out) or None], i))
                raise TimeoutError(
                    f"{e}; waiting for {sorted(open_ids)}, of which {gone} ended "
                    f"before collect() was called:\n{self.stderr()}"
                ) from None
            if ev is None:
                raise EOFError(f"engine exited with {sorted(open_ids)} open:\n{self.stderr()}")
            out.append(ev)
            if isinstance(ev, Done | Error):
                open_ids.discard(ev.id)
        return out

    def until(self, done, timeout: float = TIMEOUT) -> list[codec.Event]:
        """Events up to and including the first for which done(event) is true."""
        out: list[codec.Event] = []
        deadline = time.monotonic() + timeout
        while not out or not done(out[-1]):
            ev = self.next(max(0.1, deadline - time.monotonic()))
            if ev is None:
                raise EOFError(f"engine exited early:\n{self.stderr()}")
            out.append(ev)
        return out

    def rest(self, timeout: float = TIMEOUT) -> list[codec.Event]:
        """Every event until the engine closes stdout."""
        out = []
        while (ev := self.next(timeout)) is not None:
            out.append(ev)
        return out


class Legacy(_Proc):
    """A legacy-protocol engine: raw stdout bytes."""

    def __init__(self, model_dir: Path, **env: str):
        super().__init__(spawn(model_dir, SERVE_BATCH="0", **env))
        self._out = _Pump(lambda: self.proc.stdout.read1(1 << 16) or None, "stdout")
        self.buf = b""

    def read_until(self, marker: bytes, timeout: float = TIMEOUT) -> bytes:
        """Output up to and including marker."""
        deadline = time.monotonic() + timeout
        while marker not in self.buf:
            chunk = self._out.get(max(0.1, deadline - time.monotonic()))
            if chunk is None:
                raise EOFError(f"engine exited before {marker!r}:\n{self.stderr()}")
            self.buf += chunk
        head, _, self.buf = self.buf.partition(marker)
        return head + marker


def request(
    rid: int, slot: int, prompt: str | bytes, max_tokens: int = 8, temperature=0.0, top_p=1.0
) -> bytes:
    payload = prompt.encode() if isinstance(prompt, str) else prompt
    return format_request(Submit(rid, slot, max_tokens, temperature, top_p, payload))


def of(events: list[codec.Event], rid: int) -> list[codec.Event]:
    """The events that carry id rid."""
    return [ev for ev in events if getattr(ev, "id", None) == rid]


def ended(events: list[codec.Event], rid: int) -> bool:
    """Whether request rid's DONE or ERROR is among events."""
    return any(isinstance(ev, Done | Error) and ev.id == rid for ev in events)


def text(events: list[codec.Event], rid: int) -> bytes:
    """The concatenated DATA payloads of request rid."""
    return b"".join(ev.payload for ev in events if isinstance(ev, Data) and ev.id == rid)


class Reference:
    """Greedy output computed in-process on one slot: what the engine must emit, token for token."""

    def __init__(self, model_dir: Path, capacity: int):
        from colibri.engine.model import load_model
        from colibri.engine.runner import Runner

        self.model = load_model(model_dir, progress=False)
        self.tokenizer = self.model.tokenizer
        self.capacity = capacity
        self.runner = Runner(self.model, slots=1, capacity=capacity)

    def ids(self, prompt: list[int], max_tokens: int) -> list[int]:
        from colibri.engine.generate import generate_ids

        n = min(max_tokens, self.capacity - len(prompt))
        stop = self.model.cfg.eos_token_ids
        return list(generate_ids(self.runner, prompt, n, stop_ids=stop))

    def text(self, prompt: str, max_tokens: int) -> bytes:
        ids = self.ids(self.tokenizer.encode(prompt), max_tokens)
        return b"".join(self.tokenizer.token_bytes(t) for t in ids)
