"""Next-token choice from logits: greedy at temperature 0, else temperature + nucleus (top_p)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from colibri import kernels


def sample(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """One token id from logits [V]; greedy when temperature == 0."""
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64)
    z = (z - z.max()) / temperature  # 0 at the best: no inf - inf however small the temperature
    p = np.exp(z)
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        keep = np.cumsum(p[order]) - p[order] < top_p  # smallest prefix whose mass reaches top_p
        mask = np.zeros_like(p, dtype=bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return int(rng.choice(p.shape[0], p=p))


def greedy_ids(logits: jax.Array) -> jax.Array:
    """int32 argmax over the last axis, on device: the lowest id of the largest logit, or of
    the first NaN where there is one, as jnp.argmax gives it. On the CPU kernels, one call
    (`kernels.greedy`): XLA's max, compare-and-select and min over ids took ~215 µs of a
    16-row decode step over a vocabulary of 8192. Elsewhere a max and a min over ids, two
    plain reductions: XLA's CPU argmax (one reduce over value and id pairs) took 5x as long
    alone."""
    if kernels.usable(logits):
        flat = logits.reshape(-1, logits.shape[-1])
        return kernels.greedy(flat).reshape(logits.shape[:-1])
    return xla_greedy_ids(logits)


def xla_greedy_ids(logits: jax.Array) -> jax.Array:
    """greedy_ids in XLA's own ops (off the CPU kernels)."""
    ids = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    top = jnp.max(logits, axis=-1, keepdims=True)  # NaN where any logit is NaN
    hit = (logits == top) | jnp.isnan(logits)
    return jnp.min(jnp.where(hit, ids, logits.shape[-1]), axis=-1)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())
