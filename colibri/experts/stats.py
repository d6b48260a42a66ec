"""Counters behind the wire telemetry of the experts: selections, tiers, hits, REPINs."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

TIER_DISK, TIER_RAM, TIER_DEVICE = 0, 1, 2


@dataclass(frozen=True)
class RepinEvent:
    """One pin swap: `expert` of MoE row `layer` was promoted from `old_tier`; gpu is its device."""

    layer: int
    expert: int
    old_tier: int
    gpu: int = 0


@dataclass
class ExpertStats:
    """Per (MoE layer row, expert) state the telemetry reports.

    `counts` are cumulative selections (one per token row and chosen expert); `tier` is where each
    expert is now; a lookup is one unique (layer, expert) per forward, a hit one found on device
    or in RAM. `hits_since` marks experts routed since the last `take_hits`, but for the decode
    steps `record_steps` counted last, which `step_hits` keeps one by one (those not yet taken)
    so that the HITS ticks that fall inside a burst can be told apart.
    """

    rows: int
    cols: int
    expert_bytes: int = 0
    counts: np.ndarray = field(init=False)
    tier: np.ndarray = field(init=False)
    hits_since: np.ndarray = field(init=False)
    step_hits: list = field(default_factory=list)  # bool [rows, cols] a step, oldest first
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    repins: deque = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.counts = np.zeros((self.rows, self.cols), np.int64)
        self.tier = np.full((self.rows, self.cols), TIER_DEVICE, np.uint8)
        self.hits_since = np.zeros((self.rows, self.cols), bool)

    def record(self, row: int, ids: np.ndarray) -> None:
        """Count the selections ids [N, K] of one MoE layer in one forward."""
        flat = ids.reshape(-1)
        np.add.at(self.counts[row], flat, 1)
        self.hits_since[row, flat] = True

    def record_all(self, routes: np.ndarray, more: bool = False) -> int:
        """Count routes [rows, ...ids] of every MoE layer at once; returns the number of distinct
        (layer, expert) pairs among them (the lookups of one forward)."""
        if routes.size == 0:  # (no rows kept: no decode step)
            if not more:
                self._settle()
            return 0
        return int(self.record_steps(routes.reshape(1, self.rows, 1, -1), more=more)[0])

    def record_steps(
        self, routes: np.ndarray, keep: np.ndarray | None = None, more: bool = False
    ) -> np.ndarray:
        """`record_all` of several forwards at once: routes [steps, layers, N, K], where only
        the token rows n with keep [steps, N] are counted. Returns each step's number of
        distinct (layer, expert) pairs. `more`: the steps follow those of the call before in
        one burst (its step by step count)."""
        steps, layers = routes.shape[:2]
        n = layers * self.cols
        flat = routes.astype(np.int64)
        flat += (np.arange(steps) * n)[:, None, None, None]
        flat += (np.arange(layers) * self.cols)[:, None, None]
        if keep is not None:
            flat = flat[np.broadcast_to(keep[:, None, :, None], flat.shape)]
        chosen = np.bincount(flat.ravel(), minlength=steps * n).reshape(steps, n)
        self.counts += chosen.sum(axis=0).reshape(layers, self.cols)
        if not more:
            self._settle()  # the steps of an earlier forward not taken: before these ones
        # a step none of whose rows was kept is no decode step: nothing to tick
        ran = range(steps) if keep is None else np.flatnonzero(keep.any(axis=1))
        self.step_hits += [chosen[s].reshape(layers, self.cols) > 0 for s in ran]
        return np.count_nonzero(chosen, axis=1)

    def _settle(self) -> None:
        for step in self.step_hits:
            self.hits_since |= step
        self.step_hits = []

    def record_lookups(self, lookups: int, hits: int, misses: int = 0) -> None:
        self.lookups += lookups
        self.hits += hits
        self.misses += misses

    def hit_pct(self, since: tuple[int, int] = (0, 0)) -> float:
        """Share of lookups that were hits, over all time or since a (lookups, hits) snapshot."""
        lookups, hits = self.lookups - since[0], self.hits - since[1]
        return 100.0 * hits / lookups if lookups else 100.0

    def take_hits(self, steps: int | None = None) -> np.ndarray:
        """bool [rows, cols] of experts routed since the previous call; resets the marks.
        `steps`: of the decode steps `record_steps` counted last, only the first `steps` not yet
        taken (a HITS tick inside a burst); the rest wait for the next call."""
        out = self.hits_since.copy()
        self.hits_since[:] = False
        n = len(self.step_hits) if steps is None else steps
        for step in self.step_hits[:n]:
            out |= step
        del self.step_hits[:n]
        return out

    def take_repins(self) -> list[RepinEvent]:
        out = list(self.repins)
        self.repins.clear()
        return out

    def heat(self) -> np.ndarray:
        """Bit length of each cumulative count, capped at 63 (0 for never selected)."""
        c = np.maximum(self.counts, 0)
        bits = np.where(c > 0, np.floor(np.log2(np.maximum(c, 1))).astype(np.int64) + 1, 0)
        return np.minimum(bits, 63).astype(np.uint8)

    def emap(self) -> bytes:
        """One byte per expert, row-major: (tier << 6) | heat."""
        return ((self.tier.astype(np.uint8) << 6) | self.heat()).tobytes()

    def tier_counts(self) -> tuple[int, int, int, float, float]:
        """(device experts, RAM experts, disk experts, device GB, RAM GB) for TIERS."""
        n = [int(np.sum(self.tier == t)) for t in (TIER_DEVICE, TIER_RAM, TIER_DISK)]
        gb = self.expert_bytes / 2**30
        return n[0], n[1], n[2], n[0] * gb, n[1] * gb
