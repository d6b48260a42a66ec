"""Device slot cache of one MoE layer: fixed-shape buffers updated in place, and who sits where."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from colibri.experts.ram import Weights
from colibri.model import parallel


@partial(jax.jit, donate_argnums=(0,))
def _put(bufs: dict, slot: jax.Array, g: jax.Array, u: jax.Array, d: jax.Array) -> dict:
    # Donated: XLA updates the one slab in place instead of copying the whole buffer.
    return {
        "gate": bufs["gate"].at[slot].set(g),
        "up": bufs["up"].at[slot].set(u),
        "down": bufs["down"].at[slot].set(d),
    }


@partial(jax.jit, donate_argnums=(0,))
def _put_one(buf: jax.Array, slot: jax.Array, x: jax.Array) -> jax.Array:
    return buf.at[slot].set(x)


class ExpertSlots:
    """`n` slots of one layer's experts on device: gate/up [n, F, D], down [n, D, F] as held
    (`shapes`: one expert's, weights.expert_shapes; `dtype`: weights.expert_dtype).

    With the experts spread over several devices (`parallel`), each device has n slots of its
    own (the buffers split over the mesh) and an expert sits only in its owner's: slots
    [i n, (i + 1) n) are device i's, and the expert outputs over the buffers are split the
    same way (`parallel.expert_outputs`)."""

    def __init__(self, n: int, num_experts: int, shapes: dict[str, tuple], dtype=np.float32):
        self.per_device = n
        self.devices = len(parallel.devices())
        self.n = n * self.devices
        self.num_experts = num_experts
        self.bufs = {k: jnp.zeros((self.n, *shapes[k]), dtype) for k in ("gate", "up", "down")}
        if parallel.mesh() is not None:
            self.bufs = parallel.split_experts(self.bufs)
        self.slot_of = np.full(num_experts, -1, np.int32)  # expert -> slot, -1 if not on device
        self.expert_in = np.full(self.n, -1, np.int32)  # slot -> expert, -1 if empty
        self.pinned = np.zeros(self.n, bool)
        self.last_used = np.zeros(self.n, np.int64)

    def device_of(self, expert: int) -> int:
        """The device (index in `parallel.devices()`) whose slots `expert` sits in."""
        return parallel.owner(expert, self.num_experts) if self.devices > 1 else 0

    def slots_for(self, expert: int | None) -> range:
        """The slots `expert` may sit in (None: every slot)."""
        if expert is None or self.devices == 1:
            return range(self.n)
        first = self.device_of(expert) * self.per_device
        return range(first, first + self.per_device)

    def can_pin(self, expert: int) -> bool:
        """Whether pinning `expert` leaves its device a slot for the others."""
        return int(self.pinned[self.slots_for(expert)].sum()) < self.per_device - 1

    def _put_on_owner(self, slot: int, w: Weights) -> None:
        """Several devices: the expert goes to the device that owns `slot` alone, into its
        shard of each split buffer, updated in place; the other shards are left as they are."""
        d = slot // self.per_device
        owner = parallel.devices()[d]
        local = jnp.int32(slot - d * self.per_device)
        for name, a in zip(("gate", "up", "down"), w, strict=True):
            buf = self.bufs[name]
            shards = [s.data for s in buf.addressable_shards]
            at = [x.device for x in shards].index(owner)
            shards[at] = _put_one(shards[at], local, jax.device_put(a, owner))
            self.bufs[name] = jax.make_array_from_single_device_arrays(
                buf.shape, buf.sharding, shards
            )

    def touch(self, slots: np.ndarray, tick: int) -> None:
        self.last_used[slots] = tick

    def victim(
        self, protect: set[int], policy: str, counts: np.ndarray, expert: int | None = None
    ) -> int | None:
        """The slot to reuse (for `expert`: among its device's): empty first, else by policy;
        never pinned or protected ones."""
        free = [s for s in self.slots_for(expert) if not self.pinned[s] and s not in protect]
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
        if parallel.mesh() is None:
            dev = self.bufs["gate"].sharding
            w = tuple(jax.device_put(a, dev) for a in w)  # host (or pinned host) -> device
            self.bufs = _put(self.bufs, jnp.int32(slot), *w)
        else:
            self._put_on_owner(slot, w)
        self.slot_of[expert] = slot
        self.expert_in[slot] = expert
        return old
