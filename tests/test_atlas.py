"""The expert atlas: statistics on hand-made counts, the committed data/experts.json (schema and
invariants), and byte-identical regeneration (colibri.bench.atlas_files, which
experiments/atlas.py runs) on the demo model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from colibri import atlas
from colibri.bench.atlas_files import TOPICS, regenerate

REPO = Path(__file__).resolve().parent.parent
PROBES = REPO / "data" / "atlas" / "probes.json"
DEMO = REPO / "data" / "models" / "demo"
needs_demo = pytest.mark.skipif(
    not (DEMO / "config.json").exists() or not (DEMO / "tokenizer.json").exists(),
    reason="the demo model is not there",
)


def check_invariants(a: dict) -> None:
    """Schema and invariants every atlas holds (any model, any probes)."""
    assert a["version"] == atlas.SCHEMA_VERSION
    for key in ("schema", "model", "probes", "method", "categories", "lopo", "summary"):
        assert key in a, key
    cats, L, E = a["categories"], a["layers"], a["experts_per_layer"]
    C, K = len(cats), a["model"]["top_k"]
    ids, tokens = a["probes"]["ids"], a["probes"]["tokens"]
    assert len(ids) == len(tokens) == C and sum(map(len, ids)) == a["probes"]["count"]
    experts = a["experts"]
    assert [(x["layer"], x["expert"]) for x in experts] == [
        (l, e) for l in range(L) for e in range(E)
    ]
    for x in experts:
        assert set(x) >= {
            "layer",
            "expert",
            "total",
            "counts",
            "affinity",
            "spec",
            "top",
            "lift",
            "reliability",
            "replicated",
            "position",
        }
        assert [len(c) for c in x["counts"]] == [len(i) for i in ids]
        assert all(n >= 0 for c in x["counts"] for n in c)
        assert x["total"] == sum(sum(c) for c in x["counts"])
        p = np.asarray(x["affinity"])
        assert p.shape == (C,) and (p >= 0).all() and abs(p.sum() - 1) <= 1e-5  # 6 decimals x C
        # p(topic | expert) is the expert's selections per token of each topic, normalised
        rate = np.array([sum(c) / n for c, n in zip(x["counts"], tokens, strict=True)])
        if rate.sum() > 0:
            assert p == pytest.approx(rate / rate.sum(), abs=1e-6)
            spec = float(atlas.specialisation(rate / rate.sum()))
            assert x["spec"] == pytest.approx(spec, abs=1e-5)
        assert 0 <= x["spec"] <= 1
        assert x["top"] in cats and p[cats.index(x["top"])] == p.max()
        assert x["lift"] == pytest.approx(p.max() * C, abs=1e-5)
        assert 0 <= x["reliability"] <= 1
        assert len(x["position"]) == 3 and all(math.isfinite(v) for v in x["position"])
    # every token chooses K experts in every layer: per layer, counts add up to K x tokens
    for layer in range(L):
        per_topic = [
            sum(sum(x["counts"][c]) for x in experts[layer * E : (layer + 1) * E]) for c in range(C)
        ]
        assert per_topic == [K * n for n in tokens]
    lo = a["lopo"]
    conf = np.asarray(lo["confusion"])
    assert conf.shape == (C, C) and conf.sum() == lo["total"] == a["probes"]["count"]
    assert conf.sum(axis=1).tolist() == [len(i) for i in ids]
    assert np.trace(conf) == lo["correct"] and lo["accuracy"] == round(
        lo["correct"] / lo["total"], 6
    )
    assert lo["chance"] == round(1 / C, 6)
    s = a["summary"]
    assert s["replicated_specialists"] == sum(s["replicated_specialists_per_category"])
    assert s["replicated_specialists"] == sum(
        x["replicated"] and x["spec"] >= a["method"]["specialist_spec"] for x in experts
    )


# ------------------------------------------------------------------- hand-made statistics


def test_topic_rates_divide_by_each_topics_tokens():
    counts = np.array([[[4, 0]], [[8, 0]], [[0, 3]]])  # [P=3, L=1, E=2]
    tokens = np.array([2, 4, 3])  # topic 0 has two probes (6 tokens), topic 1 one (3)
    rates = atlas.topic_rates(counts, tokens, np.array([0, 0, 1]), 2)
    assert rates.shape == (1, 2, 2)
    assert rates[0].tolist() == [[2.0, 0.0], [0.0, 1.0]]  # [E, C]
    with pytest.raises(ValueError, match="topics without tokens"):
        atlas.topic_rates(counts, tokens, np.array([0, 0, 0]), 2)


def test_distribution_specialisation_lift():
    rates = np.array([[1.0, 1.0, 1.0, 1.0], [2.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0, 0], [0, 0, 0, 0]])
    p = atlas.topic_distribution(rates)
    assert p.sum(axis=1) == pytest.approx(np.ones(4))
    assert p[3].tolist() == [0.25] * 4  # never chosen: uniform, says nothing
    spec = atlas.specialisation(p)
    assert spec == pytest.approx([0.0, 1.0, 1 - math.log(2) / math.log(4), 0.0])
    assert atlas.lift(p) == pytest.approx([1.0, 4.0, 2.0, 1.0])


def test_fires_and_reliability():
    # one layer, two experts, topics [0, 0, 1, 1]; expert 0 is topic 0's, expert 1 uniform
    counts = np.array([[[10, 5]], [[0, 5]], [[1, 5]], [[1, 5]]])
    tokens = np.full(4, 10)
    topic_of = np.array([0, 0, 1, 1])
    rates = atlas.topic_rates(counts, tokens, topic_of, 2)
    fired = atlas.fires(counts, tokens, rates)
    # expert 0: mean rate (0.5 + 0.1) / 2 = 0.3, fires at >= 0.6: only in probe 0
    assert fired[:, 0, 0].tolist() == [True, False, False, False]
    assert not fired[:, 0, 1].any()  # used alike everywhere: never twice its mean
    top = atlas.topic_distribution(rates).argmax(axis=-1)
    rel, n = atlas.reliability(fired, topic_of, top)
    assert rel[0].tolist() == [0.5, 0.0] and n[0].tolist() == [1, 0]


def test_lopo_and_confusion():
    rng = np.random.default_rng(0)
    base = rng.random(12) + 5  # what every probe shares, far bigger than the topic signal
    signal = np.eye(3, 12) * 0.5
    topic_of = np.repeat(np.arange(3), 3)
    vectors = base + signal[topic_of] + rng.normal(0, 0.02, (9, 12))
    guess = atlas.lopo_predict(vectors, topic_of, 3)
    assert guess.tolist() == topic_of.tolist()
    m = atlas.confusion(topic_of, np.array([0, 0, 1, 1, 1, 1, 2, 2, 0]), 3)
    assert m.tolist() == [[2, 1, 0], [0, 3, 0], [1, 0, 2]]


def test_usage_vectors_are_per_token_and_layer_major():
    counts = np.arange(8).reshape(2, 2, 2)  # [P, L, E]
    v = atlas.usage_vectors(counts, np.array([1, 2]))
    assert v.tolist() == [[0, 1, 2, 3], [2, 2.5, 3, 3.5]]


def test_joint_coactivation_counts_pairs_across_layers():
    r = np.array([[[0, 1], [1, 2]], [[0, 2], [0, 1]]])  # [L=2, T=2, K=2], E=3
    co = atlas.joint_coactivation([r, r[:, :1]], 3)
    assert co.shape == (6, 6)
    assert np.diag(co).tolist() == [2, 3, 1, 3, 1, 2]  # tokens that chose each (l, e)
    assert co[0, 3] == 2  # (0, 0) with (1, 0): token 0 of both traces
    assert co[1, 2] == 1 and co[2, 3] == 1 and co[2, 5] == 0 and (co == co.T).all()


def test_spectral_positions_separate_two_clusters():
    w = np.random.default_rng(0).uniform(1, 5, (8, 8))  # uneven, so no eigenvalue repeats
    w[:4, 4:] = 0.0
    w[3, 4] = 0.1  # a weak bridge
    w = (w + w.T) / 2
    pos = atlas.spectral_positions(w)
    assert pos.shape == (8, 3) and np.isfinite(pos).all()
    assert np.sign(pos[:4, 0]).tolist() != np.sign(pos[4:, 0]).tolist()
    assert len(set(np.sign(pos[:4, 0]))) == 1 and len(set(np.sign(pos[4:, 0]))) == 1
    i = np.argmax(np.abs(pos), axis=0)
    assert (pos[i, np.arange(3)] > 0).all()  # sign convention
    assert np.sqrt((pos**2).mean(axis=0)) == pytest.approx(np.ones(3))
    assert np.allclose(atlas.spectral_positions(w[::-1, ::-1])[::-1], pos)  # order-free


def test_select_probes(tmp_path):
    text = "\n\n".join(f"doc {i} " + "é" * 150 + "\nline two\n" + "x" * 200 for i in range(6))
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "heldout.txt").write_text(text + "\n")
    probes = atlas.select_probes(tmp_path, ["a"], 3)
    assert [p.id for p in probes] == ["a/0", "a/1", "a/2"]
    assert len({p.offset for p in probes}) == 3
    for p in probes:
        assert p.text.startswith("doc ") and 200 <= len(p.text.encode()) <= 400
        assert atlas.check_probe(p, tmp_path)
    atlas.save_probes(tmp_path / "p.json", probes, {"k": 1})
    assert atlas.load_probes(tmp_path / "p.json") == (probes, {"k": 1})
    assert atlas.topics_of(probes) == ["a"]


def test_dumps_is_stable_json():
    a = {"b": [1.5, -0.0 + 0.0, "x"], "a": [{"z": 1, "y": [[1, 2]]}], "c": {}}
    text = atlas.dumps(a)
    assert json.loads(text) == a and text.endswith("\n")
    assert text.index('"a"') < text.index('"b"') and '"y": [[1, 2]]' in text
    assert atlas._r(-1e-9) == 0.0 and str(atlas._r(-1e-9)) == "0.0"


def synthetic_atlas(rng: np.random.Generator) -> tuple[dict, np.ndarray]:
    """An atlas from random routes: 3 topics x 2 probes, 2 layers x 5 experts, top-2."""
    L, E, K = 2, 5, 2
    probes, routes = [], []
    for t in range(3):
        prefer = np.array([t, t + 1, 4])  # topic t's usual experts

        def pick(prefer=prefer):
            return rng.choice(prefer if rng.random() < 0.7 else np.arange(E), K, replace=False)

        for i in range(2):
            probes.append(atlas.Probe(f"t{t}/{i}", f"t{t}", "x", 0, "..."))
            T = int(rng.integers(5, 12))
            routes.append(np.array([[pick() for _ in range(T)] for _ in range(L)]))  # [L, T, K]
    from colibri.analysis import expert_counts

    m = atlas.Measurement(
        np.stack([expert_counts(r, E) for r in routes]),
        np.array([r.shape[1] for r in routes]),
        atlas.joint_coactivation(routes, E),
    )
    info = {"model": {"top_k": K}, "probes": {"path": "x"}, "measurement": {"decode_tokens": 0}}
    return atlas.build_atlas(m, probes, info, null_rounds=5), m.tokens


def test_build_atlas_on_random_routes():
    a, tokens = synthetic_atlas(np.random.default_rng(1))
    check_invariants(a)
    assert a["probes"]["tokens"] == tokens.reshape(3, 2).sum(axis=1).tolist()
    assert a["categories"] == ["t0", "t1", "t2"] and a["lopo"]["total"] == 6
    assert atlas.dumps(a) == atlas.dumps(synthetic_atlas(np.random.default_rng(1))[0])


# ----------------------------------------------------------------- the committed atlas


@pytest.fixture(scope="module")
def committed() -> dict:
    return atlas.load_atlas()


def test_committed_atlas_invariants(committed):
    check_invariants(committed)
    assert len(committed["categories"]) >= 8
    assert all(len(i) >= 3 for i in committed["probes"]["ids"])
    assert committed["model"]["path"] == "data/models/demo"
    assert committed["probes"]["sha256"] == atlas.file_sha256(PROBES)


def test_committed_atlas_shows_topics(committed):
    """The issue's bar: LOPO topic accuracy well above chance (>= 80%), replicated specialists,
    far more than shuffled topic labels produce."""
    assert committed["lopo"]["accuracy"] >= 0.8
    s = committed["summary"]
    assert s["replicated_specialists"] >= 5
    assert s["replicated_specialists"] > 10 * s["replicated_specialists_shuffled"]


def test_committed_probes():
    probes, meta = atlas.load_probes(PROBES)
    ids = [p.id for p in probes]
    assert len(set(ids)) == len(ids) and len(atlas.topics_of(probes)) >= 8
    for p in probes:
        assert 200 <= len(p.text.encode()) <= 400 and p.source == f"{p.topic}/heldout.txt"
    corpus = REPO / meta["corpus"]
    if all((corpus / p.source).exists() for p in probes):
        assert all(atlas.check_probe(p, corpus) for p in probes)


@needs_demo
def test_committed_atlas_is_of_the_demo_model(committed):
    assert committed["model"]["sha256"] == atlas.model_hash(DEMO)


# -------------------------------------------------------------------------- regeneration


@needs_demo
def test_regeneration_is_byte_identical(tmp_path, monkeypatch):
    """Two runs on 2 topics x 2 probes write the same bytes."""
    probes, meta = atlas.load_probes(PROBES)
    few = [p for p in probes if p.topic in ("c", "german") and p.id[-1] in "01"]
    atlas.save_probes(tmp_path / "probes.json", few, meta)
    monkeypatch.chdir(REPO)
    kept = dict(probes=str(tmp_path / "probes.json"), keep_probes=True, progress=False)
    regenerate(out=str(tmp_path / "a.json"), **kept)
    regenerate(out=str(tmp_path / "b.json"), **kept)
    a = (tmp_path / "a.json").read_bytes()
    assert a == (tmp_path / "b.json").read_bytes()
    small = json.loads(a)
    check_invariants(small)
    assert small["categories"] == ["c", "german"] and small["probes"]["count"] == 4


@pytest.mark.slow
@needs_demo
def test_full_regeneration_matches_the_committed_files(tmp_path, monkeypatch):
    """`python experiments/atlas.py` reproduces data/atlas/probes.json (when the corpus is
    there) and data/experts.json byte for byte."""
    monkeypatch.chdir(REPO)
    out = str(tmp_path / "experts.json")
    have_corpus = all((REPO / "data/corpus" / t / "heldout.txt").exists() for t in TOPICS)
    if have_corpus:
        probes = tmp_path / "probes.json"
        regenerate(probes=str(probes), out=out, progress=False)
        assert probes.read_bytes() == PROBES.read_bytes()
        # the atlas records the probe file's path: regenerate against the committed one
    regenerate(out=out, keep_probes=True, progress=False)
    assert Path(out).read_bytes() == atlas.ATLAS.read_bytes()
