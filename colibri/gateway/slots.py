"""KV slot pool: which engine slot a request runs in, so a conversation finds its cache again.

A free slot is chosen by, in order: the conversation key the slot last served (a hash of the
messages before the last assistant turn, or a key the client names); the longest earlier prompt
that the new prompt continues (plain completions); the least recently used slot. When every
slot is busy a request waits in a bounded FIFO queue; a full queue refuses at once. `match`
tells, without taking anything, how well a pool's free slots suit a request, so that a gateway
with several engines (`colibri.gateway.replicas`) can send it to the one holding its prefix.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass


class QueueFull(Exception):
    """Every slot is busy and the waiting queue is full."""


NO_MATCH = (False, 0)  # `SlotPool.match` when no free slot holds any of the request


@dataclass(frozen=True)
class Affinity:
    """How a request recognises its conversation's slot."""

    find: str | None = None  # key of the slot that served the conversation so far
    keep: str | None = None  # key to leave on the slot for the conversation's next turn


@dataclass
class _Slot:
    index: int
    busy: bool = False
    key: str | None = None
    prompt: str = ""  # the last prompt it served
    used: int = 0  # tick of its last assignment (0 = never): least recently used first
    inherited: bool = False  # its cache was another conversation's when last taken


class SlotPool:
    """`acquire` a slot (waiting in a bounded queue), `release` it when the engine freed it."""

    def __init__(self, slots: int, max_waiting: int):
        if slots < 1 or max_waiting < 0:
            raise ValueError(f"slots={slots} must be >= 1 and max_waiting={max_waiting} >= 0")
        self.slots = [_Slot(i) for i in range(slots)]
        self.max_waiting = max_waiting
        self._waiters: deque[asyncio.Future[int]] = deque()
        self._tick = 0
        self.admitted = 0  # requests given a slot
        self.completed = 0  # slots given back
        self.rejected = 0  # requests refused with a full queue

    @property
    def busy(self) -> int:
        return sum(s.busy for s in self.slots)

    @property
    def waiting(self) -> int:
        return sum(not w.done() for w in self._waiters)

    @property
    def fresh(self) -> int:
        """Free slots that never served a request: a new conversation there evicts nothing."""
        return sum(not s.busy and s.used == 0 for s in self.slots)

    async def acquire(self, affinity: Affinity, prompt: str) -> int:
        """A slot index for this request; QueueFull when it cannot even wait."""
        slot = None if self.waiting else self._pick(affinity, prompt)
        if slot is None:
            if self.waiting >= self.max_waiting:
                self.rejected += 1
                raise QueueFull(f"{len(self.slots)} slots busy, {self.waiting} requests waiting")
            slot = await self._wait()
        return self._take(slot, affinity, prompt)

    def release(self, index: int) -> None:
        """The engine ended the slot's request: hand the slot to the first waiter, or free it."""
        self.completed += 1
        self._hand_on(index)

    def _hand_on(self, index: int) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(index)  # stays busy: a direct hand-off cannot be overtaken
                return
        self.slots[index].busy = False

    def match(self, affinity: Affinity, prompt: str) -> tuple[bool, int]:
        """How much of the request a free slot holds, as (it served the conversation, length
        of its last prompt that the request continues), the best free slot's; (False, 0) when
        none holds any of it (or none is free)."""
        free = [self._fit(s, affinity, prompt) for s in self.slots if not s.busy]
        return max(free, default=NO_MATCH) if not self.waiting else NO_MATCH

    def _pick(self, affinity: Affinity, prompt: str) -> int | None:
        free = [s for s in self.slots if not s.busy]
        if not free:
            return None
        best = max(free, key=lambda s: self._fit(s, affinity, prompt))  # the first of equals
        if self._fit(best, affinity, prompt) > NO_MATCH:
            return best.index
        return min(free, key=lambda s: s.used).index

    @staticmethod
    def _fit(s: _Slot, affinity: Affinity, prompt: str) -> tuple[bool, int]:
        """The conversation key first, then the longest earlier prompt the request continues."""
        mine = affinity.find is not None and s.key == affinity.find
        return mine, len(s.prompt) if s.prompt and prompt.startswith(s.prompt) else 0

    async def _wait(self) -> int:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # handed a slot, but its client left
                self._hand_on(waiter.result())
            elif waiter in self._waiters:  # a release may already have skipped it
                self._waiters.remove(waiter)
            raise

    def own(self, index: int) -> bool:
        """Whether the request that last took the slot found its own conversation's cache
        there (or an unused slot): only then may it learn how much of that cache it reused,
        or the count would tell one client another's prompt, token by token."""
        return not self.slots[index].inherited

    def _take(self, index: int, affinity: Affinity, prompt: str) -> int:
        self._tick += 1
        self.admitted += 1
        s = self.slots[index]
        mine = s.used == 0 or (s.key is not None and s.key == affinity.find)
        s.inherited = not (mine or (bool(s.prompt) and prompt.startswith(s.prompt)))
        s.busy, s.key, s.prompt, s.used = True, affinity.keep, prompt, self._tick
        return index
