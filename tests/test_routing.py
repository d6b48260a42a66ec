"""Routing rules with hand-set weights: what the bias and the group limit do, and do not do."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from colibri.config import MoeConfig
from colibri.model.moe import route

E = 8
SIGMOID = MoeConfig(
    num_experts=E,
    top_k=2,
    moe_ff=4,
    router="sigmoid_group",
    norm_topk_prob=True,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.0,
)


def _route(m: MoeConfig, logits: list[float], bias: list[float] | None = None):
    # router = identity, so the hidden row *is* the router logits
    w = {"router": jnp.eye(E), "bias": jnp.asarray(bias or [0.0] * E, jnp.float32)}
    ids, wts = route(m, w, jnp.asarray([logits], jnp.float32))
    order = np.argsort(np.asarray(ids[0]))
    return np.asarray(ids[0])[order].tolist(), np.asarray(wts[0])[order]


def _sig(x):
    return 1 / (1 + np.exp(-np.asarray(x, np.float64)))


def test_bias_changes_choice_not_weights():
    logits = [2.0, 1.5, -1.0, -1.0, 1.0, -1.0, 0.5, -1.0]
    ids, wts = _route(SIGMOID, logits)
    assert ids == [0, 1]
    bias = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    bias[4] = 1.0  # expert 4 (group 2) now outranks expert 1 in the choice
    ids_b, wts_b = _route(SIGMOID, logits, bias)
    assert ids_b == [0, 4]
    s = _sig([logits[0], logits[4]])
    np.testing.assert_allclose(wts_b, 2.0 * s / s.sum(), rtol=1e-6)  # unbiased scores, scaled
    s = _sig(logits[:2])
    np.testing.assert_allclose(wts, 2.0 * s / s.sum(), rtol=1e-6)


def test_group_limit_excludes_best_expert_of_weak_group():
    # groups: {0,1} {2,3} {4,5} {6,7}; group score = sum of its top two
    logits = [3.0, -6.0, 1.0, 1.0, 0.9, 0.9, -6.0, -6.0]
    ids, _ = _route(SIGMOID, logits)
    # expert 0 is the single best, but its group {0,1} scores below {2,3} and {4,5}
    assert 0 not in ids
    assert ids == [2, 3]


def test_bias_moves_a_group_into_the_limit():
    logits = [3.0, -6.0, 1.0, 1.0, 0.9, 0.9, -6.0, -6.0]
    bias = [0.0, 0.6, 0, 0, 0, 0, 0, 0]  # lifts group {0,1} above {4,5}
    ids, wts = _route(SIGMOID, logits, bias)
    assert ids == [0, 2] or ids == [0, 3]
    s = _sig([logits[i] for i in ids])
    np.testing.assert_allclose(wts, 2.0 * s / s.sum(), rtol=1e-6)


def test_softmax_topk_with_and_without_renormalisation():
    logits = [1.0, 3.0, 0.0, 2.0, -1.0, 0.5, 0.0, 0.0]
    p = np.exp(logits) / np.exp(logits).sum()
    raw = MoeConfig(num_experts=E, top_k=2, moe_ff=4, router="softmax", norm_topk_prob=False)
    ids, wts = _route(raw, logits)
    assert ids == [1, 3]
    np.testing.assert_allclose(wts, p[[1, 3]], rtol=1e-6)
    norm = MoeConfig(num_experts=E, top_k=2, moe_ff=4, router="softmax", norm_topk_prob=True)
    _, wts = _route(norm, logits)
    np.testing.assert_allclose(wts, p[[1, 3]] / p[[1, 3]].sum(), rtol=1e-6)
