"""Host RAM cache of expert weights: least-recently-used within a byte budget, thread-safe."""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

Key = tuple[int, int]  # (MoE layer row, expert)
Weights = tuple[np.ndarray, np.ndarray, np.ndarray]  # gate [F, D], up [F, D], down [D, F]


class RamCache:
    """LRU map (layer, expert) -> weights; never exceeds `budget` bytes."""

    def __init__(self, budget: int):
        self.budget = budget
        self.used = 0
        self._items: OrderedDict[Key, Weights] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: Key) -> bool:
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list[Key]:
        with self._lock:
            return list(self._items)

    def get(self, key: Key) -> Weights | None:
        with self._lock:
            w = self._items.get(key)
            if w is not None:
                self._items.move_to_end(key)
            return w

    def put(self, key: Key, w: Weights, protect: frozenset | set = frozenset()) -> list[Key]:
        """Insert (most recent); returns the keys evicted to make room, never one in `protect`.

        When the budget cannot be met without evicting a protected key, nothing is stored.
        """
        size = sum(a.nbytes for a in w)
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return []
            victims, freed = [], 0
            for k, old in self._items.items():  # oldest first
                if self.used - freed + size <= self.budget:
                    break
                if k not in protect:
                    victims.append(k)
                    freed += sum(a.nbytes for a in old)
            if self.used - freed + size > self.budget:
                return []
            for k in victims:
                del self._items[k]
            self.used -= freed
            self._items[key] = w
            self.used += size
        return victims
