"""Routing statistics on synthetic routes: the uniform baselines against their closed forms,
bootstrap intervals against their nominal coverage, and each statistic against a hand count."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri import analysis
from colibri import routing_stats as rs


def random_routes(rng, L: int, T: int, K: int, E: int) -> np.ndarray:
    """[L, T, K]: K distinct experts per token, uniformly."""
    return np.argsort(rng.random((L, T, E)), axis=2)[..., :K]


# ---------------------------------------------------------------------------- frame access


@settings(max_examples=25, deadline=None)
@given(
    L=st.integers(1, 3),
    K=st.integers(1, 3),
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_routes_round_trip_through_the_frame(L, K, lengths, seed):
    rng = np.random.default_rng(seed)
    E = K + 3
    routes = [random_routes(rng, L, T, K, E) for T in lengths]
    df = rs.routes_frame(routes, docs=[f"d{i}" for i in range(len(routes))], n_experts=E)
    shuffled = df.sample(frac=1.0, random_state=seed)  # order of rows does not matter
    table, back, layers = rs.doc_routes(shuffled)
    assert layers.tolist() == list(range(L))
    order = {d: i for i, d in enumerate(table["doc"])}
    for i, r in enumerate(routes):
        assert np.array_equal(back[order[f"d{i}"]], r)
    assert table.set_index("doc").loc[[f"d{i}" for i in range(len(routes))], "tokens"].tolist() == (
        lengths
    )
    _, counts, _ = rs.doc_counts(df)
    assert counts.sum(axis=0).tolist() == analysis.expert_counts(routes, E).tolist()


# ---------------------------------------------------------------------------- uniform entropy


def brute_force_entropy(n: int, E: int, K: int) -> float:
    """Expected plug-in entropy over every equally likely way n tokens pick K of E experts."""
    subsets = list(itertools.combinations(range(E), K))
    total, count = 0.0, 0
    for pick in itertools.product(subsets, repeat=n):
        c = np.bincount(np.ravel(pick), minlength=E)
        total += rs.plugin_entropy_bits(c)
        count += 1
    return total / count


@pytest.mark.parametrize("n,E,K", [(1, 3, 1), (3, 4, 2), (2, 5, 3), (4, 3, 1), (2, 4, 4)])
def test_exact_uniform_entropy_is_the_mean_over_every_outcome(n, E, K):
    assert rs.uniform_entropy_exact(n, E, K) == pytest.approx(
        brute_force_entropy(n, E, K), abs=1e-12
    )


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 400),
    E=st.integers(2, 64),
    K_frac=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_simulated_uniform_entropy_matches_the_closed_form(n, E, K_frac, seed):
    """The baseline routing_entropy reports (simulated at the corpus' token count) agrees with
    the exact expectation within its Monte Carlo error."""
    K = 1 + int(K_frac * (E - 1))
    sims = rs.simulate_uniform_entropy(n, E, K, sims=2000, seed=seed)
    exact = rs.uniform_entropy_exact(n, E, K)
    se = sims.std() / math.sqrt(len(sims))
    assert abs(sims.mean() - exact) <= 4.5 * se + 1e-9
    assert exact <= rs.uniform_entropy_limit(E) + 1e-12


def test_the_issue_example_and_the_large_n_limit():
    """A uniform top-4 router over 32 experts reads about 4.64 bits at 16 tokens, not 5; as n
    grows it approaches log2(E) as the Miller-Madow expansion says."""
    assert rs.uniform_entropy_exact(16, 32, 4) == pytest.approx(4.64, abs=0.01)
    assert rs.uniform_entropy_limit(32) == 5.0
    for n in (10_000, 100_000, 1_000_000):
        exact = rs.uniform_entropy_exact(n, 32, 4)
        gap = rs.uniform_entropy_limit(32) - exact
        assert gap > 0
        # the expansion's error is O(1/n^2): relative to the gap, O(1/n)
        assert rs.uniform_entropy_asymptotic(n, 32, 4) == pytest.approx(exact, abs=gap * 50 / n)
    assert rs.uniform_entropy_exact(5, 8, 8) == 3.0  # every token picks every expert


def test_simulated_counts_are_those_of_uniform_top_k():
    """The O(E K) sequential sampler against the obvious one (argsort of random keys)."""
    rng = np.random.default_rng(0)
    n, E, K, sims = 30, 6, 2, 20_000
    fast = rs.simulate_uniform_counts(n, E, K, sims, rng)
    assert (fast.sum(axis=1) == n * K).all() and fast.max() <= n
    slow = np.stack(
        [np.bincount(random_routes(rng, 1, n, K, E).ravel(), minlength=E) for _ in range(sims)]
    )
    p = K / E
    for c in (fast, slow):
        assert c.mean(0) == pytest.approx(np.full(E, n * p), rel=0.01)
        assert c.var(0) == pytest.approx(np.full(E, n * p * (1 - p)), rel=0.05)
    cov = [np.cov(c[:, 0], c[:, 1])[0, 1] for c in (fast, slow)]
    assert cov[0] == pytest.approx(cov[1], abs=0.1)  # the counts' dependence as well
    h_fast, h_slow = rs.plugin_entropy_bits(fast), rs.plugin_entropy_bits(slow)
    assert h_fast.mean() == pytest.approx(h_slow.mean(), abs=3e-3)


# ---------------------------------------------------------------------------- coverage


def share_dataset(rng, p: np.ndarray, docs: int, tokens: int, concentration: float):
    """Documents whose expert distributions scatter around p (Dirichlet), K = 1, one layer:
    the population share of each expert is p."""
    routes = []
    for _ in range(docs):
        pd_ = rng.dirichlet(concentration * p)
        routes.append(rng.choice(len(p), size=(1, tokens, 1), p=pd_))
    return rs.routes_frame(routes, n_experts=len(p))


def test_share_intervals_cover_the_true_share_at_the_nominal_rate():
    rng = np.random.default_rng(1)
    p = np.array([0.4, 0.3, 0.2, 0.1])
    covered, total = 0, 0
    for i in range(200):
        df = share_dataset(rng, p, docs=30, tokens=40, concentration=8.0)
        out = rs.expert_shares(df, by=None, n_boot=400, seed=i)
        covered += int(((out.share_lo <= p) & (p <= out.share_hi)).sum())
        total += len(p)
    # 800 intervals (4 per dataset): binomial sd at 0.95 is 0.008; the percentile bootstrap
    # with 30 documents runs a little narrow
    assert 0.90 <= covered / total <= 0.985, covered / total


def test_mean_router_entropy_intervals_cover_the_truth():
    rng = np.random.default_rng(2)
    true_mean, covered = 2.0, 0
    for i in range(200):
        routes = []
        for _ in range(25):
            routes.append(np.zeros((1, 30, 1), int))
        df = rs.routes_frame(routes, n_experts=4)
        doc_mean = true_mean + rng.normal(0, 0.3, 25)
        df["entropy"] = np.repeat(doc_mean, 30) + rng.normal(0, 0.5, len(df))
        df["margin"] = 0.0
        out = rs.router_confidence(df, by=None, n_boot=400, seed=i)
        covered += int(out.entropy_bits_lo[0] <= true_mean <= out.entropy_bits_hi[0])
    assert 0.89 <= covered / 200 <= 0.99, covered / 200


def test_bias_corrected_interval_holds_a_biased_estimate():
    """Plug-in entropy: its bootstrap samples sit below the estimate, and a plain percentile
    interval can miss it; the bias-corrected one keeps it inside."""
    rng = np.random.default_rng(3)
    routes = [random_routes(rng, 2, 20, 2, 8) for _ in range(12)]
    out = rs.routing_entropy(rs.routes_frame(routes, n_experts=8), by=None, n_boot=500)
    assert (out.entropy_bits_lo <= out.entropy_bits).all()
    assert (out.entropy_bits <= out.entropy_bits_hi).all()


# ---------------------------------------------------------------------------- hand counts


def test_expert_shares_by_domain():
    a = np.array([[[0], [0], [1], [2]]])  # 4 tokens: expert 0 twice
    b = np.array([[[3], [3]]])
    df = rs.routes_frame([a, a, b], domains=["x", "x", "y"], n_experts=4)
    out = rs.expert_shares(df, n_boot=50).set_index(["domain", "expert"])
    assert out.loc[("x", 0), "share"] == 0.5 and out.loc[("x", 3), "share"] == 0.0
    assert out.loc[("y", 3), "share"] == 1.0 and np.isnan(out.loc[("y", 3), "share_lo"])
    assert out.loc[("x", 0), "tokens"] == 8 and out.loc[("x", 0), "docs"] == 2
    assert out.loc[("x", 0), "share_lo"] == out.loc[("x", 0), "share_hi"] == 0.5  # alike docs
    assert out.uniform.eq(0.25).all()


def test_routing_entropy_is_the_pooled_count_entropy():
    rng = np.random.default_rng(4)
    routes = [random_routes(rng, 3, int(T), 2, 8) for T in rng.integers(5, 30, 10)]
    df = rs.routes_frame(routes, n_experts=8)
    out = rs.routing_entropy(df, by=None, n_boot=100, sims=500)
    want = analysis.entropy_bits(analysis.expert_counts(routes, 8))
    assert out.entropy_bits.to_numpy() == pytest.approx(want)
    n = sum(r.shape[1] for r in routes)
    assert (out.tokens == n).all() and (out.limit_bits == 3.0).all()
    assert out.uniform_exact[0] == pytest.approx(rs.uniform_entropy_exact(n, 8, 2))
    assert out.uniform_lo[0] < out.uniform_bits[0] < out.uniform_hi[0] < 3.0


def test_router_confidence_means():
    df = rs.routes_frame([np.zeros((2, 3, 2), int)] * 2, n_experts=4)
    df["entropy"] = df["layer"] * 1.0 + df["position"]  # the same on every rank
    df["margin"] = 0.25
    out = rs.router_confidence(df, by=None, n_boot=50)
    assert out.entropy_bits.tolist() == [1.0, 2.0] and out.margin.tolist() == [0.25, 0.25]
    assert out.tokens.tolist() == [6, 6] and out.max_bits.eq(2.0).all()


def test_token_specialisation():
    # expert 0 takes only token 7; expert 1 takes tokens 1..6 once each (K = 1)
    routes = [np.array([[[0], [1], [0], [1], [1], [0], [1], [1], [1]]])]
    tokens = [np.array([7, 1, 7, 2, 3, 7, 4, 5, 6])]
    df = rs.routes_frame(routes * 2, tokens=tokens * 2, n_experts=3)
    out = rs.token_specialisation(df, top=2, n_boot=50, sims=50).set_index("expert")
    assert out.loc[0, "top_share"] == 1.0 and out.loc[1, "top_share"] == pytest.approx(2 / 6)
    assert out.loc[0, "distinct"] == 1 and out.loc[1, "distinct"] == 6
    assert out.loc[0, "selections"] == 6 and out.loc[0, "top_tokens"] == "7"
    assert np.isnan(out.loc[2, "top_share"]) and out.loc[2, "selections"] == 0
    # 6 of the 18 positions drawn at random: token 7 is a third of the stream
    assert out.loc[0, "baseline"] < 1.0


def test_coactivation_stats_against_analysis():
    rng = np.random.default_rng(5)
    E, K = 6, 3
    routes = [random_routes(rng, 2, int(T), K, E) for T in rng.integers(4, 20, 8)]
    df = rs.routes_frame(routes, n_experts=E)
    out = rs.coactivation_stats(df, n_boot=50)
    co = analysis.coactivation(routes, E)
    n = sum(r.shape[1] for r in routes)
    for layer in range(2):
        mine = out[out.layer == layer]
        assert mine.both.tolist() == co[layer][mine.i, mine.j].tolist()
        diag = np.diag(co[layer]) / n
        lift = co[layer][mine.i, mine.j] / n / (diag[mine.i] * diag[mine.j])
        assert mine.lift.to_numpy() == pytest.approx(lift)
    assert out.chance.eq(K * (K - 1) / (E * (E - 1))).all()
    # uniform routing: lift near E(K-1)/(K(E-1)) on average
    assert out.lift.mean() == pytest.approx(E * (K - 1) / (K * (E - 1)), abs=0.1)


def test_layer_ahead_stats():
    rng = np.random.default_rng(6)
    E, K = 8, 2

    def doc(T):
        first = random_routes(rng, 1, T, K, E)[0]
        return np.stack(
            [first, (first + 3) % E, rng.permuted(np.tile(np.arange(E), (T, 1)), axis=1)[:, :K]]
        )

    routes = [doc(int(T)) for T in rng.integers(20, 40, 12)]
    out = rs.layer_ahead_stats(rs.routes_frame(routes, n_experts=E), folds=3, n_boot=200)
    assert out.layer.tolist() == [0, 1] and out.next_layer.tolist() == [1, 2]
    assert out.recall[0] == 1.0 and out.recall_lo[0] == 1.0  # a function of the layer before
    assert out.recall_lo[1] < K / E < out.recall_hi[1]  # independent: chance
    assert out.chance.eq(K / E).all()
    # the per-document hits add up to analysis.layer_ahead's recall
    hits, _, guesses = rs.layer_hits(routes[:6], routes[6:], E)
    table = analysis.layer_ahead(routes[:6], routes[6:], E)
    assert (hits.sum(0) / guesses.sum()).tolist() == pytest.approx(table.recall.tolist())


def test_shares_of_a_frame_with_attrs_count_unchosen_experts():
    df = rs.routes_frame([np.zeros((1, 4, 1), int)] * 2, n_experts=16)
    out = rs.expert_shares(df, by="domain", n_boot=20)
    assert len(out) == 16 and out.share.sum() == pytest.approx(1.0)
    assert isinstance(out, pd.DataFrame) and out.domain.eq("all").all()
