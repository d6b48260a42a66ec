"""Statistics of routing traces with confidence intervals and finite-sample baselines.

Every function takes the tidy frame of `colibri.analysis.trace_corpus` (one row per doc,
position, MoE layer and rank; the columns each one needs are named in its docstring) and
returns a DataFrame with an estimate column and its percentile-bootstrap interval
(``<name>_lo``, ``<name>_hi`` at `level`). The bootstrap resamples documents, never tokens:
tokens of one document are not independent, and resampling them would give intervals far too
narrow. Grouping (`by`, e.g. "domain") resamples documents within each group.

Baselines say what a router that ignores its input would show at the same sample size: a
uniform top-k router over E experts fed the same number of tokens has a plug-in entropy below
log2(E) (`uniform_entropy_exact`, `simulate_uniform_entropy`), top token ids that take a share
of any expert's tokens by sample size and Zipf's law alone, pairs of experts chosen together
K(K-1)/(E(E-1)) of the time, and a next-layer guess right K/E of the time.

Pure numpy and pandas (no JAX): statistics of a saved trace need no model.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from functools import lru_cache
from statistics import NormalDist

import numpy as np
import pandas as pd

from colibri.analysis import expert_counts, transitions

# ---------------------------------------------------------------------------- frame access


def n_experts_of(df: pd.DataFrame, n_experts: int | None = None) -> int:
    """E: the argument, else ``df.attrs["n_experts"]`` (trace_corpus sets it), else the largest
    expert id seen + 1 (which misses experts never chosen at the top)."""
    if n_experts is not None:
        return int(n_experts)
    if "n_experts" in df.attrs:
        return int(df.attrs["n_experts"])
    return int(df["expert"].max()) + 1


def top_k_of(df: pd.DataFrame) -> int:
    return int(df.attrs.get("top_k", int(df["rank"].max()) + 1))


def _codes(df: pd.DataFrame) -> tuple[np.ndarray, pd.Index, np.ndarray, np.ndarray]:
    """(doc code per row, doc labels, layer index per row, the traced MoE layers)."""
    dc, docs = pd.factorize(df["doc"], sort=False)
    layers = np.sort(df["layer"].unique()).astype(np.int64)
    return dc, pd.Index(docs), np.searchsorted(layers, df["layer"].to_numpy()), layers


def routes_frame(
    routes,
    docs=None,
    domains=None,
    tokens=None,
    weights=None,
    n_experts: int | None = None,
) -> pd.DataFrame:
    """A frame in `trace_corpus`'s layout (without token_text, entropy, margin) from routes
    [L, T, K] of each document (e.g. `analysis.Trace.routes`): for statistics of traces taken
    otherwise, or of synthetic routes. docs: labels (default 0..n-1); domains: one per
    document (default "all"); tokens: token ids [T] per document (default -1); weights
    [L, T, K] per document (default NaN). ``attrs`` n_experts and top_k are set."""
    routes = [np.asarray(r) for r in routes]
    docs = list(range(len(routes))) if docs is None else list(docs)
    domains = ["all"] * len(routes) if domains is None else list(domains)
    parts = []
    for i, r in enumerate(routes):
        L, T, K = r.shape
        tok = np.full(T, -1) if tokens is None else np.asarray(tokens[i])
        w = np.full(r.shape, np.nan) if weights is None else np.asarray(weights[i])
        label = np.empty(T * L * K, object)
        label[:] = [docs[i]] * (T * L * K)
        parts.append(
            pd.DataFrame(
                {
                    "doc": label,
                    "domain": domains[i],
                    "position": np.repeat(np.arange(T), L * K),
                    "token": np.repeat(tok, L * K),
                    "layer": np.tile(np.repeat(np.arange(L), K), T),
                    "rank": np.tile(np.arange(K), T * L),
                    "expert": r.transpose(1, 0, 2).reshape(-1),
                    "weight": w.transpose(1, 0, 2).reshape(-1).astype(np.float32),
                }
            )
        )
    out = pd.concat(parts, ignore_index=True)
    K = routes[0].shape[2]
    E = int(out["expert"].max()) + 1 if n_experts is None else n_experts
    out.attrs.update(n_experts=E, top_k=K)
    return out


def doc_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per document: doc, domain (where the frame has one) and its tokens."""
    first = df[(df["rank"] == 0) & (df["layer"] == df["layer"].min())]
    cols = {"tokens": ("position", "size")}
    if "domain" in df:
        cols["domain"] = ("domain", "first")
    out = first.groupby("doc", sort=False, observed=True).agg(**cols).reset_index()
    return out[["doc", *(["domain"] if "domain" in df else []), "tokens"]]


def doc_counts(
    df: pd.DataFrame, n_experts: int | None = None
) -> tuple[pd.DataFrame, np.ndarray, np.ndarray]:
    """(doc_table, counts [D, L, E] selections per document, layer and expert, layers [L])."""
    E = n_experts_of(df, n_experts)
    dc, docs, lc, layers = _codes(df)
    L, D = len(layers), len(docs)
    flat = (dc * L + lc) * E + df["expert"].to_numpy()
    counts = np.bincount(flat, minlength=D * L * E).reshape(D, L, E)
    table = doc_table(df).set_index("doc").loc[docs].reset_index()
    return table, counts, layers


def doc_routes(df: pd.DataFrame) -> tuple[pd.DataFrame, list[np.ndarray], np.ndarray]:
    """(doc_table, routes [L, T, K] of each document as `analysis` takes them, layers [L])."""
    dc, docs, lc, layers = _codes(df)
    L, K = len(layers), top_k_of(df)
    order = np.lexsort((df["rank"].to_numpy(), lc, df["position"].to_numpy(), dc))
    experts = df["expert"].to_numpy()[order]
    bounds = np.searchsorted(dc[order], np.arange(len(docs) + 1))
    routes = []
    for d in range(len(docs)):
        block = experts[bounds[d] : bounds[d + 1]]
        if block.size % (L * K):
            raise ValueError(f"document {docs[d]!r} lacks rows: not every layer and rank")
        routes.append(block.reshape(-1, L, K).transpose(1, 0, 2))
    table = doc_table(df).set_index("doc").loc[docs].reset_index()
    return table, routes, layers


def _groups(table: pd.DataFrame, by: str | None) -> Iterator[tuple[object, np.ndarray]]:
    """(group label, indices of its documents in `table`), in order of first appearance."""
    if by is None:
        yield None, np.arange(len(table))
        return
    if by not in table:
        raise KeyError(f"the trace has no column {by!r}")
    codes, labels = pd.factorize(table[by], sort=False)
    for g, label in enumerate(labels):
        yield label, np.flatnonzero(codes == g)


def _with_group(frame: pd.DataFrame, by: str | None, label) -> pd.DataFrame:
    if by is not None:
        frame.insert(0, by, label)
    return frame


# ---------------------------------------------------------------------------- bootstrap


def resample_weights(n_docs: int, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """int [n_boot, n_docs]: how often each document is drawn in each bootstrap sample
    (n_docs draws with replacement)."""
    return rng.multinomial(n_docs, np.full(n_docs, 1.0 / n_docs), size=n_boot)


def percentile_ci(
    samples: np.ndarray, level: float, estimate: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Bootstrap interval at `level` from samples [n_boot, ...]: the percentile interval, or
    with `estimate` the bias-corrected one (Efron's BC: the percentiles move by how far the
    samples' median lies from the estimate, z0 = Phi^-1(share of samples below it), which
    keeps a biased statistic such as plug-in entropy or a top-k share from sitting outside
    its own interval). NaN samples (no documents) are ignored."""
    a = (1.0 - level) / 2.0
    samples = np.asarray(samples, float)
    if estimate is None:
        q_lo = np.full(samples.shape[1:], a)
        q_hi = np.full(samples.shape[1:], 1.0 - a)
    else:
        valid = ~np.isnan(samples)
        n = np.maximum(valid.sum(0), 1)
        below = ((samples < estimate) & valid).sum(0) + 0.5 * ((samples == estimate) & valid).sum(0)
        p0 = np.clip(below / n, 1.0 / (n + 1), n / (n + 1))
        z0 = _ppf(p0)
        q_lo, q_hi = _cdf(2 * z0 + _ppf(a)), _cdf(2 * z0 + _ppf(1.0 - a))
    flat = samples.reshape(samples.shape[0], -1)
    shape = samples.shape[1:]
    return (
        _quantiles(flat, np.ravel(q_lo)).reshape(shape),
        _quantiles(flat, np.ravel(q_hi)).reshape(shape),
    )


def _quantiles(flat: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Quantile q[i] of column i of flat [n, m], NaNs left out (numpy's linear method)."""
    ordered = np.sort(flat, axis=0)  # NaNs last
    n = (~np.isnan(flat)).sum(0)
    pos = q * np.maximum(n - 1, 0)
    below = np.floor(pos).astype(np.int64)
    above = np.minimum(below + 1, np.maximum(n - 1, 0))
    cols = np.arange(flat.shape[1])
    a, b = ordered[below, cols], ordered[above, cols]
    with np.errstate(invalid="ignore"):
        out = a + (pos - below) * (b - a)
    out[n == 0] = np.nan
    return out


_NORMAL = NormalDist()
_ppf = np.vectorize(_NORMAL.inv_cdf, otypes=[float])
_cdf = np.vectorize(_NORMAL.cdf, otypes=[float])


def bootstrap_ratio(
    num: np.ndarray,
    den: np.ndarray,
    n_boot: int = 1000,
    level: float = 0.95,
    rng: np.random.Generator | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(estimate, lo, hi) of sum(num) / sum(den) over documents: num [D, ...], den [D] or
    like num; the interval resamples documents. With fewer than two documents lo = hi = NaN."""
    num, den = np.asarray(num, float), np.asarray(den, float)
    D = num.shape[0]
    shape = num.shape[1:]
    den_b = den.reshape(D, *([1] * len(shape))) if den.ndim == 1 else den
    with np.errstate(invalid="ignore", divide="ignore"):
        est = num.sum(0) / den_b.sum(0)
    if D < 2:
        nan = np.full(np.broadcast_shapes(est.shape, shape), np.nan)
        return est, nan, nan
    rng = rng or np.random.default_rng(0)
    W = resample_weights(D, n_boot, rng).astype(float)
    top = W @ num.reshape(D, -1)
    bottom = W @ den_b.reshape(D, -1)
    with np.errstate(invalid="ignore", divide="ignore"):
        samples = (top / bottom).reshape(n_boot, *est.shape)
    lo, hi = percentile_ci(samples, level, est)
    return est, lo, hi


# ---------------------------------------------------------------------------- shares


def expert_shares(
    df: pd.DataFrame,
    by: str | None = "domain",
    n_boot: int = 1000,
    level: float = 0.95,
    seed: int = 0,
    n_experts: int | None = None,
) -> pd.DataFrame:
    """Share of each layer's selections that each expert takes, per group (columns: doc,
    layer, rank, expert, and `by`).

    Per (group, layer, expert): `share` = selections / (tokens x K) (summing to 1 over a
    layer's experts), `share_lo`, `share_hi`, `uniform` = 1/E (a balanced router), `selections`,
    `docs`, `tokens`.
    """
    E, K = n_experts_of(df, n_experts), top_k_of(df)
    table, counts, layers = doc_counts(df, E)
    rng = np.random.default_rng(seed)
    out = []
    for label, idx in _groups(table, by):
        tokens = table["tokens"].to_numpy()[idx]
        est, lo, hi = bootstrap_ratio(counts[idx], tokens * K, n_boot, level, rng)
        L = len(layers)
        frame = pd.DataFrame(
            {
                "layer": np.repeat(layers, E),
                "expert": np.tile(np.arange(E), L),
                "share": est.reshape(-1),
                "share_lo": lo.reshape(-1),
                "share_hi": hi.reshape(-1),
                "uniform": 1.0 / E,
                "selections": counts[idx].sum(0).reshape(-1),
                "docs": len(idx),
                "tokens": int(tokens.sum()),
            }
        )
        out.append(_with_group(frame, by, label))
    return pd.concat(out, ignore_index=True)


# ---------------------------------------------------------------------------- entropy


def plugin_entropy_bits(counts: np.ndarray) -> np.ndarray:
    """Shannon entropy (bits) of the frequencies counts / sum along the last axis."""
    c = np.asarray(counts, float)
    total = c.sum(-1, keepdims=True)
    p = np.divide(c, total, out=np.zeros_like(c), where=total > 0)
    logp = np.log2(np.where(p > 0, p, 1.0))
    return -(p * logp).sum(-1)


def uniform_entropy_limit(n_experts: int) -> float:
    """log2(E): the plug-in entropy of a uniform router's counts as tokens grow without bound."""
    return math.log2(n_experts)


def uniform_entropy_exact(n_tokens: int, n_experts: int, top_k: int) -> float:
    """Expected plug-in entropy (bits) of the selection counts of a uniform top-k router over E
    experts fed n tokens (each token picks K distinct experts uniformly at random).

    Each expert's count is Binomial(n, K/E) and the counts always total nK, so by linearity
    E[H] = -E * sum_c P(c) (c/nK) log2(c/nK) over that binomial: exact, no simulation. The
    sum runs over the binomial's mass within 40 standard deviations of its mean (the rest
    is below double precision), normalised."""
    n, E, K = int(n_tokens), int(n_experts), int(top_k)
    if not (n >= 0 and E >= 1 and 1 <= K <= E):
        raise ValueError(f"need n >= 0 and 1 <= K <= E, got n={n}, E={E}, K={K}")
    if n == 0:
        return 0.0
    if K == E:
        return math.log2(E)
    p = K / E
    mean, sd = n * p, math.sqrt(n * p * (1 - p))
    lo, hi = max(0, int(mean - 40 * sd) - 2), min(n, int(mean + 40 * sd) + 2)
    c = np.arange(lo, hi + 1, dtype=float)
    logpmf = (
        math.lgamma(n + 1)
        - np.array([math.lgamma(x + 1) + math.lgamma(n - x + 1) for x in c])
        + c * math.log(p)
        + (n - c) * math.log1p(-p)
    )
    pmf = np.exp(logpmf - logpmf.max())
    pmf /= pmf.sum()  # (lgamma of n ~ 1e6 carries absolute errors ~ 1e-9: normalised away)
    q = c / (n * K)
    term = np.where(q > 0, q * np.log2(np.where(q > 0, q, 1.0)), 0.0)
    return float(-E * np.sum(pmf * term))


def uniform_entropy_asymptotic(n_tokens: int, n_experts: int, top_k: int) -> float:
    """log2(E) - (E - K) / (2 n K ln 2): the second-order (Miller-Madow) expansion of
    `uniform_entropy_exact` for large n (K = 1: Miller-Madow's (E - 1) / 2n nats)."""
    E, K = n_experts, top_k
    return math.log2(E) - (E - K) / (2.0 * n_tokens * K * math.log(2))


def simulate_uniform_counts(
    n_tokens: int, n_experts: int, top_k: int, sims: int, rng: np.random.Generator
) -> np.ndarray:
    """int [sims, E]: selection counts of a uniform top-k router fed n tokens, `sims` times.

    Exact and O(E K) per simulation whatever n: experts are visited in turn, and each of the
    m_j tokens that still need j of the R experts left takes this one with probability j/R
    (a uniform j-subset of R contains a given expert with that probability, and the rest is
    then uniform), so the expert's count is sum_j Binomial(m_j, j/R)."""
    E, K = int(n_experts), int(top_k)
    need = np.zeros((sims, K + 1), np.int64)  # tokens still needing j experts
    need[:, K] = n_tokens
    j = np.arange(K + 1)
    counts = np.zeros((sims, E), np.int64)
    for e in range(E):
        R = E - e
        took = rng.binomial(need, np.minimum(j / R, 1.0))  # [sims, K + 1]; none need j > R
        counts[:, e] = took.sum(1)
        need -= took
        need[:, :-1] += took[:, 1:]
    return counts


@lru_cache(maxsize=256)
def simulate_uniform_entropy(
    n_tokens: int, n_experts: int, top_k: int, sims: int = 2000, seed: int = 0
) -> np.ndarray:
    """float [sims]: plug-in entropies (bits) of `sims` simulated uniform top-k routers fed
    n tokens (`simulate_uniform_counts`). Their mean estimates `uniform_entropy_exact`; their
    spread is how far a router that ignores its input strays at this sample size."""
    rng = np.random.default_rng(seed)
    out = plugin_entropy_bits(simulate_uniform_counts(n_tokens, n_experts, top_k, sims, rng))
    out.setflags(write=False)
    return out


def routing_entropy(
    df: pd.DataFrame,
    by: str | None = "domain",
    n_boot: int = 1000,
    level: float = 0.95,
    seed: int = 0,
    sims: int = 2000,
    n_experts: int | None = None,
) -> pd.DataFrame:
    """Entropy (bits) of each layer's pooled selection counts per group (the engine's
    ENTROPY over a corpus), against a uniform router at the same token count.

    Per (group, layer): `entropy_bits` with `entropy_bits_lo`/`_hi` (documents resampled);
    `uniform_bits`: mean plug-in entropy of `sims` simulated uniform top-k routers fed the
    group's tokens, `uniform_lo`/`_hi` the central `level` range of those simulations (an
    observed entropy below uniform_lo is lower than chance alone explains); `uniform_exact`
    its closed form (`uniform_entropy_exact`); `limit_bits` = log2(E), the large-n limit;
    `tokens`, `docs`. Needs doc, layer, rank, expert.
    """
    E, K = n_experts_of(df, n_experts), top_k_of(df)
    table, counts, layers = doc_counts(df, E)
    rng = np.random.default_rng(seed)
    a = (1.0 - level) / 2.0
    out = []
    for label, idx in _groups(table, by):
        c = counts[idx]  # [D, L, E]
        n = int(table["tokens"].to_numpy()[idx].sum())
        est = plugin_entropy_bits(c.sum(0))
        if len(idx) >= 2:
            W = resample_weights(len(idx), n_boot, rng).astype(float)
            boot = plugin_entropy_bits((W @ c.reshape(len(idx), -1)).reshape(n_boot, *c.shape[1:]))
            lo, hi = percentile_ci(boot, level, est)
        else:
            lo = hi = np.full(len(layers), np.nan)
        sim = simulate_uniform_entropy(n, E, K, sims, seed)
        frame = pd.DataFrame(
            {
                "layer": layers,
                "entropy_bits": est,
                "entropy_bits_lo": lo,
                "entropy_bits_hi": hi,
                "uniform_bits": sim.mean(),
                "uniform_lo": np.quantile(sim, a),
                "uniform_hi": np.quantile(sim, 1 - a),
                "uniform_exact": uniform_entropy_exact(n, E, K),
                "limit_bits": uniform_entropy_limit(E),
                "tokens": n,
                "docs": len(idx),
            }
        )
        out.append(_with_group(frame, by, label))
    return pd.concat(out, ignore_index=True)


def router_confidence(
    df: pd.DataFrame,
    by: str | None = "domain",
    n_boot: int = 1000,
    level: float = 0.95,
    seed: int = 0,
    n_experts: int | None = None,
) -> pd.DataFrame:
    """Mean per-token router entropy (bits, of its distribution over all experts) and
    top-1/top-2 margin per group and layer, with intervals (documents resampled);
    `max_bits` = log2(E), the entropy of a router that cannot tell experts apart. Needs doc,
    layer, rank, entropy, margin."""
    E = n_experts_of(df, n_experts)
    first = df[df["rank"] == 0]
    dc, docs, lc, layers = _codes(first)
    table = doc_table(df).set_index("doc").loc[docs].reset_index()
    D, L = len(docs), len(layers)
    n = np.bincount(dc * L + lc, minlength=D * L).reshape(D, L)
    sums = {
        k: np.bincount(dc * L + lc, first[k].to_numpy(float), minlength=D * L).reshape(D, L)
        for k in ("entropy", "margin")
    }
    rng = np.random.default_rng(seed)
    out = []
    for label, idx in _groups(table, by):
        h, h_lo, h_hi = bootstrap_ratio(sums["entropy"][idx], n[idx], n_boot, level, rng)
        m, m_lo, m_hi = bootstrap_ratio(sums["margin"][idx], n[idx], n_boot, level, rng)
        frame = pd.DataFrame(
            {
                "layer": layers,
                "entropy_bits": h,
                "entropy_bits_lo": h_lo,
                "entropy_bits_hi": h_hi,
                "margin": m,
                "margin_lo": m_lo,
                "margin_hi": m_hi,
                "max_bits": math.log2(E),
                "tokens": n[idx].sum(0),
                "docs": len(idx),
            }
        )
        out.append(_with_group(frame, by, label))
    return pd.concat(out, ignore_index=True)


# ---------------------------------------------------------------------------- token ids


def token_specialisation(
    df: pd.DataFrame,
    top: int = 10,
    layers=None,
    n_boot: int = 200,
    level: float = 0.95,
    seed: int = 0,
    sims: int = 20,
    n_experts: int | None = None,
) -> pd.DataFrame:
    """How concentrated each expert's tokens are on a few token ids (OLMoE's analysis).

    Per (layer, expert): `top_share` = the share of its selections whose token id is one of
    its `top` most frequent ids, `top_share_lo`/`_hi` (documents resampled; the top ids are
    chosen again in each sample); `baseline` = the same statistic for as many tokens drawn at
    random, without replacement, from the layer's token stream (a router that ignores token
    ids; mean of `sims` draws: sample size and Zipf's law alone give it); `selections`,
    `distinct` token ids, and `top_tokens` (its five most frequent, as text where the frame
    has token_text). `layers`: MoE layers to measure (all by default; each costs n_boot
    passes over its selections). Needs doc, position, layer, rank, expert, token.
    """
    E = n_experts_of(df, n_experts)
    rng = np.random.default_rng(seed)
    want = sorted(df["layer"].unique()) if layers is None else list(layers)
    texts = "token_text" in df
    out = []
    for layer in want:
        rows = df[df["layer"] == layer]
        if rows.empty:
            raise KeyError(f"MoE layer {layer} is not in the trace")
        dc, docs = pd.factorize(rows["doc"], sort=False)
        uc, toks = pd.factorize(rows["token"], sort=False)
        e = rows["expert"].to_numpy()
        U, D = len(toks), len(docs)
        # documents' (expert, token) counts as sparse entries
        keys, cnt = np.unique((dc.astype(np.int64) * E + e) * U + uc, return_counts=True)
        ent_doc, pair = keys // (E * U), keys % (E * U)
        pairs, ent_pair = np.unique(pair, return_inverse=True)
        pair_e = pairs // U

        w0 = np.bincount(ent_pair, cnt.astype(float), minlength=len(pairs))
        est = _top_shares(w0, pair_e, E, top)
        if D >= 2:
            W = resample_weights(D, n_boot, rng).astype(float)
            boot = np.stack(
                [
                    _top_shares(
                        np.bincount(ent_pair, cnt * W[b, ent_doc], len(pairs)), pair_e, E, top
                    )
                    for b in range(n_boot)
                ]
            )
            lo, hi = percentile_ci(boot, level, est)
        else:
            lo = hi = np.full(E, np.nan)
        selections = np.bincount(pair_e, w0, minlength=E).astype(np.int64)
        stream = uc[rows["rank"].to_numpy() == 0]  # one entry per token position
        baseline = np.array([_random_top_share(stream, m, top, sims, rng) for m in selections])
        distinct = np.bincount(pair_e, minlength=E)
        names = (
            rows.drop_duplicates("token").set_index("token")["token_text"].astype(str)
            if texts
            else None
        )
        leaders = []
        for x in range(E):
            mine = np.flatnonzero(pair_e == x)
            best = pairs[mine[np.argsort(-w0[mine], kind="stable")[:5]]] % U
            ids = [int(t) for t in toks[best]]
            leaders.append(", ".join(repr(names[t]) if texts else str(t) for t in ids))
        out.append(
            pd.DataFrame(
                {
                    "layer": layer,
                    "expert": np.arange(E),
                    "top_share": est,
                    "top_share_lo": lo,
                    "top_share_hi": hi,
                    "baseline": baseline,
                    "selections": selections,
                    "distinct": distinct,
                    "top_tokens": leaders,
                }
            )
        )
    return pd.concat(out, ignore_index=True)


def _top_shares(w: np.ndarray, pair_e: np.ndarray, E: int, top: int) -> np.ndarray:
    """[E] the share of each expert's weight on its `top` heaviest (expert, token) pairs, for
    pair weights w [P] and the pairs' experts pair_e [P]."""
    order = np.lexsort((-w, pair_e))
    se, sw = pair_e[order], w[order]
    start = np.searchsorted(se, np.arange(E))
    rank = np.arange(len(se)) - start[se]
    total = np.bincount(se, sw, minlength=E)
    best = np.bincount(se, np.where(rank < top, sw, 0.0), minlength=E)
    return np.divide(best, total, out=np.full(E, np.nan), where=total > 0)


def _random_top_share(
    stream: np.ndarray, m: int, top: int, sims: int, rng: np.random.Generator
) -> float:
    """Mean top-`top` share of m tokens drawn without replacement from `stream` (token codes)."""
    if m == 0:
        return float("nan")
    shares = []
    for _ in range(sims):
        got = np.bincount(rng.choice(stream, size=min(m, len(stream)), replace=False))
        best = np.sort(got)[::-1][:top]
        shares.append(best.sum() / got.sum())
    return float(np.mean(shares))


# ---------------------------------------------------------------------------- co-activation


def coactivation_stats(
    df: pd.DataFrame,
    layers=None,
    n_boot: int = 200,
    level: float = 0.95,
    seed: int = 0,
    n_experts: int | None = None,
) -> pd.DataFrame:
    """Pairs of experts chosen for the same token in the same layer.

    Per (layer, i < j): `both` tokens that chose both; `p_both` = both / tokens with
    `p_both_lo`/`_hi`; `lift` = p_both / (p_i p_j) (p_i: share of tokens choosing i; 1 when
    the two are chosen independently) with `lift_lo`/`_hi`; `chance` = K(K-1) / (E(E-1)),
    p_both of a uniform top-k router (whose lift is E(K-1) / (K(E-1)), below 1: it never
    picks one expert twice). Documents resampled. Needs doc, position, layer, rank, expert.
    """
    E, K = n_experts_of(df, n_experts), top_k_of(df)
    table, routes, all_layers = doc_routes(df)
    want = all_layers if layers is None else np.asarray(layers)
    rng = np.random.default_rng(seed)
    iu, ju = np.triu_indices(E, k=1)
    D = len(routes)
    tokens = np.array([r.shape[1] for r in routes], float)
    W = resample_weights(D, n_boot, rng).astype(float) if D >= 2 else None
    out = []
    for layer in want:
        li = int(np.searchsorted(all_layers, layer))
        if li >= len(all_layers) or all_layers[li] != layer:
            raise KeyError(f"MoE layer {layer} is not in the trace")
        keys, marg = [], np.zeros((D, E))
        for d, r in enumerate(routes):
            ids = np.sort(r[li], axis=1)  # [T, K]
            a, b = np.triu_indices(K, k=1)
            keys.append(d * E * E + ids[:, a] * E + ids[:, b])
            marg[d] = np.bincount(ids.reshape(-1), minlength=E)
        uk, cnt = np.unique(np.concatenate([k.reshape(-1) for k in keys]), return_counts=True)
        ent_doc, ent_pair = uk // (E * E), uk % (E * E)

        args = (ent_pair, ent_doc, cnt, marg, tokens, E)
        pb, lift = _pair_stats(np.ones(D), *args)
        if W is not None:
            boot = [_pair_stats(W[b], *args) for b in range(n_boot)]
            pb_lo, pb_hi = percentile_ci(np.stack([x[0] for x in boot]), level, pb)
            lift_lo, lift_hi = percentile_ci(np.stack([x[1] for x in boot]), level, lift)
        else:
            pb_lo = pb_hi = lift_lo = lift_hi = np.full(len(iu), np.nan)
        both = np.bincount(ent_pair, cnt, minlength=E * E).reshape(E, E)[iu, ju]
        out.append(
            pd.DataFrame(
                {
                    "layer": layer,
                    "i": iu,
                    "j": ju,
                    "both": both,
                    "p_both": pb,
                    "p_both_lo": pb_lo,
                    "p_both_hi": pb_hi,
                    "lift": lift,
                    "lift_lo": lift_lo,
                    "lift_hi": lift_hi,
                    "chance": K * (K - 1) / (E * (E - 1)),
                }
            )
        )
    return pd.concat(out, ignore_index=True)


def _pair_stats(wd, ent_pair, ent_doc, cnt, marg, tokens, E) -> tuple[np.ndarray, np.ndarray]:
    """(p_both, lift) of the upper-triangle pairs for document weights wd [D]: sparse entries
    (pair, document, count), per-document marginal counts marg [D, E] and tokens [D]."""
    iu, ju = np.triu_indices(E, k=1)
    both = np.bincount(ent_pair, cnt * wd[ent_doc], minlength=E * E).reshape(E, E)
    n = wd @ tokens
    p = (wd @ marg) / n
    with np.errstate(invalid="ignore", divide="ignore"):
        pb = both[iu, ju] / n
        return pb, pb / (p[iu] * p[ju])


# ---------------------------------------------------------------------------- layer ahead


def layer_hits(
    fit: list[np.ndarray], test: list[np.ndarray], n_experts: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per test route [L, T, K]: (hits [n, L-1], popular hits [n, L-1], guesses [n]) of
    `analysis.layer_ahead`'s predictor fitted on `fit` (its recall is hits.sum / guesses.sum)."""
    trans = transitions(fit, n_experts).astype(float)  # [L-1, E, E]
    popular = np.argsort(-expert_counts(fit, n_experts), axis=1, kind="stable")
    hits = np.zeros((len(test), trans.shape[0]))
    base = np.zeros_like(hits)
    guesses = np.zeros(len(test))
    for n, r in enumerate(test):
        K = r.shape[2]
        for layer in range(trans.shape[0]):
            score = trans[layer][r[layer]].sum(axis=1)  # [T, E]
            guess = np.argsort(-score, axis=1, kind="stable")[:, :K]
            truth = r[layer + 1]
            hits[n, layer] = (guess[:, :, None] == truth[:, None, :]).any(axis=2).sum()
            base[n, layer] = np.isin(truth, popular[layer + 1, :K]).sum()
        guesses[n] = r.shape[1] * K
    return hits, base, guesses


def layer_ahead_stats(
    df: pd.DataFrame,
    folds: int = 5,
    n_boot: int = 1000,
    level: float = 0.95,
    seed: int = 0,
    n_experts: int | None = None,
) -> pd.DataFrame:
    """How well each traced MoE layer's choices predict the next traced layer's
    (`analysis.layer_ahead`'s predictor), cross-fitted over documents: documents are split
    into `folds` and each is predicted by transitions counted on the other folds.

    Per layer pair: `recall` (share of the next layer's K experts found) with
    `recall_lo`/`_hi`, `popular` (guessing the next layer's K most frequent experts) with
    `popular_lo`/`_hi`, `chance` = K/E. Intervals resample the test documents (the fitted
    predictors held fixed). Needs doc, position, layer, rank, expert; at least 2 documents
    and 2 layers.
    """
    E = n_experts_of(df, n_experts)
    table, routes, layers = doc_routes(df)
    D = len(routes)
    if D < 2 or len(layers) < 2:
        raise ValueError("layer-ahead statistics need at least 2 documents and 2 MoE layers")
    rng = np.random.default_rng(seed)
    fold = rng.permutation(D) % min(folds, D)
    hits = np.zeros((D, len(layers) - 1))
    base = np.zeros_like(hits)
    guesses = np.zeros(D)
    for f in np.unique(fold):
        test = np.flatnonzero(fold == f)
        fit = [routes[d] for d in np.flatnonzero(fold != f)]
        h, b, g = layer_hits(fit, [routes[d] for d in test], E)
        hits[test], base[test], guesses[test] = h, b, g
    r, r_lo, r_hi = bootstrap_ratio(hits, guesses, n_boot, level, rng)
    p, p_lo, p_hi = bootstrap_ratio(base, guesses, n_boot, level, rng)
    K = routes[0].shape[2]
    return pd.DataFrame(
        {
            "layer": layers[:-1],
            "next_layer": layers[1:],
            "recall": r,
            "recall_lo": r_lo,
            "recall_hi": r_hi,
            "popular": p,
            "popular_lo": p_lo,
            "popular_hi": p_hi,
            "chance": K / E,
        }
    )
