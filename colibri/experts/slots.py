"""Device slot cache of one MoE layer: fixed-shape buffers updated in place, and who sits where."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from colibri.experts.ram import Weights


@partial(jax.jit, donate_argnums=(0,))
def _put(bufs: dict, slot: jax.Array, g: jax.Array, u: jax.Array, d: jax.Array) -> dict:
    # Donated: XLA updates the one slab in place instead of copying the whole buffer.
    return {
        "gate": bufs["gate"].at[slot].set(g),
        "up": bufs["up"].at[slot].set(u),
        "down": bufs["down"].at[slot].set(d),
    }


class ExpertSlots:
    """`n` slots of one layer's experts on device: gate/up [n, F, D], down [n, D, F] as held
    (`shapes`: one expert's, weights.expert_shapes; `dtype`: weights.expert_dtype)."""

    def __init__(self, n: int, num_experts: int, shapes: dict[str, tuple], dtype=np.float32):
        self.n = n
        self.bufs = {k: jnp.zeros((n, *shapes[k]), dtype) for k in ("gate", "up", "down")}
        self.slot_of = np.full(num_experts, -1, np.int32)  # expert -> slot, -1 if not on device
        self.expert_in = np.full(n, -1, np.int32)  # slot -> expert, -1 if empty
        self.pinned = np.zeros(n, bool)
        self.last_used = np.zeros(n, np.int64)

    def touch(self, slots: np.ndarray, tick: int) -> None:
        self.last_used[slots] = tick

    def victim(self, protect: set[int], policy: str, counts: np.ndarray) -> int | None:
        """The slot to reuse: empty first, else by policy; never pinned or protected ones."""
        free = [s for s in range(self.n) if not self.pinned[s] and s not in protect]
        if not free:
            return None
        empty = [s for s in free if self.expert_in[s] < 0]
        if empty:
            return empty[0]
        if policy == "lfru":  # least frequently selected, least recently used among equals
            return min(free, key=lambda s: (counts[self.expert_in[s]], self.last_used[s]))
        return min(free, key=lambda s: self.last_used[s])

    def stage(self, slot: int, expert: int, w: Weights) -> int:
        """Put `expert` into `slot`; returns the expert it displaced (-1 if none)."""
        old = int(self.expert_in[slot])
        if old >= 0:
            self.slot_of[old] = -1
        dev = self.bufs["gate"].sharding
        w = tuple(jax.device_put(a, dev) for a in w)  # host (or pinned host) -> device
        self.bufs = _put(self.bufs, jnp.int32(slot), *w)
        self.slot_of[expert] = slot
        self.expert_in[slot] = expert
        return old
