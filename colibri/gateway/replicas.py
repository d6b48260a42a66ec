"""Replicas: n engine subprocesses behind one gateway, each with its own KV slots.

A request goes to a (replica, slot). The replica is the one whose free slot holds the request's
prefix (the conversation's key, else the longest earlier prompt it continues: what
`SlotPool.match` reports), so a conversation's next turn finds its cache again; a request no
free slot holds goes to the replica with the fewest requests in flight or queued (ties: the
one with more slots that never served a request, whose caches it evicts nothing from; then the
lowest index). Within the replica its `SlotPool` picks the slot, or queues the request.

A replica whose engine is lost fails its own requests, those in flight and those queued for its
slots (`EngineGone`: 503), and is restarted by its supervisor as a lone engine is; meanwhile
the others take every new request. Each replica keeps its own state folder (usage counts, KV
files), and `replica_env` is where a replica would be given its own devices.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from colibri.engine.settings import EngineSettings
from colibri.gateway.engine_client import EngineClient
from colibri.gateway.slots import NO_MATCH, Affinity, SlotPool


class Unavailable(Exception):
    """No replica's engine is running; the message says why."""


@dataclass
class Replica:
    """One engine and the pool of its KV slots."""

    index: int
    engine: EngineClient
    pool: SlotPool

    @property
    def load(self) -> int:
        """Requests in its slots or waiting for one."""
        return self.pool.busy + self.pool.waiting


class Replicas:
    """The gateway's engines: `acquire` a (replica, slot) for a request."""

    def __init__(self, engines: Sequence[EngineClient], slots: int, max_waiting: int):
        if not engines:
            raise ValueError("no engines")
        self.replicas = [Replica(i, e, SlotPool(slots, max_waiting)) for i, e in enumerate(engines)]

    def __len__(self) -> int:
        return len(self.replicas)

    def __iter__(self) -> Iterator[Replica]:
        return iter(self.replicas)

    def __getitem__(self, index: int) -> Replica:
        return self.replicas[index]

    @property
    def alive(self) -> list[Replica]:
        return [r for r in self.replicas if r.engine.alive]

    def route(self, affinity: Affinity, prompt: str) -> Replica:
        """The running replica whose free slot holds the most of the request, else the least
        loaded one (then the one with more never-used slots, then by index); Unavailable when
        none is running."""
        up = self.alive
        if not up:
            raise Unavailable(self.why_down())
        held = max(up, key=lambda r: r.pool.match(affinity, prompt))  # the first of equals
        if held.pool.match(affinity, prompt) > NO_MATCH:
            return held
        return min(up, key=lambda r: (r.load, -r.pool.fresh, r.index))

    async def acquire(self, affinity: Affinity, prompt: str) -> tuple[Replica, int]:
        """A replica and one of its slots (after waiting in its queue if it must); Unavailable,
        or QueueFull from its pool. Routing and the pool's pick run with no await between
        them, so no other request can take the slot chosen for this one."""
        replica = self.route(affinity, prompt)
        return replica, await replica.pool.acquire(affinity, prompt)

    def why_down(self) -> str:
        """Why no replica serves: the engine's reason alone, or each replica's."""
        if len(self.replicas) == 1:
            return self.replicas[0].engine.why_down
        return "; ".join(f"replica {r.index}: {r.engine.why_down}" for r in self.replicas)


def replica_settings(
    settings: EngineSettings, model_dir: Path, index: int, count: int
) -> EngineSettings:
    """The engine settings of replica `index` of `count`: the gateway's, except that with more
    than one replica each has its own state folder (`replica<i>` under STATE_DIR, or under the
    model folder when it is unset), since each writes its own usage counts and KV files
    (KVSAVE), per slot, which the others would overwrite."""
    if count == 1:
        return settings
    base = Path(settings.state_dir) if settings.state_dir else model_dir
    return replace(settings, state_dir=str(base / f"replica{index}"))


def replica_env(settings: EngineSettings, index: int, count: int) -> dict[str, str]:
    """Variables that choose the devices replica `index` of `count` runs on, added to its
    engine's environment. Every replica sees the same devices for now: on the CPU they share
    its cores, which is all that machine has. This is the one place to give each its own set
    on a machine with several accelerators, e.g. `CUDA_VISIBLE_DEVICES` naming devices
    `index * settings.devices` up to `(index + 1) * settings.devices`, each replica then
    spreading its experts over its own `DEVICES`."""
    return {}
