"""The training path: dropless expert mixing, router losses, descent, saving for both runtimes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny

from colibri import training
from colibri.config import config_from_dict
from colibri.engine.model import load_model
from colibri.engine.runner import Runner
from colibri.jaxcache import enable_compilation_cache
from colibri.synth import SynthSpec, hf_config

enable_compilation_cache()
SPEC = SynthSpec(family="qwen3_moe", layers=2, experts=8, top_k=2, hidden=32, moe_ff=16, vocab=300)


def tiny_cfg(family: str = "qwen3_moe"):
    raw = hf_config(SynthSpec(**{**SPEC.__dict__, "family": family}))
    return raw, config_from_dict(raw)


def reference_outputs(experts, x, ids):
    """y[n, k] = expert ids[n, k] on x[n], one row at a time."""
    out = np.zeros((*ids.shape, x.shape[1]), np.float32)
    for n in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            g, u, d = (np.asarray(experts[w][ids[n, k]]) for w in ("gate", "up", "down"))
            h = x[n] @ g.T
            out[n, k] = ((h / (1 + np.exp(-h))) * (x[n] @ u.T)) @ d.T
    return out


@pytest.mark.parametrize("skew", [False, True], ids=["spread", "one-expert-takes-all"])
def test_blocked_expert_outputs_match_row_by_row(skew):
    rng = np.random.default_rng(0)
    E, F, D, N, K = 8, 16, 32, 40, 2
    experts = {k: rng.standard_normal((E, F, D), np.float32) * 0.3 for k in ("gate", "up")}
    experts["down"] = rng.standard_normal((E, D, F), np.float32) * 0.3
    x = rng.standard_normal((N, D), np.float32)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(N)]).astype(np.int32)
    if skew:  # every row picks expert 3 first: its run spans several blocks
        ids[:, 0] = 3
        ids[:, 1] = np.where(ids[:, 1] == 3, 4, ids[:, 1])
    y = training.expert_outputs_blocked(experts, jnp.asarray(x), jnp.asarray(ids), block=4)
    np.testing.assert_allclose(np.asarray(y), reference_outputs(experts, x, ids), atol=1e-5)


def test_balance_loss_is_E_times_sum_of_f_times_P_on_a_hand_set_case():
    probs = jnp.asarray([[0.7, 0.2, 0.1, 0.0], [0.1, 0.6, 0.2, 0.1], [0.4, 0.4, 0.1, 0.1]])
    ids = jnp.asarray([[0, 1], [1, 2], [0, 1]])
    f = np.array([2, 3, 1, 0]) / 6  # share of the six assignments
    P = np.array([1.2, 1.2, 0.4, 0.2]) / 3  # mean router probability
    assert float(training.balance_loss(probs, ids)) == pytest.approx(4 * np.sum(f * P))
    uniform = jnp.full((4, 4), 0.25)
    spread = jnp.asarray([[0, 1], [2, 3], [0, 1], [2, 3]])
    assert float(training.balance_loss(uniform, spread)) == pytest.approx(1.0)


def test_z_loss_is_mean_squared_logsumexp():
    logits = jnp.asarray([[0.0, 0.0], [1.0, -1.0]])
    want = np.mean(np.log(np.exp(np.asarray(logits)).sum(-1)) ** 2)
    assert float(training.z_loss(logits)) == pytest.approx(want, rel=1e-6)


def test_cross_entropy_matches_log_softmax():
    rng = np.random.default_rng(1)
    logits, targets = rng.standard_normal((3, 5, 7)), rng.integers(0, 7, (3, 5))
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = -np.mean(np.take_along_axis(logp, targets[..., None], -1))
    got = training.cross_entropy(jnp.asarray(logits, jnp.float32), jnp.asarray(targets))
    assert float(got) == pytest.approx(want, rel=1e-5)


def test_gradients_are_finite_and_reach_every_expert():
    _, cfg = tiny_cfg()
    state = training.init_state(cfg, seed=0)
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 300, (4, 33)), jnp.int32)
    grads = jax.jit(jax.grad(lambda s: training.loss(cfg, training.LossWeights(), s, batch)[0]))(
        state
    )
    leaves = jax.tree_util.tree_leaves(grads)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    for layer in grads["experts"]:  # 128 rows x top-2 over 8 experts: all get rows
        assert bool(jnp.all(jnp.abs(layer["gate"]).sum(axis=(1, 2)) > 0))


def test_loss_decreases_and_training_is_deterministic():
    pytest.importorskip("optax")
    _, cfg = tiny_cfg()
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 300, (4, 33)), jnp.int32)

    opt = training.make_optimizer(lr=1e-2, steps=20, warmup=2, weight_decay=0.1)
    step = training.make_train_step(cfg, opt)

    def run():
        state = training.init_state(cfg, seed=0)
        opt_state, losses = opt.init(state), []
        for _ in range(12):
            state, opt_state, m = step(state, opt_state, batch)
            losses.append(float(m["ce"]))
        return losses

    a, b = run(), run()
    assert a == b
    assert a[-1] < a[0] - 0.5


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_saved_checkpoint_matches_training_forward_colibri_and_transformers(family, tmp_path):
    raw, cfg = tiny_cfg(family)
    state = training.init_state(cfg, seed=3, std=0.2)  # large weights: routing is not a tie
    tiny.train_tokenizer(tmp_path, vocab=300)
    training.save_checkpoint(tmp_path, raw, state, eos_id=299)
    ids = list(np.random.default_rng(2).integers(0, 299, 24))
    ours, _ = training.forward(cfg, state, jnp.asarray([ids], jnp.int32))
    served = Runner(load_model(tmp_path, progress=False), capacity=64).full_logits(ids)
    np.testing.assert_allclose(served, np.asarray(ours[0]), atol=1e-4)
    np.testing.assert_allclose(tiny.hf_logits(tmp_path, ids), served, atol=1e-4)


def test_windows_cycle_domains_and_stay_in_range():
    streams = [np.full(50, d, np.int32) for d in range(3)]
    w = training.sample_windows(np.random.default_rng(0), streams, rows=6, length=10, first=1)
    assert w.shape == (6, 10) and list(w[:, 0]) == [1, 2, 0, 1, 2, 0]
    e = training.even_windows(np.arange(100, dtype=np.int32), length=30, count=5)
    assert e.shape == (3, 30) and e[0, 0] == 0 and e[-1, -1] == 99
