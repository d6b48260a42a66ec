"""Routing statistics on hand-set routes, and the in-process tracer against the real engine."""

from __future__ import annotations

import numpy as np
import pytest

from colibri import analysis, client
from colibri.client import Engine


def routes_of(*layers: list[list[int]]) -> np.ndarray:
    """[L, T, K] from per-layer lists of per-token expert sets."""
    return np.asarray(layers, np.int64)


def test_counts_and_load_balance():
    uniform = routes_of([[0, 1], [2, 3]], [[0, 0], [0, 0]])  # layer 1: expert 0 only, twice
    counts = analysis.expert_counts(uniform, 4)
    assert counts.tolist() == [[1, 1, 1, 1], [4, 0, 0, 0]]
    lb = analysis.load_balance(counts)
    assert lb.entropy_bits.tolist() == pytest.approx([2.0, 0.0])
    assert lb.uniform_bits.tolist() == [2.0, 2.0]
    assert lb.max_over_mean.tolist() == pytest.approx([1.0, 4.0])
    assert lb.cv[0] == 0.0 and lb.unused.tolist() == [0, 3]
    two = analysis.expert_counts([uniform, uniform[:, :1]], 4)  # a list of traces adds up
    assert two.tolist() == [[2, 2, 1, 1], [6, 0, 0, 0]]


def test_entropy_matches_the_engine_formula():
    from colibri.engine.scheduler import entropy_bits

    counts = np.random.default_rng(0).integers(0, 20, (5, 16))
    counts[2] = 0
    assert analysis.entropy_bits(counts) == pytest.approx(entropy_bits(counts), abs=1e-9)


def test_coactivation():
    r = routes_of([[0, 1], [1, 0], [2, 3]])
    co = analysis.coactivation(r, 4)[0]
    assert co[0, 1] == co[1, 0] == 2 and co[2, 3] == 1 and co[0, 2] == 0
    assert np.diag(co).tolist() == [2, 2, 1, 1]
    p = analysis.conditional_coactivation(analysis.coactivation(r, 4))[0]
    assert p[0, 1] == 1.0 and p[2, 3] == 1.0 and p[0, 0] == 0.0 and p[0, 3] == 0.0


def test_consecutive_overlap():
    same = routes_of([[0, 1], [1, 0], [0, 1]])  # the same set every token
    moved = routes_of([[0, 1], [1, 2], [3, 4]])  # half kept, then none
    assert analysis.consecutive_overlap(same).tolist() == [1.0]
    assert analysis.consecutive_overlap(moved).tolist() == [0.25]
    # pairs never span two traces: [0,1] then [2,3] in another trace is not a transition
    assert analysis.consecutive_overlap([routes_of([[0, 1]] * 2), routes_of([[2, 3]] * 2)]) == [1.0]
    assert analysis.chance_overlap(4, 32) == 0.125


def test_layer_ahead_finds_a_deterministic_mapping():
    rng = np.random.default_rng(0)
    E, K, T = 8, 2, 200

    def make(n):
        first = np.stack([rng.choice(E, K, replace=False) for _ in range(n)])
        return np.stack([first, (first + 3) % E])  # layer 1 is a function of layer 0

    table = analysis.layer_ahead(make(T), make(T), E)
    assert table.recall.tolist() == [1.0] and table.chance.tolist() == [K / E]
    assert table.popular[0] < 0.5  # without looking at layer 0 it cannot do well


def test_layer_ahead_of_independent_layers_is_near_chance():
    rng = np.random.default_rng(1)
    E, K = 8, 2

    def make(n):
        return np.stack([[rng.choice(E, K, replace=False) for _ in range(n)] for _ in range(3)])

    table = analysis.layer_ahead(make(2000), make(2000), E)
    assert len(table) == 2
    assert np.allclose(table.recall, K / E, atol=0.05)


# ---------------------------------------------------------------------------- tracer


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("analysis") / "synth"
    return client.synthetic_model(
        out, layers=3, experts=8, top_k=2, hidden=64, moe_ff=32, vocab=300
    )


def test_tracer_routes_match_the_engine(model):
    """Same greedy turn in-process and through the engine: same text, same ENTROPY."""
    tracer = analysis.RouteTracer(model, capacity=128)
    prompt = "The quick brown fox"
    trace = tracer.trace(prompt, max_tokens=12)
    L, T, K = trace.routes.shape
    n_new = len(trace.tokens) - trace.n_prompt
    assert (L, K) == (3, 2) and T == trace.n_prompt + max(n_new - 1, 0)
    assert trace.routes.min() >= 0 and trace.routes.max() < 8
    assert all(len(set(row)) == K for row in trace.routes.reshape(-1, K))  # K distinct experts
    with Engine(model, ctx=128) as engine:
        turn = engine.generate(prompt, max_tokens=12, timeout=120)
    assert turn.text == trace.text and turn.done.emitted == n_new
    want = analysis.entropy_bits(analysis.expert_counts(trace.routes, 8))
    assert turn.entropy == pytest.approx(want, abs=1e-4)  # ENTROPY is printed with 4 places
    again = tracer.trace(prompt, max_tokens=12)  # nothing carries over between traces
    assert again.text == trace.text and np.array_equal(again.routes, trace.routes)
