"""The routed-expert loop: each (row, k) output is that expert's SwiGLU of that row, exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri.model.moe import expert_outputs, expert_plan

D, F = 8, 4


def reference(experts: dict, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    y = np.zeros((*ids.shape, D), np.float32)
    for (n, k), e in np.ndenumerate(ids):
        if e >= 0:
            g, u, d = (np.asarray(experts[t][e], np.float64) for t in ("gate", "up", "down"))
            a, b = g @ x[n], u @ x[n]
            y[n, k] = d @ (a / (1 + np.exp(-a)) * b)
    return y


_jitted = jax.jit(expert_outputs, static_argnums=(3, 4))


@settings(max_examples=15, deadline=None)
@given(
    rows=st.integers(1, 9),
    top_k=st.integers(1, 4),
    slots=st.integers(4, 12),
    plan=st.sampled_from([None, (1, 1), (2, 1), (3, 2), (8, 4), (4, 9)]),
    unstaged=st.floats(0, 1),
    seed=st.integers(0, 2**16),
)
def test_loop_matches_row_by_row(rows, top_k, slots, plan, unstaged, seed):
    rng = np.random.default_rng(seed)
    experts = {
        k: rng.standard_normal(s).astype(np.float32)
        for k, s in (("gate", (slots, F, D)), ("up", (slots, F, D)), ("down", (slots, D, F)))
    }
    x = rng.standard_normal((rows, D)).astype(np.float32)
    ids = np.stack([rng.choice(slots, top_k, replace=False) for _ in range(rows)]).astype(np.int32)
    ids[rng.random(ids.shape) < unstaged] = -1  # not staged in this chunk
    y = _jitted({k: jnp.asarray(v) for k, v in experts.items()}, x, ids, slots, plan)
    np.testing.assert_allclose(np.asarray(y), reference(experts, x, ids), rtol=2e-5, atol=2e-5)


def test_chunks_assemble_bitwise():
    """Outputs computed over disjoint chunks of staged experts sum to the one-pass output."""
    rng = np.random.default_rng(0)
    E, N, K = 16, 16, 4
    experts = {
        k: jnp.asarray(rng.standard_normal(s).astype(np.float32))
        for k, s in (("gate", (E, F, D)), ("up", (E, F, D)), ("down", (E, D, F)))
    }
    x = jnp.asarray(rng.standard_normal((N, D)).astype(np.float32))
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(N)]).astype(np.int32)
    for plan in (None, (2, 1), (4, 2)):  # rows by blocks, by rows, and both
        whole = np.asarray(_jitted(experts, x, ids, E, plan))
        parts = [np.where(ids % 3 == c, ids, -1).astype(np.int32) for c in range(3)]
        assembled = sum(np.asarray(_jitted(experts, x, p, E, plan)) for p in parts)
        np.testing.assert_array_equal(assembled, whole)


def test_plan_rows_one_by_one_at_batch_one_and_in_blocks_for_prefill(monkeypatch):
    assert expert_plan(1, 8, 64) == (1, 1)  # decode: row by row
    assert expert_plan(16, 8, 64) == (1, 1)
    assert expert_plan(256, 8, 64) == (32, 8)  # prefill: blocks
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert expert_plan(1, 8, 64) == (1, 1)
    assert expert_plan(16, 8, 64) == (2, 1)
