"""One engine session as a server sees it: the handshake, the latest telemetry, and which open
requests each engine line belongs to. Pure: no threads, no I/O; a transport (the notebook client,
the gateway) feeds it the parsed events in stream order and delivers them where it says.

How lines are attributed. The engine's one stdout writer emits a turn's block contiguously,
``HWINFO PERF ENTROPY GPUS TIERS EMAP HITS PROF DONE``, so nothing interleaves inside it:

- DATA, TOPK, GATES, ACCEPT, PERF, DONE and ERROR carry the request id.
- ENTROPY, GPUS, TIERS, EMAP and PROF after a PERF belong to that PERF's request until its
  DONE; the HWINFO just before the PERF does too (delivered with the PERF).
- HITS (every few decode steps, and in each turn block) and REPIN describe the whole engine:
  they belong to every request in flight when they arrive.
- Unknown line kinds are counted and belong to nobody (the forward-compatibility rule).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from colibri.protocol.codec import (
    Accept,
    Data,
    Done,
    Emap,
    Entropy,
    Error,
    Event,
    Gates,
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
)

REPIN_KEEP = 64  # recent REPIN events kept
PROFILE_KEEP = 120  # recent turns' PROF lines kept


@dataclass
class Handshake:
    """The startup lines: STAT, HWINFO, TIERS, EMAP (after READY)."""

    stat: Stat | None = None
    hwinfo: HwInfo | None = None
    tiers: Tiers | None = None
    emap: Emap | None = None


@dataclass
class Telemetry:
    """The latest engine-wide telemetry."""

    hwinfo: HwInfo | None = None
    tiers: Tiers | None = None
    emap: Emap | None = None
    hits: Hits | None = None
    gpus: Gpus | None = None
    entropy: Entropy | None = None
    repins: deque[Repin] = field(default_factory=lambda: deque(maxlen=REPIN_KEEP))
    profile: deque[Prof] = field(default_factory=lambda: deque(maxlen=PROFILE_KEEP))
    seq: int = 0  # EMAP and HITS lines seen: a map's version
    profile_seq: int = 0  # PROF lines seen

    def update(self, ev: Event) -> None:
        if isinstance(ev, Emap | Hits):
            self.seq += 1
        if isinstance(ev, Repin):
            self.repins.append(ev)
        elif isinstance(ev, Prof):
            self.profile.append(ev)
            self.profile_seq += 1
        elif isinstance(ev, HwInfo | Tiers | Emap | Hits | Gpus | Entropy):
            setattr(self, _LATEST[type(ev)], ev)


_LATEST = {
    HwInfo: "hwinfo",
    Tiers: "tiers",
    Emap: "emap",
    Hits: "hits",
    Gpus: "gpus",
    Entropy: "entropy",
}


@dataclass(frozen=True)
class Routed:
    """Where one event goes: to the open requests `to` (none: engine-wide only), after the
    events `before` (an earlier line that turned out to be theirs); `ends` when it is the DONE
    or ERROR that closes `to[0]`; `stray` when it names a request that is not open."""

    to: tuple[int, ...] = ()
    before: tuple[Event, ...] = ()
    ends: bool = False
    stray: bool = False


NOBODY = Routed()


class Session:
    """Feed `route` every engine event in order; `open` each request before its SUBMIT."""

    def __init__(self) -> None:
        self.handshake = Handshake()
        self.telemetry = Telemetry()
        self.ready = False  # the handshake is complete
        self.unknown = 0  # lines of kinds the codec does not know
        self._open: dict[int, None] = {}  # request ids in flight, in submission order
        self._owner: int | None = None  # the request whose turn block is being read
        self._pending_hw: HwInfo | None = None  # a HWINFO that may open a turn block
        self._saw_ready = False

    def open(self, rid: int) -> None:
        if rid in self._open:
            raise ValueError(f"request id {rid} is already in flight")
        self._open[rid] = None

    def in_flight(self) -> list[int]:
        return list(self._open)

    def route(self, ev: Event) -> Routed:
        """Account for one event and say which open requests it belongs to."""
        if isinstance(ev, Unknown):
            self.unknown += 1
            return NOBODY
        hw, self._pending_hw = self._pending_hw, None
        if not self.ready:
            self._handshake(ev)
            return NOBODY
        self.telemetry.update(ev)
        if isinstance(ev, Data | TopK | Gates | Accept | Perf):
            if ev.id not in self._open:
                return Routed(stray=True)
            if isinstance(ev, Perf):
                self._owner = ev.id
                return Routed((ev.id,), before=(hw,) if hw is not None else ())
            return Routed((ev.id,))
        if isinstance(ev, Done | Error):
            if ev.id not in self._open:
                return Routed(stray=True)  # e.g. ERROR 0 BAD_REQUEST for an unreadable header
            del self._open[ev.id]
            if self._owner == ev.id:
                self._owner = None
            return Routed((ev.id,), ends=True)
        if isinstance(ev, Entropy | Gpus | Tiers | Emap | Prof):
            return Routed((self._owner,)) if self._owner is not None else NOBODY
        if isinstance(ev, Hits | Repin):
            return Routed(tuple(self._open))
        if isinstance(ev, HwInfo):
            self._pending_hw = ev
        return NOBODY

    def _handshake(self, ev: Event) -> None:
        h = self.handshake
        if isinstance(ev, Ready):
            self._saw_ready = True
            return
        self.telemetry.update(ev)
        if isinstance(ev, Stat):
            h.stat = ev
        elif isinstance(ev, HwInfo):
            h.hwinfo = ev
        elif isinstance(ev, Tiers):
            h.tiers = ev
        elif isinstance(ev, Emap):
            h.emap = ev
            self.ready = self._saw_ready
