"""Device slot cache of one MoE layer: fixed-shape buffers updated in place, and who sits where."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from colibri import hugepages
from colibri.experts.ram import Weights
from colibri.model import parallel

_NAMES = ("gate", "up", "down")
_ALIGN = 64  # bytes: what XLA:CPU asks of a buffer it aliases


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
    same way (`parallel.expert_outputs`).

    On one CPU device the buffers are host memory this class owns (`host`, numpy), which the
    JAX arrays in `bufs` alias: staging an expert is then a plain copy into its slot, 5-10x
    faster here than XLA's in-place update of a donated buffer. A slot is only written while
    no computation reads it: the store stages between chunks, each computed to completion.
    """

    def __init__(self, n: int, num_experts: int, shapes: dict[str, tuple], dtype=np.float32):
        self.per_device = n
        self.devices = len(parallel.devices())
        self.n = n * self.devices
        self.num_experts = num_experts
        self.host = _host_buffers(self.n, shapes, dtype) if parallel.mesh() is None else None
        if self.host is not None:
            self.bufs = {k: jax.device_put(a) for k, a in self.host.items()}
            if any(
                self.bufs[k].unsafe_buffer_pointer() != a.ctypes.data for k, a in self.host.items()
            ):
                self.host = None  # copied, not aliased: update through XLA as elsewhere
        if self.host is None:
            self.bufs = {k: jnp.zeros((self.n, *shapes[k]), dtype) for k in _NAMES}
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
        for name, a in zip(_NAMES, w, strict=True):
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
        if self.host is not None:
            for name, a in zip(_NAMES, w, strict=True):
                self.host[name][slot] = np.asarray(a)
        elif parallel.mesh() is None:
            dev = self.bufs["gate"].sharding
            w = tuple(jax.device_put(a, dev) for a in w)  # host (or pinned host) -> device
            self.bufs = _put(self.bufs, jnp.int32(slot), *w)
        else:
            self._put_on_owner(slot, w)
        self.slot_of[expert] = slot
        self.expert_in[slot] = expert
        return old


def _host_buffers(n: int, shapes: dict[str, tuple], dtype) -> dict[str, np.ndarray] | None:
    """Zeroed host buffers for the slots where the device is this CPU, else None. Aligned as
    XLA wants its buffers (an unaligned one would be copied, not aliased)."""
    if jax.devices()[0].platform != "cpu":
        return None
    out = {}
    for k in _NAMES:
        shape, dt = (n, *shapes[k]), np.dtype(dtype)
        count = int(np.prod(shape))
        if count * dt.itemsize >= hugepages.HUGE:
            a = hugepages.empty(shape, dt)
        else:  # small: 64-byte aligned inside a little more
            raw = np.empty(count * dt.itemsize + _ALIGN, np.uint8)
            skip = -raw.ctypes.data % _ALIGN
            a = raw[skip : skip + count * dt.itemsize].view(dt).reshape(shape)
        a.fill(0)
        out[k] = a
    return out
