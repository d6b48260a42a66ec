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
    or in RAM. `hits_since` marks experts routed since the last `take_hits`.
    """

    rows: int
    cols: int
    expert_bytes: int = 0
    counts: np.ndarray = field(init=False)
    tier: np.ndarray = field(init=False)
    hits_since: np.ndarray = field(init=False)
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

    def record_all(self, routes: np.ndarray) -> int:
        """Count routes [rows, ...ids] of every MoE layer at once; returns the number of distinct
        (layer, expert) pairs among them (the lookups of one forward)."""
        if routes.size == 0:
            return 0
        return int(self.record_steps(routes.reshape(1, self.rows, 1, -1))[0])

    def record_steps(self, routes: np.ndarray, keep: np.ndarray | None = None) -> np.ndarray:
        """`record_all` of several forwards at once: routes [steps, layers, N, K], where only
        the token rows n with keep [steps, N] are counted. Returns each step's number of
        distinct (layer, expert) pairs."""
        steps, layers = routes.shape[:2]
        n = layers * self.cols
        flat = routes.astype(np.int64)
        flat += (np.arange(steps) * n)[:, None, None, None]
        flat += (np.arange(layers) * self.cols)[:, None, None]
        if keep is not None:
            flat = flat[np.broadcast_to(keep[:, None, :, None], flat.shape)]
        chosen = np.bincount(flat.ravel(), minlength=steps * n).reshape(steps, n)
        total = chosen.sum(axis=0).reshape(layers, self.cols)
        self.counts += total
        self.hits_since |= total > 0
        return np.count_nonzero(chosen, axis=1)

    def record_lookups(self, lookups: int, hits: int, misses: int = 0) -> None:
        self.lookups += lookups
        self.hits += hits
        self.misses += misses

    def hit_pct(self, since: tuple[int, int] = (0, 0)) -> float:
        """Share of lookups that were hits, over all time or since a (lookups, hits) snapshot."""
        lookups, hits = self.lookups - since[0], self.hits - since[1]
        return 100.0 * hits / lookups if lookups else 100.0

    def take_hits(self) -> np.ndarray:
        """bool [rows, cols] of experts routed since the previous call; resets the marks."""
        out = self.hits_since.copy()
        self.hits_since[:] = False
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
