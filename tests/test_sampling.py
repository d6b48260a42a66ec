"""The engine's greedy choice on device (colibri.engine.sampling.greedy_ids: the CPU kernels'
colibri_greedy, or two plain reductions in XLA) against jnp.argmax, whose result both compute:
the lowest id of the largest logit, or of the first NaN where there is one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri import kernels
from colibri.engine.sampling import greedy_ids, xla_greedy_ids

# Few distinct values, so that ties are common; infinities and NaN among them.
VALUES = st.sampled_from([-np.inf, -2.5, -0.0, 0.0, 1.0, 1.5, np.inf, np.nan])
fast = jax.jit(greedy_ids)
WAYS = {"engine": fast, "xla": jax.jit(xla_greedy_ids)}


@st.composite
def logit_rows(draw):
    """[rows, vocab]: vocabularies shorter than, equal to and past the kernel's eight lanes
    (its whole eights, then the rest one by one)."""
    rows, vocab = draw(st.integers(1, 3)), draw(st.sampled_from([1, 5, 8, 17, 40]))
    return np.array(
        draw(st.lists(VALUES, min_size=rows * vocab, max_size=rows * vocab)), np.float32
    ).reshape(rows, vocab)


def test_the_engine_takes_the_kernel_on_the_cpu():
    text = jax.jit(greedy_ids).lower(jnp.zeros((2, 9), jnp.float32)).as_text()
    assert ("colibri_greedy" in text) == kernels.usable(jnp.zeros(1, jnp.float32))


@pytest.mark.parametrize("way", list(WAYS))
@settings(max_examples=300, deadline=None)
@given(logits=logit_rows())
def test_greedy_ids_are_jnp_argmax(way, logits):
    got = WAYS[way](jnp.asarray(logits))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, jnp.argmax(jnp.asarray(logits), axis=-1))


@pytest.mark.parametrize("way", list(WAYS))
@pytest.mark.parametrize("vocab", [1, 8, 40, 1000])
def test_a_row_of_minus_infinity_gives_the_first_id(way, vocab):
    logits = np.full((2, vocab), -np.inf, np.float32)
    logits[1, vocab // 2] = np.nan
    np.testing.assert_array_equal(WAYS[way](jnp.asarray(logits)), [0, vocab // 2])


@pytest.mark.parametrize("way", list(WAYS))
def test_the_largest_anywhere_in_a_long_row(way):
    """Every place of a 1000-token row, in each of the eight lanes and the tail, and a tie
    behind it."""
    rng = np.random.default_rng(3)
    row = rng.uniform(-4, 4, 1000).astype(np.float32)
    logits = np.repeat(row[None], 1000, axis=0)
    logits[np.arange(1000), np.arange(1000)] = 9.0
    logits[np.arange(999), np.arange(1, 1000)] = 9.0  # the same largest one later: not taken
    np.testing.assert_array_equal(WAYS[way](jnp.asarray(logits)), np.arange(1000))


def test_ties_take_the_lowest_id_and_nan_wins():
    logits = jnp.asarray([[0.0, 3.0, 3.0], [np.nan, 1.0, np.nan], [1.0, 2.0, np.nan]])
    np.testing.assert_array_equal(fast(logits), [1, 0, 2])
    # A step's logits [B, 1, V] as the decode programs hold them.
    np.testing.assert_array_equal(fast(logits[:, None, :]), [[1], [0], [2]])
