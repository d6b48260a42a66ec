"""A server's side of the mux protocol written the strict way colibrì's own gateway reads it.

colibrì's gateway (`c/openai_server.py` in the colibrì project) launches its engine as
`<engine> <cap>` with SNAP, SERVE, SERVE_BATCH, NGEN and KV_SLOTS in the environment, reads the
handshake up to the READY sentinel and one STAT line, and then reads every line on one thread
that knows ten line kinds, each with the field counts it checks; any other line kind or count
stops that thread for good, and every request after it fails. `StrictEngine` does the same
(our own code, only what the tests need), so a test fails on any line such a server cannot read.
"""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from engine_util import ENGINE_VARS, TIMEOUT

READY = b"\x01\x01READY\x01\x01\n"
MAX_DATA = 65536
# kind -> (fewest, most) whitespace-separated fields, the kind included; None: no most.
KINDS: dict[str, tuple[int, int | None]] = {
    "DATA": (3, 3),
    "DONE": (7, None),
    "ERROR": (2, None),
    "HWINFO": (7, None),
    "TIERS": (6, None),
    "EMAP": (4, 4),
    "HITS": (4, 4),
    "PROF": (10, None),
}
TEN = {"READY", "STAT", *KINDS}  # every line kind the strict server can read


def colibri_engine() -> str:
    """The `colibri-engine` console script installed beside this interpreter."""
    script = Path(sys.executable).parent / "colibri-engine"
    if not script.exists():
        raise RuntimeError(f"{script} is missing: install colibri (pip install -e .)")
    return str(script)


def upstream_env(model_dir: Path, kv_slots: int = 1, ngen: int = 64, **extra: str) -> dict:
    """os.environ without engine settings, plus the variables colibrì's gateway sets."""
    env = {k: v for k, v in os.environ.items() if k not in ENGINE_VARS}
    env.update(SNAP=str(model_dir), SERVE="1", SERVE_BATCH="1", NGEN=str(ngen))
    env.update(KV_SLOTS=str(kv_slots), **extra)
    return env


@dataclass
class Result:
    """One request as the strict server saw it."""

    text: bytes = b""
    done: list[str] | None = None  # DONE's fields
    error: list[str] | None = None  # ERROR's fields after the id
    prof: list[str] | None = None  # the PROF line's fields, when it came right before DONE
    lines: list[str] = field(default_factory=list)  # kinds of this request's lines

    @property
    def emitted(self) -> int:
        assert self.done is not None, self.error
        return int(self.done[3])


class StrictEngine:
    """An engine subprocess driven as colibrì's gateway drives one."""

    def __init__(self, cmd: list[str], env: dict[str, str]):
        self.scratch = None
        if "STATE_DIR" not in env:  # usage counts go to a scratch folder, not the checkpoint's
            self.scratch = env["STATE_DIR"] = tempfile.mkdtemp(prefix="colibri-state-")
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env
        )
        self.failed: Exception | None = None
        self.kinds: Counter[str] = Counter()
        self.latest: dict[str, list[str]] = {}  # the last line of each kind, split
        self._results: dict[str, Result] = {}
        self._ended: dict[str, queue.Queue[Result]] = {}
        self._lock = threading.Lock()
        self._handshake()
        threading.Thread(target=self._dispatch, daemon=True).start()

    # -- reading, as strictly as colibrì's gateway ---------------------------------------------

    def _handshake(self) -> None:
        got = b""
        while not got.endswith(READY):
            byte = self.proc.stdout.read(1)
            if not byte:
                raise RuntimeError(f"engine exited before READY:\n{self.stderr()}")
            got += byte
        stat = self.proc.stdout.readline().decode("utf-8", "replace").split()
        if len(stat) < 5 or stat[0] != "STAT":
            raise RuntimeError(f"invalid engine status: {stat}")
        self.kinds.update(["READY", "STAT"])

    def _dispatch(self) -> None:
        last = None
        try:
            while line := self.proc.stdout.readline():
                fields = line.decode("utf-8", "replace").split()
                if not fields:
                    continue
                kind = fields[0]
                lo, hi = KINDS.get(kind, (None, None))
                if lo is None or len(fields) < lo or (hi is not None and len(fields) > hi):
                    raise RuntimeError(f"invalid engine response: {line!r}")
                self.kinds[kind] += 1
                self.latest[kind] = fields
                self._take(kind, fields, last)
                last = fields
            raise RuntimeError("engine exited")
        except Exception as e:
            self.failed = e
            with self._lock:
                pending = list(self._ended.values())
            for q in pending:
                q.put(Result(error=[f"dispatcher stopped: {e}"]))

    def _take(self, kind: str, fields: list[str], last: list[str] | None) -> None:
        if kind == "DATA":
            n = int(fields[2])
            if not 0 <= n <= MAX_DATA:
                raise RuntimeError(f"invalid DATA size {n}")
            data = self._exact(n)
            if self._exact(1) != b"\n":
                raise RuntimeError("invalid DATA terminator")
            if r := self._results.get(fields[1]):
                r.text += data
                r.lines.append(kind)
        elif kind == "DONE":
            if fields[2] != "STAT":
                raise RuntimeError(f"invalid engine status: {fields}")
            self._end(fields[1], done=fields, prof=last if last and last[0] == "PROF" else None)
        elif kind == "ERROR":
            self._end(fields[1], error=fields[2:])

    def _exact(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.proc.stdout.read(n - len(data))
            if not chunk:
                raise RuntimeError("truncated engine DATA payload")
            data += chunk
        return data

    def _end(self, rid: str, **what) -> None:
        with self._lock:
            r, q = self._results.pop(rid, None), self._ended.get(rid)
        if r is None or q is None:
            return
        for k, v in what.items():
            setattr(r, k, v)
        q.put(r)

    # -- writing -------------------------------------------------------------------------------

    def submit(
        self,
        rid: int,
        prompt: str,
        max_tokens: int = 8,
        slot: int = 0,
        temperature: float = 0.0,
        top_p: float = 1.0,
        grammar: bytes = b"",
        count: int | None = None,
    ) -> None:
        """SUBMIT with the grammar after the payload and its length (or `count`) as 7th field."""
        with self._lock:
            self._results[str(rid)] = Result()
            self._ended[str(rid)] = queue.Queue()
        payload = prompt.encode()
        gcount = len(grammar) if count is None else count
        head = f"SUBMIT {rid} {slot} {len(payload)} {max_tokens} {temperature:.8g} {top_p:.8g}"
        head += f" {gcount}" if grammar or count is not None else ""
        self.send(head.encode() + b"\n" + payload + grammar + b"\n")

    def send(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def result(self, rid: int, timeout: float = TIMEOUT) -> Result:
        with self._lock:
            q = self._ended.get(str(rid))
        if q is None:
            raise KeyError(f"request {rid} was not submitted")
        r = q.get(timeout=timeout)
        with self._lock:
            self._ended.pop(str(rid), None)
        return r

    def generate(self, rid: int, prompt: str, max_tokens: int = 8, **kw) -> Result:
        self.submit(rid, prompt, max_tokens, **kw)
        return self.result(rid)

    def partial(self, rid: int) -> bytes:
        """The text received so far for an open request."""
        with self._lock:
            r = self._results.get(str(rid))
        return r.text if r else b""

    # -- the process -----------------------------------------------------------------------------

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def close(self, timeout: float = TIMEOUT) -> int:
        """EOF on stdin; the exit status."""
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None
