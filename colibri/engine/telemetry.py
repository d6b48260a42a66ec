"""Phase timers behind PERF and PROF: cumulative seconds per phase, deltas per turn.

The expert counters behind the other telemetry lines are `colibri.experts.stats.ExpertStats`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

PHASES = ("t_edisk", "t_ewait", "t_emm", "t_attn", "t_kvb", "t_head")


class Timers:
    """Cumulative seconds per phase (PHASES); `snapshot` and subtraction give per-turn deltas."""

    def __init__(self) -> None:
        self.total = dict.fromkeys(PHASES, 0.0)

    def add(self, phase: str, seconds: float) -> None:
        self.total[phase] += seconds

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.total[name] += time.perf_counter() - t0

    def snapshot(self) -> dict[str, float]:
        return dict(self.total)
