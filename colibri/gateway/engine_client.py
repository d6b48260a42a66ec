"""Async bridge to the `colibri engine` subprocess: requests in, events routed back by id.

One reader thread parses the engine's stdout with the codec and hands every event to the event
loop, where the wire session (`colibri.protocol.session`, the rule the notebook client follows
too) says which open requests each line belongs to, and keeps the latest telemetry behind
`/experts`, `/profile` and `/health` (`colibri.gateway.telemetry` shapes it). One writer
thread sends SUBMIT, CANCEL and STOP in the order the loop queued them, so a CANCEL never
overtakes its SUBMIT.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import subprocess
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from colibri.engine.settings import EngineSettings, child_env
from colibri.protocol import codec
from colibri.protocol.codec import (
    Accept,
    Cancel,
    Data,
    Done,
    Entropy,
    Error,
    Gpus,
    Perf,
    Prof,
    Ready,
    Repin,
    Stop,
    Submit,
    TopK,
)
from colibri.protocol.session import Session, Telemetry

log = logging.getLogger("colibri.gateway")

REPIN_KEEP = 64  # recent REPIN events /experts shows
PROFILE_KEEP = 120  # recent turns' PROF lines /profile shows
UNLIMITED = 1 << 30  # max_tokens when the client sets none: the context is the limit


@dataclass(frozen=True)
class EngineGone:
    """The engine exited or broke the protocol: every open request ends with this."""

    reason: str


Start = Accept | Done | Error | EngineGone  # the first thing a submitted request learns
End = Done | Error | EngineGone  # how a request ends


class EngineRequest:
    """One request in flight: its DATA frames and end in order, plus the telemetry routed to it.

    `started` resolves at ACCEPT (or at an ERROR/DONE that comes first); `ended` at the end. The
    text frames and the end are also queued on `chunks`, in arrival order.
    """

    def __init__(self, client: EngineClient, rid: int, slot: int):
        loop = asyncio.get_running_loop()
        self.id, self.slot = rid, slot
        self.replica = 0  # which of the gateway's engines runs it (`colibri.gateway.replicas`)
        self.started: asyncio.Future[Start] = loop.create_future()
        self.ended: asyncio.Future[End] = loop.create_future()
        self.chunks: asyncio.Queue[Data | End] = asyncio.Queue()
        self.accept: Accept | None = None
        self.own_cache = True  # the slot's cache was this conversation's: its reuse may be told
        self.topk: list[TopK] = []
        self.perf: Perf | None = None
        self.prof: Prof | None = None
        self.entropy: Entropy | None = None
        self.gpus: Gpus | None = None
        self.repins: list[Repin] = []
        self._client = client

    def cancel(self) -> None:
        """Abort: the engine frees the slot and acknowledges with ERROR CANCELLED."""
        if not self.ended.done():
            self._client.send(Cancel(self.id))

    def stop(self) -> None:
        """End early through the normal DONE path (a stop string was seen)."""
        if not self.ended.done():
            self._client.send(Stop(self.id))

    def take(self, ev: codec.Event) -> None:
        """Record one event routed to this request."""
        if isinstance(ev, Accept):
            self.accept = ev
            _resolve(self.started, ev)
        elif isinstance(ev, Data):
            self.chunks.put_nowait(ev)
        elif isinstance(ev, TopK):
            self.topk.append(ev)
        elif isinstance(ev, Perf):
            self.perf = ev
        elif isinstance(ev, Prof):
            self.prof = ev
        elif isinstance(ev, Entropy):
            self.entropy = ev
        elif isinstance(ev, Gpus):
            self.gpus = ev
        elif isinstance(ev, Repin):
            self.repins.append(ev)
        elif isinstance(ev, Done | Error | EngineGone):
            self.end(ev)

    def end(self, ev: End) -> None:
        if self.ended.done():
            return
        _resolve(self.started, ev)
        self.chunks.put_nowait(ev)
        self.ended.set_result(ev)


def _resolve(fut: asyncio.Future, value: object) -> None:
    if not fut.done():
        fut.set_result(value)


def engine_command(model_dir: str | Path) -> list[str]:
    return [sys.executable, "-m", "colibri.cli", "engine", "--model", str(model_dir)]


class EngineClient:
    """The engine subprocess on the mux protocol, driven from one asyncio event loop; `name`
    is how the log calls it (a gateway with replicas numbers them)."""

    def __init__(self, cmd: list[str], env: Mapping[str, str], name: str = "the engine"):
        self.cmd, self.env, self.name = cmd, dict(env), name
        self.proc: subprocess.Popen | None = None
        self.session = Session()
        self.gone: str | None = None  # why the engine is unusable, once it is
        self.lost: str | None = None  # why the last engine was lost, kept while one restarts
        self.restarts = 0  # engines started after the first was lost
        self.cancelled = 0  # CANCEL acknowledgements received
        self._stopping = False  # we sent EOF: the engine's exit is expected
        self._turns: dict[int, EngineRequest] = {}
        self._ids = itertools.count(1)
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[None] | None = None
        self._lost = asyncio.Event()  # set when the engine is gone (and not being stopped)

    @classmethod
    def for_model(
        cls,
        model_dir: str | Path,
        settings: EngineSettings,
        env: Mapping[str, str] | None = None,
        name: str = "the engine",
    ) -> EngineClient:
        """The engine on model_dir with these settings, on the mux protocol with every line
        kind and TOPK lines (what the gateway reads); `env`: variables added to its
        environment besides (which devices it sees)."""
        mux = replace(settings, serve_batch=True, wire="full", serve_topk=True)
        return cls(engine_command(model_dir), child_env(mux) | dict(env or {}), name)

    # ------------------------------------------------------------------ lifecycle

    async def start(self, timeout: float) -> None:
        """Spawn the engine and wait for its handshake; RuntimeError if it never comes."""
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self.proc = subprocess.Popen(
            self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.env
        )
        proc, outbox = self.proc, self._outbox
        threading.Thread(target=self._read, args=(proc,), name="engine-stdout", daemon=True).start()
        threading.Thread(
            target=self._write, args=(proc, outbox), name="engine-stdin", daemon=True
        ).start()
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        except TimeoutError:
            self.kill()
            raise RuntimeError(f"{self.name} sent no READY within {timeout:.0f} s") from None

    async def supervise(self, timeout: float, backoff: tuple[float, float] = (1.0, 30.0)) -> None:
        """Restart the engine whenever it is lost, waiting `backoff[0]` seconds first and twice
        as long after each failed start, up to `backoff[1]`; runs until cancelled. Requests in
        flight when it was lost have already ended (`EngineGone`); `/health` says why meanwhile."""
        delay = backoff[0]
        while True:
            await self._lost.wait()
            if self._stopping:
                return
            await asyncio.sleep(delay)
            self.restarts += 1
            log.warning("restarting %s (restart %d)", self.name, self.restarts)
            self._reset()
            try:
                await self.start(timeout)
                delay = backoff[0]
            except RuntimeError as e:
                log.error("restarting %s failed: %s", self.name, e)
                delay = min(2 * delay, backoff[1])

    def _reset(self) -> None:
        """Forget the lost engine: a fresh session, queue and handshake."""
        self.session = Session()
        self._turns.clear()
        self._outbox = queue.SimpleQueue()
        self.lost, self.gone = self.gone, None
        self._lost.clear()

    @property
    def alive(self) -> bool:
        ready = self._ready is not None and self._ready.done() and not self._ready.exception()
        return ready and self.gone is None and self.proc is not None and self.proc.poll() is None

    @property
    def why_down(self) -> str:
        """Why the engine does not serve (while not `alive`): how it was lost, also before its
        reader has told the loop (the process has exited) and while the next one starts."""
        if self.gone is not None:
            return self.gone
        if self.proc is not None and (status := self.proc.poll()) is not None:
            return f"engine exited (exit status {status})"
        return f"restarting after: {self.lost}" if self.lost else "engine not ready"

    @property
    def in_flight(self) -> int:
        return len(self._turns)

    async def close(self, timeout: float = 30.0) -> int | None:
        """EOF on the engine's stdin (in-flight requests finish), then wait; kill after timeout."""
        self._stopping = True
        self._outbox.put(None)
        if self.proc is None:
            return None
        try:
            return await asyncio.to_thread(self.proc.wait, timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.wait()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    # ------------------------------------------------------------------ requests

    def submit(
        self,
        slot: int,
        prompt: str,
        max_tokens: int | None,
        temperature: float,
        top_p: float,
        grammar: str = "",
    ) -> EngineRequest:
        """Send one SUBMIT; the returned turn receives its events."""
        turn = EngineRequest(self, next(self._ids), slot)
        if not self.alive:
            turn.end(EngineGone(self.gone or "engine not running"))
            return turn
        self._turns[turn.id] = turn
        self.session.open(turn.id)
        n = min(max_tokens or UNLIMITED, UNLIMITED)  # the engine's context caps it anyway
        payload, g = prompt.encode("utf-8"), grammar.encode("utf-8")
        self.send(Submit(turn.id, slot, n, temperature, top_p, payload, g))
        return turn

    def send(self, req: codec.Request) -> None:
        self._outbox.put(codec.format_request(req))

    # ------------------------------------------------------------------ threads

    def _read(self, proc: subprocess.Popen) -> None:
        """Parse this engine's stdout until EOF; every event goes to the loop in order (and is
        dropped there if a newer engine has replaced this one)."""
        assert proc.stdout is not None and self._loop is not None
        try:
            while (ev := codec.read_event(proc.stdout)) is not None:
                self._loop.call_soon_threadsafe(self._route, ev, proc)
            reason = "engine closed its output"
            proc.wait(timeout=5)  # output closes as the process exits: learn its status
        except subprocess.TimeoutExpired:
            pass
        except codec.ProtocolError as e:
            reason = f"engine broke the protocol: {e}"
        except Exception as e:  # a vanished pipe: the engine is gone either way
            reason = f"reading the engine failed: {e}"
        try:
            self._loop.call_soon_threadsafe(self._lose, reason, proc)
        except RuntimeError:  # the loop is closed: the gateway is shutting down
            pass

    def _write(self, proc: subprocess.Popen, outbox: queue.SimpleQueue[bytes | None]) -> None:
        assert proc.stdin is not None
        stdin = proc.stdin
        try:
            while (data := outbox.get()) is not None:
                stdin.write(data)
                stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as e:
            log.warning("engine stdin closed: %s", e)  # the reader sees the engine go
        finally:
            try:
                stdin.close()
            except OSError:
                pass

    # ------------------------------------------------------------------ routing (on the loop)

    @property
    def telemetry(self) -> Telemetry:
        return self.session.telemetry

    def _route(self, ev: codec.Event, proc: subprocess.Popen | None = None) -> None:
        if proc is not None and proc is not self.proc:
            return  # a line the lost engine wrote before it went
        if isinstance(ev, Ready):
            assert self._ready is not None
            _resolve(self._ready, None)
        routed = self.session.route(ev)
        if isinstance(ev, Error) and ev.code == "CANCELLED":
            self.cancelled += 1
        if routed.stray and isinstance(ev, Error) and ev.code != "NOT_FOUND":
            log.warning("engine error for no open request: %s", ev)  # NOT_FOUND: a late STOP
        for rid in routed.to:
            if (turn := self._turns.get(rid)) is not None:
                for each in (*routed.before, ev):
                    turn.take(each)
        if routed.ends:
            self._turns.pop(routed.to[0], None)

    def _lose(self, reason: str, proc: subprocess.Popen | None = None) -> None:
        """The engine is gone: fail the handshake or every open request, and make sure it is."""
        if proc is not None and proc is not self.proc:
            return  # the reader of an engine already replaced
        if self.gone is None:
            status = self.proc.poll() if self.proc else None
            self.gone = f"{reason} (exit status {status})" if status is not None else reason
            level = logging.INFO if self._stopping else logging.ERROR
            log.log(level, "%s is unavailable: %s", self.name, self.gone)
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(RuntimeError(f"{self.name} failed to start: {self.gone}"))
        for turn in list(self._turns.values()):
            turn.end(EngineGone(self.gone))
        self._turns.clear()
        self._outbox.put(None)
        self.kill()
        if not self._stopping:
            self._lost.set()
