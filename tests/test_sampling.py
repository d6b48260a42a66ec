"""The engine's greedy choice on device (colibri.engine.sampling.greedy_ids) against
jnp.argmax, whose result it computes in two plain reductions: the lowest id of the largest
logit, or of the first NaN where there is one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri.engine.sampling import greedy_ids

# Few distinct values, so that ties are common; infinities and NaN among them.
VALUES = st.sampled_from([-np.inf, -2.5, -0.0, 0.0, 1.0, 1.5, np.inf, np.nan])
ROWS, VOCAB = 3, 17
fast = jax.jit(greedy_ids)


@settings(max_examples=300, deadline=None)
@given(st.lists(VALUES, min_size=ROWS * VOCAB, max_size=ROWS * VOCAB))
def test_greedy_ids_are_jnp_argmax(values):
    logits = jnp.asarray(np.array(values, np.float32).reshape(ROWS, VOCAB))
    got = fast(logits)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, jnp.argmax(logits, axis=-1))


def test_ties_take_the_lowest_id_and_nan_wins():
    logits = jnp.asarray([[0.0, 3.0, 3.0], [np.nan, 1.0, np.nan], [1.0, 2.0, np.nan]])
    np.testing.assert_array_equal(fast(logits), [1, 0, 2])
    # A step's logits [B, 1, V] as the decode programs hold them.
    np.testing.assert_array_equal(fast(logits[:, None, :]), [[1], [0], [2]])
