"""The corpus tracer: gate weights, router entropy and margin against transformers' own router on
tiny checkpoints, batched documents against each document alone, the traced program against
the engine's, and the token view."""

from __future__ import annotations

import html
import re

import numpy as np
import pandas as pd
import pytest
import tiny

from colibri import analysis
from colibri.engine.runner import Runner

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "Der schnelle braune Fuchs springt über den faulen Hund. 🐦 naïve café",
    "x",
    "The quick brown fox jumps over the lazy dog. " * 10,  # over one prefill chunk (256)
    'int main(void) { printf("hello\\n"); return 0; }',
    "Le renard brun rapide saute par-dessus le chien paresseux.",
]


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def traced(request, checkpoints):
    """(checkpoint, tracer with 4 slots, its frame of the first two texts)."""
    d = checkpoints(request.param)
    tracer = analysis.RouteTracer(d, capacity=512, slots=4)
    df = analysis.trace_corpus(TEXTS[:2], tracer, progress=False)
    return d, tracer, df


def hf_router(model_dir, moe_layer_ids, ids):
    """transformers' router outputs per MoE layer on `ids`: (logits [T, E], weights [T, K],
    experts [T, K]) from forward hooks on each MoE block's gate."""
    import torch

    hf = tiny.hf_model(model_dir)
    seen, hooks = {}, []
    for i in moe_layer_ids:
        gate = hf.model.layers[i].mlp.gate

        def keep(module, args, out, i=i):
            seen[i] = [t.detach().float().numpy() for t in out]

        hooks.append(gate.register_forward_hook(keep))
    with torch.no_grad():
        hf(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return [seen[i] for i in moe_layer_ids]


def rows_of(df: pd.DataFrame, doc) -> pd.DataFrame:
    return df[df["doc"] == doc].sort_values(["position", "layer", "rank"])


def test_frame_matches_transformers_router(traced):
    """Per token and MoE layer: the experts, their gate weights (by descending weight), and
    the entropy and margin of the router's distribution, as transformers' router gives them
    on the same prompt."""
    d, tracer, df = traced
    assert list(df.columns) == list(analysis.CORPUS_COLUMNS)
    L, K, E = tracer.n_layers, tracer.top_k, tracer.n_experts
    assert df.attrs["n_experts"] == E and df.attrs["top_k"] == K
    tok = tracer.model.tokenizer
    for doc, text in enumerate(TEXTS[:2]):
        ids = tok.encode(text)
        mine = rows_of(df, doc)
        assert len(mine) == len(ids) * L * K
        first = mine[(mine["layer"] == 0) & (mine["rank"] == 0)]
        assert first["token"].tolist() == ids and first["position"].tolist() == list(
            range(len(ids))
        )
        assert "".join(first["token_text"].astype(str)) == text  # UTF-8 completed per token
        got_ids = mine["expert"].to_numpy().reshape(len(ids), L, K)
        got_w = mine["weight"].to_numpy().reshape(len(ids), L, K)
        got_h = mine["entropy"].to_numpy().reshape(len(ids), L, K)
        got_m = mine["margin"].to_numpy().reshape(len(ids), L, K)
        assert (got_h == got_h[..., :1]).all() and (got_m == got_m[..., :1]).all()
        for layer, (logits, wts, experts) in enumerate(hf_router(d, tracer.cfg.moe_layer_ids, ids)):
            order = np.argsort(-wts, axis=1, kind="stable")
            want_ids = np.take_along_axis(experts, order, axis=1)
            want_w = np.take_along_axis(wts, order, axis=1)
            assert np.array_equal(got_ids[:, layer], want_ids), (doc, layer)
            np.testing.assert_allclose(got_w[:, layer], want_w, atol=2e-5, rtol=0)
            if tracer.cfg.moe.router == "softmax":
                p = np.exp(logits - logits.max(1, keepdims=True))
            else:  # sigmoid scores, normalised (the docstring's distribution)
                p = 1 / (1 + np.exp(-logits))
            p /= p.sum(1, keepdims=True)
            h = -(p * np.log2(p)).sum(1)
            top2 = np.sort(p, axis=1)[:, ::-1][:, :2]
            np.testing.assert_allclose(got_h[:, layer, 0], h, atol=2e-5, rtol=0)
            np.testing.assert_allclose(got_m[:, layer, 0], top2[:, 0] - top2[:, 1], atol=2e-5)
        if tracer.cfg.moe.norm_topk_prob:
            scale = (
                tracer.cfg.moe.routed_scaling_factor if tracer.cfg.moe.router != "softmax" else 1
            )
            np.testing.assert_allclose(got_w.sum(2), scale, rtol=1e-5)


def test_batched_corpus_equals_each_document_alone(traced):
    """Six documents over four slots (two batched forwards of rows of unequal length, one
    document over two prefill chunks) trace as each does alone in slot 0."""
    d, tracer, _ = traced
    if d.name.startswith("deepseek"):
        pytest.skip("one family is enough for batching (and compiles take time)")
    frame = pd.DataFrame(
        {"text": TEXTS, "doc": [f"t{i}" for i in range(6)], "domain": list("aabbcc")}
    )
    together = analysis.trace_corpus(frame, tracer, progress=False)
    assert together["doc"].unique().tolist() == [f"t{i}" for i in range(6)]  # input order
    assert together.groupby("doc", sort=False)["domain"].first().tolist() == list("aabbcc")
    assert rows_of(together, "t3")["position"].max() >= 256
    for i, text in enumerate(TEXTS):
        alone = analysis.trace_corpus([text], tracer, progress=False)
        mine, ref = rows_of(together, f"t{i}"), rows_of(alone, 0)
        for col in ("position", "token", "layer", "rank", "expert"):
            assert mine[col].tolist() == ref[col].tolist(), (i, col)
        for col in ("weight", "entropy", "margin"):
            np.testing.assert_allclose(mine[col], ref[col], atol=1e-5, rtol=0)
        if i < 2:  # the Trace of a prompt alone is the same as its frame
            trace = tracer.trace(text, max_tokens=0)
            L, T, K = trace.routes.shape
            assert np.array_equal(trace.routes.transpose(1, 0, 2).reshape(-1), ref["expert"])
            np.testing.assert_allclose(trace.weights.transpose(1, 0, 2).reshape(-1), ref["weight"])


def test_traced_program_agrees_with_the_engine(traced):
    """prefill_traced gives the logits and experts `prefill` gives, counts only real tokens in
    the usage statistics, and a tiered (layer by layer) runner traces the same."""
    d, tracer, _ = traced
    model = tracer.model
    tok = model.tokenizer
    feeds = [tok.encode(t) for t in TEXTS[:3]]
    runner = Runner(model, slots=4, capacity=64)
    plain = [runner.prefill(s, ids) for s, ids in enumerate(feeds)]
    usage = runner.stats.counts
    usage[:] = 0
    logits, routings = runner.prefill_traced([(s, ids, 0) for s, ids in enumerate(feeds)])
    E = tracer.n_experts
    assert usage.tolist() == analysis.expert_counts([r.ids for r in routings], E).tolist()
    for (want_logits, want_ids), got_logits, r in zip(plain, logits, routings, strict=True):
        np.testing.assert_allclose(got_logits, want_logits, atol=1e-4, rtol=0)
        assert np.array_equal(r.ids, want_ids)
        assert r.weights.dtype == np.float32 and r.weights.shape == r.ids.shape
        assert r.entropy.shape == r.margin.shape == r.ids.shape[:2]
        assert (r.entropy > 0).all() and (r.entropy <= np.log2(E) + 1e-5).all()
        assert ((r.margin >= 0) & (r.margin <= 1)).all()
    tiered, probe = tiny.load_placed(d, tiered=True)
    split = Runner(tiered, slots=4, capacity=64)
    assert split.split
    s_logits, s_routings = split.prefill_traced([(s, ids, 0) for s, ids in enumerate(feeds)])
    np.testing.assert_allclose(s_logits, logits, atol=1e-4, rtol=0)
    for a, b in zip(s_routings, routings, strict=True):
        assert np.array_equal(a.ids, b.ids)
        for x, y in zip(a[1:], b[1:], strict=True):
            np.testing.assert_allclose(x, y, atol=1e-5, rtol=0)
    tiered.store.close()
    probe.store.close()


def test_generated_trace_has_gate_probabilities(traced):
    _, tracer, _ = traced
    trace = tracer.trace("The quick brown fox", max_tokens=6)
    L, T, K = trace.routes.shape
    assert trace.weights.shape == (L, T, K) and trace.entropy.shape == trace.margin.shape == (L, T)
    assert (np.diff(trace.weights, axis=2) <= 0).all()  # by descending weight
    n_new = len(trace.tokens) - trace.n_prompt
    assert T == trace.n_prompt + max(n_new - 1, 0)


def test_frame_options(traced):
    _, tracer, _ = traced
    df = analysis.trace_corpus(["ab", "", "abc"], tracer, layers=[1], progress=False)
    assert df["layer"].unique().tolist() == [1]
    assert sorted(df["doc"].unique()) == [0, 2]  # the empty text gives no rows
    with pytest.raises(ValueError, match="unique"):
        analysis.trace_corpus(pd.DataFrame({"text": ["a", "b"], "doc": [1, 1]}), tracer)
    with pytest.raises(ValueError, match="layers"):
        analysis.trace_corpus(["a"], tracer, layers=[9], progress=False)
    with pytest.warns(UserWarning, match="1 documents cut to the context of 512"):
        long = analysis.trace_corpus([TEXTS[3] * 2], tracer, layers=[0], progress=False)
    assert long["position"].max() == 511


def test_token_view(traced):
    _, tracer, df = traced
    page = analysis.token_view_html(df, 1, layer=0)
    spans = re.findall(
        r'<span style="background:(#[0-9A-F]{6});[^"]*" title="[^"]*">(.*?)</span>', page
    )
    text = "".join(html.unescape(s) for _, s in spans)
    assert text == TEXTS[1]
    top1 = rows_of(df, 1).query("layer == 0 and rank == 0")["expert"].tolist()
    assert [c for c, _ in spans] == [analysis.expert_style(e)[0] for e in top1]
    for e in set(top1):
        assert f"expert {e}</span>" in page  # the legend
    assert set(analysis.PALETTE) >= {c for c, _ in spans}
    every = analysis.token_view_html(df, 1, layer=None)
    assert every.count("(top-1 expert)") == tracer.n_layers
    with pytest.raises(KeyError):
        analysis.token_view_html(df, "nope")
    fig = analysis.token_view_figure(df, 1, layer=None)
    shown = (rows_of(df, 1).query("rank == 0")["token_text"].astype(str) != "").sum()
    assert len(fig.axes[0].patches) >= shown  # a box per token with text, and the legend's
    import matplotlib.pyplot as plt

    plt.close(fig)
