"""KV slots and the two kinds of step over them: chunked prefill of one slot, batched decode."""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from colibri.engine.model import Model
from colibri.engine.telemetry import ExpertStats, Timers
from colibri.model import transformer

PREFILL_CHUNK = 256  # longest prefill step; longer prompts go through in chunks
_MIN_BUCKET = 8


def bucket(n: int, lo: int = _MIN_BUCKET, hi: int | None = None) -> int:
    """Smallest power of two >= n (at least lo, at most hi): the shapes we compile for."""
    b = lo
    while b < n:
        b *= 2
    return b if hi is None else min(b, hi)


@dataclass(frozen=True)
class Row:
    """One decode row: the slot it extends, the token it feeds, and that token's position."""

    slot: int
    token: int
    pos: int


class Runner:
    """A model with a KV cache of `slots` conversations of up to `capacity` positions each."""

    def __init__(self, model: Model, slots: int = 1, capacity: int = 2048):
        self.model = model
        self.cfg = model.cfg
        self.slots = slots
        self.capacity = capacity
        self.cache = transformer.init_cache(self.cfg, slots, capacity)
        m = self.cfg.moe
        self.stats = ExpertStats(
            len(self.cfg.moe_layer_ids), m.num_experts, 3 * m.moe_ff * self.cfg.hidden * 4
        )
        self.timers = Timers()

    def _record(self, routes: np.ndarray) -> None:
        """Telemetry for one forward's routing ids [n_moe, N, K] (real rows only)."""
        for row, ids in enumerate(routes):
            self.stats.record(row, ids)
            n = len(np.unique(ids))
            self.stats.record_lookups(n, n)  # all resident: every lookup is a device hit

    def _kv_len(self, max_pos: int) -> int:
        return bucket(max_pos + 1, lo=32, hi=self.capacity)

    def prefill(
        self, slot: int, tokens: list[int], start: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """Feed tokens at positions start.. into `slot`; logits [V] after the last one, routes."""
        if start + len(tokens) > self.capacity:
            raise ValueError(
                f"{start + len(tokens)} positions exceed the context of {self.capacity}"
            )
        logits, routes = None, []
        for at in range(0, len(tokens), PREFILL_CHUNK):
            chunk = tokens[at : at + PREFILL_CHUNK]
            logits, r = self._prefill_chunk(slot, chunk, start + at)
            routes.append(r[:, : len(chunk)])
            self._record(routes[-1])
        assert logits is not None, "prefill needs at least one token"
        return logits, np.concatenate(routes, axis=1)

    def _prefill_chunk(self, slot: int, chunk: list[int], start: int):
        T = bucket(len(chunk), hi=PREFILL_CHUNK)
        toks = np.zeros((1, T), np.int32)
        toks[0, : len(chunk)] = chunk
        pos = (start + np.arange(T, dtype=np.int32))[None]
        logits, self.cache, routes = transformer.forward(
            self.cfg,
            self.model.params,
            self.model.experts,
            self.cache,
            jnp.asarray(toks),
            jnp.asarray(pos),
            jnp.asarray([slot], jnp.int32),
            jnp.asarray([len(chunk) - 1], jnp.int32),
            kv_len=self._kv_len(start + len(chunk) - 1),
        )
        return np.asarray(logits[0]), np.asarray(routes[:, 0])  # [V], [n_moe, T, K]

    def decode(self, rows: list[Row]) -> tuple[np.ndarray, np.ndarray]:
        """One token for each row, all in one forward: logits [B, V], routes [n_moe, B, K]."""
        B = bucket(len(rows), lo=1)
        toks = np.zeros((B, 1), np.int32)
        pos = np.zeros((B, 1), np.int32)
        slots = np.full((B,), self.slots, np.int32)  # padding rows: out-of-range slot, dropped
        for i, r in enumerate(rows):
            toks[i, 0], pos[i, 0], slots[i] = r.token, r.pos, r.slot
        logits, self.cache, routes = transformer.forward(
            self.cfg,
            self.model.params,
            self.model.experts,
            self.cache,
            jnp.asarray(toks),
            jnp.asarray(pos),
            jnp.asarray(slots),
            jnp.zeros((B,), jnp.int32),
            kv_len=self._kv_len(max(r.pos for r in rows)),
        )
        n = len(rows)
        routes = np.asarray(routes[:, :n, 0])
        self._record(routes)
        return np.asarray(logits[:n]), routes

    def export_slot(self, slot: int, length: int) -> dict[str, np.ndarray]:
        """The first `length` cached positions of `slot`, per layer, as host arrays."""
        return {
            f"{i}.{name}": np.asarray(buf[slot, :length])
            for i, layer in enumerate(self.cache)
            for name, buf in layer.items()
        }

    def import_slot(self, slot: int, arrays: dict[str, np.ndarray]) -> None:
        """Put arrays from `export_slot` back into `slot` (positions 0..length-1)."""
        for i, layer in enumerate(self.cache):
            for name in list(layer):
                data = arrays[f"{i}.{name}"]
                layer[name] = layer[name].at[slot, : data.shape[0]].set(data)

    def full_logits(self, tokens: list[int]) -> np.ndarray:
        """Logits [T, V] at every position of `tokens`, fed from position 0 into slot 0."""
        T = bucket(len(tokens), hi=None)
        toks = np.zeros((1, T), np.int32)
        toks[0, : len(tokens)] = tokens
        pos = np.arange(T, dtype=np.int32)[None]
        logits, self.cache, _ = transformer.forward(
            self.cfg,
            self.model.params,
            self.model.experts,
            self.cache,
            jnp.asarray(toks),
            jnp.asarray(pos),
            jnp.asarray([0], jnp.int32),
            jnp.zeros((1,), jnp.int32),
            kv_len=min(T, self.capacity),
            all_logits=True,
        )
        return np.asarray(logits[0, : len(tokens)])
