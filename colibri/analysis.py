"""Per-token routing analysis: trace expert choices and gate probabilities in-process, then
measure load balance, co-activation, consecutive-token overlap and one-layer-ahead
predictability; show text coloured by the expert that took each token.

The wire protocol reports routing per turn (ENTROPY) and per window (HITS), not per token, so
`RouteTracer` runs the model in this process through the same `Runner` the engine uses, in a
traced program of its own (`Runner.prefill_traced`), and keeps of every token it feeds the
experts chosen, their gate weights, and the entropy and top-1/top-2 margin of the router's
distribution. `trace_corpus` traces many documents at once, batched over the KV slots, into a
tidy DataFrame; `colibri.routing_stats` computes statistics with confidence intervals and
finite-sample baselines from it. The statistics here are pure functions of routes
``[L, T, K]`` (MoE layers, tokens, chosen experts), or of a list of them (one per trace, so
nothing pairs tokens across traces).
"""

from __future__ import annotations

import codecs
import html
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

Routes = np.ndarray | Sequence[np.ndarray]  # [L, T, K] or several with the same L and K


@dataclass(frozen=True)
class Trace:
    """One greedy (or sampled) turn with the routing of every token fed to the model.

    Per MoE layer and token: `routes` the K chosen experts, by descending gate weight;
    `weights` their gate weights (float32, the weights that mix the experts' outputs:
    renormalised to sum 1 where the model does so, times DeepSeek's routed_scaling_factor);
    `entropy` (bits) and `margin` (top-1 minus top-2 probability) of the router's distribution
    over all E experts: softmax(logits) for softmax routers, the sigmoid scores normalised to
    sum 1 (without the selection bias) for sigmoid routers (DeepSeek-V3, GLM-4.5).
    """

    prompt: str
    text: str  # the generated text
    tokens: tuple[int, ...]  # prompt then generated tokens
    n_prompt: int
    routes: np.ndarray  # [L, T, K]: T = prompt + generated tokens fed back (all but the last)
    weights: np.ndarray  # [L, T, K] float32
    entropy: np.ndarray  # [L, T] float32, bits
    margin: np.ndarray  # [L, T] float32


def _by_weight(routing) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(ids, weights, entropy, margin) of a host `Routing` [n_moe, T, ...], each token's K
    experts in descending gate weight (sigmoid routers choose by a biased score instead)."""
    order = np.argsort(-routing.weights, axis=2, kind="stable")
    ids = np.take_along_axis(np.asarray(routing.ids), order, axis=2)
    wts = np.take_along_axis(np.asarray(routing.weights, np.float32), order, axis=2)
    return ids, wts, np.asarray(routing.entropy, np.float32), np.asarray(routing.margin, np.float32)


class RouteTracer:
    """A checkpoint loaded in this process, recording routing token by token (in KV slot 0
    for `trace`; `trace_corpus` uses every slot).

    `slots` and `capacity` only shape the KV cache: matching an engine's KV_SLOTS and CTX lets
    both share compiled programs through the persistent compilation cache.
    """

    def __init__(self, model_dir: str | Path, capacity: int = 512, slots: int = 1, tiers=None):
        from colibri.engine.model import load_model
        from colibri.engine.runner import Runner

        self.model = load_model(model_dir, tiers, progress=False)
        self.runner = Runner(self.model, slots=slots, capacity=capacity)
        self.cfg = self.model.cfg

    @property
    def n_layers(self) -> int:
        return len(self.cfg.moe_layer_ids)

    @property
    def n_experts(self) -> int:
        return self.cfg.moe.num_experts

    @property
    def top_k(self) -> int:
        return self.cfg.moe.top_k

    def trace(
        self, prompt: str, max_tokens: int = 32, temperature: float = 0.0, seed: int = 0
    ) -> Trace:
        """Generate from slot 0 (from position 0: nothing carries over between traces)."""
        from colibri.engine.sampling import sample

        tok = self.model.tokenizer
        if tok is None:
            raise ValueError(f"{self.model.dir}: no tokenizer.json")
        ids = tok.encode(prompt)
        n = min(max_tokens, self.runner.capacity - len(ids))
        logits, (r,) = self.runner.prefill_traced([(0, ids, 0)])
        logits, parts, out = logits[0], [r], []
        rng = np.random.default_rng(seed)
        stop = set(self.cfg.eos_token_ids)
        while len(out) < n:
            t = sample(logits, temperature, 1.0, rng)
            if t in stop:
                break
            out.append(t)
            if len(out) == n:
                break
            step_logits, (r,) = self.runner.prefill_traced([(0, [t], len(ids) + len(out) - 1)])
            logits = step_logits[0]
            parts.append(r)
        text = b"".join(tok.token_bytes(t) for t in out).decode("utf-8", errors="replace")
        routing = type(r)(*(np.concatenate(a, axis=1) for a in zip(*parts, strict=True)))
        return Trace(prompt, text, (*ids, *out), len(ids), *_by_weight(routing))


# ---------------------------------------------------------------------------- corpus tracing

CORPUS_COLUMNS = (
    "doc",
    "domain",
    "position",
    "token",
    "token_text",
    "layer",
    "rank",
    "expert",
    "weight",
    "entropy",
    "margin",
)


def trace_corpus(
    texts,
    model,
    *,
    slots: int = 8,
    capacity: int = 512,
    tiers=None,
    layers: Sequence[int] | None = None,
    progress: bool = True,
) -> pd.DataFrame:
    """Trace the prompts of many documents (teacher forcing over each text, no generation),
    `slots` documents at a time as the rows of one batched forward through the engine's
    `Runner` (`Runner.prefill_traced`), and return a tidy DataFrame.

    texts: a list of str, or a DataFrame with a column `text` and optionally `doc` (unique
    labels; by default the row's index) and `domain` (by default "all"). model: a checkpoint
    folder (loaded here with `slots`, `capacity`, `tiers`) or a `RouteTracer` (its slots and
    context are used). Each text is tokenized without special tokens and cut to the context
    (a warning says how many were); empty ones give no rows. `layers`: MoE layers to keep
    (all by default; the frame has tokens x layers x K rows).

    One row per (doc, position, layer, rank), in that order: `position` the token's index in
    its document, `token` its id, `token_text` the text it adds (UTF-8 completed: a token that
    ends a character split over several tokens carries it; categorical), `layer` the MoE layer
    (0 .. n_moe - 1; the model's layer numbers are in ``df.attrs["moe_layer_ids"]``), `rank`
    0 .. K-1 by descending gate weight, `expert`, `weight` the gate weight (float32; as
    `Trace.weights`). The router's `entropy` (bits) and `margin` belong to (doc, position,
    layer) and are repeated on its K rows: ``df[df["rank"] == 0]`` has one row per token and
    layer. ``df.attrs`` holds n_experts, top_k, moe_layer_ids and model. A tqdm bar counts
    documents (`progress`).
    """
    from tqdm.auto import tqdm

    tracer = (
        model
        if isinstance(model, RouteTracer)
        else RouteTracer(model, capacity=capacity, slots=slots, tiers=tiers)
    )
    tok = tracer.model.tokenizer
    if tok is None:
        raise ValueError(f"{tracer.model.dir}: no tokenizer.json")
    docs, domains, texts = _corpus_inputs(texts)
    cap = tracer.runner.capacity
    encoded = [tok.encode(t) for t in texts]
    cut = sum(len(e) > cap for e in encoded)
    if cut:
        warnings.warn(f"{cut} documents cut to the context of {cap} tokens", stacklevel=2)
    encoded = [e[:cap] for e in encoded]
    keep = np.arange(tracer.n_layers) if layers is None else np.asarray(sorted(set(layers)))
    if keep.size and (keep.min() < 0 or keep.max() >= tracer.n_layers):
        raise ValueError(f"layers must lie in 0..{tracer.n_layers - 1}")
    order = sorted(range(len(texts)), key=lambda i: -len(encoded[i]))  # like lengths together
    S = tracer.runner.slots
    routed: list = [None] * len(texts)
    with tqdm(total=len(texts), desc="documents", unit="doc", disable=not progress) as bar:
        for g in range(0, len(order), S):
            group = [i for i in order[g : g + S] if encoded[i]]
            if group:
                feeds = [(s, encoded[i], 0) for s, i in enumerate(group)]
                _, routings = tracer.runner.prefill_traced(feeds)
                for i, r in zip(group, routings, strict=True):
                    routed[i] = _by_weight(r)
            bar.update(len(order[g : g + S]))
    frame = _tidy(docs, domains, encoded, routed, keep, tracer.top_k, tok)
    frame.attrs.update(
        n_experts=tracer.n_experts,
        top_k=tracer.top_k,
        moe_layer_ids=list(tracer.cfg.moe_layer_ids),
        model=str(tracer.model.dir),
    )
    return frame


def _corpus_inputs(texts) -> tuple[list, list[str], list[str]]:
    """(doc labels, domains, texts) from a list of str, a Series or a DataFrame."""
    if isinstance(texts, pd.DataFrame):
        if "text" not in texts:
            raise ValueError("a corpus DataFrame needs a column `text`")
        body = [str(t) for t in texts["text"]]
        docs = list(texts["doc"]) if "doc" in texts else list(texts.index)
        domains = [str(d) for d in texts["domain"]] if "domain" in texts else ["all"] * len(body)
    else:
        series = texts if isinstance(texts, pd.Series) else pd.Series(list(texts), dtype=object)
        if not all(isinstance(t, str) for t in series):
            raise TypeError("texts must be str (or a DataFrame with a column `text`)")
        body, docs, domains = list(series), list(series.index), ["all"] * len(series)
    if len(set(docs)) != len(docs):
        raise ValueError("document labels (`doc`) must be unique")
    return docs, domains, body


def token_texts(tok, ids: Sequence[int]) -> list[str]:
    """The text each token adds to the decoded string: a character split over several tokens
    belongs to the token that completes it (the earlier ones add "")."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out = [dec.decode(tok.token_bytes(t)) for t in ids]
    if out:
        out[-1] += dec.decode(b"", final=True)
    return out


def _tidy(docs, domains, encoded, routed, keep, K, tok) -> pd.DataFrame:
    """The trace_corpus frame: one row per (doc, position, layer, rank) of traced documents."""
    L = len(keep)
    parts: dict[str, list] = {c: [] for c in CORPUS_COLUMNS}
    for d, dom, toks, r in zip(docs, domains, encoded, routed, strict=True):
        if r is None:
            continue
        T = len(toks)
        n = T * L * K
        label = np.empty(n, object)
        label[:] = [d] * n
        parts["doc"].append(label)
        parts["domain"].append(np.full(n, dom, object))
        parts["position"].append(np.repeat(np.arange(T, dtype=np.int32), L * K))
        parts["token"].append(np.repeat(np.asarray(toks, np.int32), L * K))
        parts["token_text"].append(np.repeat(np.asarray(token_texts(tok, toks), object), L * K))
        parts["layer"].append(np.tile(np.repeat(keep.astype(np.int16), K), T))
        parts["rank"].append(np.tile(np.arange(K, dtype=np.int8), T * L))
        ids, wts, ent, margin = r  # [n_moe, T, K], [n_moe, T, K], [n_moe, T], [n_moe, T]
        parts["expert"].append(ids[keep].transpose(1, 0, 2).reshape(-1).astype(np.int32))
        parts["weight"].append(wts[keep].transpose(1, 0, 2).reshape(-1))
        parts["entropy"].append(np.repeat(ent[keep].T.reshape(-1), K))
        parts["margin"].append(np.repeat(margin[keep].T.reshape(-1), K))
    dtypes = dict(
        doc=object, domain=object, position=np.int32, token=np.int32, token_text=object,
        layer=np.int16, rank=np.int8, expert=np.int32, weight=np.float32, entropy=np.float32,
        margin=np.float32,
    )  # fmt: skip
    cols = {
        c: np.concatenate(p).astype(dtypes[c]) if p else np.zeros(0, dtypes[c])
        for c, p in parts.items()
    }
    for c in ("domain", "token_text"):
        cols[c] = pd.Categorical(cols[c])
    return pd.DataFrame(cols, columns=list(CORPUS_COLUMNS))


# ---------------------------------------------------------------------------- token view

# Paul Tol's "light" scheme (colour-blind safe, black text readable on every colour), cycled
# over experts; each further cycle of experts is told apart by its mark (an underline style in
# HTML, a hatch in the figure) and, everywhere, by the legend and tooltips.
PALETTE = ("#77AADD", "#EE8866", "#EEDD88", "#FFAABB", "#99DDFF", "#44BB99", "#BBCC33", "#AAAA00")
_UNDERLINES = ("none", "underline solid", "underline dashed", "underline dotted", "underline wavy")
_HATCHES = ("", "///", "...", "xxx", "---")


def expert_style(expert: int, palette: Sequence[str] = PALETTE) -> tuple[str, int]:
    """(colour, cycle) of an expert: palette[e % n], and e // n (its mark) modulo the marks."""
    return palette[expert % len(palette)], (expert // len(palette)) % len(_UNDERLINES)


def _view_rows(df: pd.DataFrame, doc, layer) -> tuple[pd.DataFrame, list[int]]:
    """The rows of `doc` at the chosen layers, and those layers."""
    rows = df[df["doc"] == doc]
    if rows.empty:
        raise KeyError(f"no document {doc!r} in the trace")
    have = sorted(int(x) for x in rows["layer"].unique())
    if layer is None:
        shown = have
    else:
        shown = [int(x) for x in (layer if isinstance(layer, Sequence) else [layer])]
    missing = sorted(set(shown) - set(have))
    if missing:
        raise KeyError(f"MoE layers {missing} are not in the trace (it has {have})")
    rows = rows[rows["layer"].isin(shown)]
    return rows.sort_values(["layer", "position", "rank"], kind="stable"), shown


def _tooltip(tok_rows: pd.DataFrame) -> str:
    first = tok_rows.iloc[0]
    chosen = ", ".join(
        f"{int(e)} ({w:.2f})" for e, w in zip(tok_rows.expert, tok_rows.weight, strict=True)
    )
    return (
        f"position {int(first.position)} · token {int(first.token)} {str(first.token_text)!r}\n"
        f"MoE layer {int(first.layer)}: experts {chosen}\n"
        f"router entropy {first.entropy:.2f} bits · margin {first.margin:.2f}"
    )


def token_view_html(
    df: pd.DataFrame,
    doc,
    layer: int | Sequence[int] | None = 0,
    *,
    rank: int = 0,
    palette: Sequence[str] = PALETTE,
) -> str:
    """A static HTML view of document `doc` of a `trace_corpus` frame: its text with each token
    coloured by the expert of rank `rank` (0: the top-1 expert, largest gate weight) at MoE
    layer `layer`; a list of layers or None (every traced layer) gives one block per layer,
    the layer-wise top-1 expert. Tooltips give each token's experts, weights, router entropy
    and margin; a legend lists the experts shown. Colours: `PALETTE`, cycled over experts."""
    rows, shown = _view_rows(df, doc, layer)
    used: set[int] = set()
    blocks = []
    for lay in shown:
        here = rows[rows["layer"] == lay]
        spans = []
        for _, tok_rows in here.groupby("position", sort=True):
            pick = tok_rows[tok_rows["rank"] == rank]
            if pick.empty:
                raise ValueError(f"rank {rank} is not in the trace")
            e = int(pick.expert.iloc[0])
            used.add(e)
            colour, cycle = expert_style(e, palette)
            spans.append(
                f'<span style="background:{colour};text-decoration:{_UNDERLINES[cycle]};'
                f'border-radius:2px" title="{html.escape(_tooltip(tok_rows))}">'
                f"{html.escape(str(pick.token_text.iloc[0]))}</span>"
            )
        blocks.append(
            f'<div style="margin:0.3em 0 0.1em;color:#555">MoE layer {lay}'
            f"{' (top-1 expert)' if rank == 0 else f' (expert of rank {rank})'}</div>"
            f'<div style="white-space:pre-wrap;line-height:1.8">{"".join(spans)}</div>'
        )
    legend = []
    for e in sorted(used):
        colour, cycle = expert_style(e, palette)
        legend.append(
            f'<span style="background:{colour};text-decoration:{_UNDERLINES[cycle]};'
            f'padding:0 0.4em;margin-right:0.3em;border-radius:2px">expert {e}</span>'
        )
    return (
        '<div class="colibri-token-view" style="font-family:ui-monospace,monospace;'
        f'font-size:13px;color:#000"><div><b>document {html.escape(str(doc))}</b></div>'
        f"{''.join(blocks)}"
        f'<div style="margin-top:0.6em;line-height:1.9">{"".join(legend)}</div></div>'
    )


def token_view_figure(
    df: pd.DataFrame,
    doc,
    layer: int | Sequence[int] | None = 0,
    *,
    rank: int = 0,
    width: float = 9.0,
    fontsize: float = 10.0,
    palette: Sequence[str] = PALETTE,
):
    """`token_view_html` as a matplotlib figure (monospace text `width` inches wide, wrapped;
    experts of later palette cycles hatched; a legend of the experts shown below)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    rows, shown = _view_rows(df, doc, layer)
    cw, lh, pad = 0.6 * fontsize, 1.7 * fontsize, 0.5 * fontsize  # points (monospace advance)
    right = width * 72 - pad
    boxes, labels, used = [], [], set()  # (x, y, w, text, expert); (x, y, text)
    x, y = pad, pad

    def newline():
        nonlocal x, y
        x, y = pad, y + lh

    def put(text: str, e: int | None):
        nonlocal x
        w = max(len(text), 1) * cw
        if x + w > right and x > pad:
            newline()
        boxes.append((x, y, w, text, e))
        x += w

    for lay in shown:
        labels.append((pad, y, f"MoE layer {lay}" + (" (top-1 expert)" if rank == 0 else "")))
        newline()
        for _, tok_rows in rows[rows["layer"] == lay].groupby("position", sort=True):
            pick = tok_rows[tok_rows["rank"] == rank]
            e = int(pick.expert.iloc[0])
            used.add(e)
            pieces = str(pick.token_text.iloc[0]).replace("\t", "    ").split("\n")
            for j, piece in enumerate(pieces):
                if j:
                    put("↵", e)
                    newline()
                if piece:
                    put(piece, e)
        newline()
        y += 0.4 * lh
    labels.append((pad, y, "experts"))
    newline()
    for e in sorted(used):
        put(f" {e} ", e)
        x += cw
    newline()
    height = y + pad
    fig = plt.figure(figsize=(width, height / 72))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width * 72)
    ax.set_ylim(height, 0)
    ax.axis("off")
    for bx, by, w, text, e in boxes:
        colour, cycle = expert_style(e, palette)
        ax.add_patch(
            Rectangle(
                (bx + 0.5, by + 0.1 * lh),
                w - 1.0,  # a 1 pt gap shows where tokens of one expert meet
                0.8 * lh,
                facecolor=colour,
                edgecolor="#666666",
                linewidth=0,
                hatch=_HATCHES[cycle],
            )
        )
        ax.text(
            bx,
            by + 0.5 * lh,
            text,
            fontsize=fontsize,
            family="monospace",
            va="center",
            ha="left",
            parse_math=False,
        )
    for lx, ly, text in labels:
        ax.text(lx, ly + 0.5 * lh, text, fontsize=fontsize * 0.9, color="#555555", va="center")
    return fig


# ---------------------------------------------------------------------------- statistics


def _parts(routes: Routes) -> list[np.ndarray]:
    return (
        [np.asarray(routes)] if isinstance(routes, np.ndarray) else [np.asarray(r) for r in routes]
    )


def expert_counts(routes: Routes, n_experts: int) -> np.ndarray:
    """int [L, E]: how many tokens chose each expert, per MoE layer."""
    parts = _parts(routes)
    counts = np.zeros((parts[0].shape[0], n_experts), np.int64)
    for r in parts:
        for layer, ids in enumerate(r):
            counts[layer] += np.bincount(ids.reshape(-1), minlength=n_experts)[:n_experts]
    return counts


def entropy_bits(counts: np.ndarray) -> np.ndarray:
    """float [L]: Shannon entropy of each layer's selection counts (the engine's ENTROPY)."""
    c = np.asarray(counts, float)
    p = c / np.maximum(c.sum(axis=1, keepdims=True), 1)
    return -np.sum(np.where(p > 0, p * np.log2(np.where(p > 0, p, 1)), 0.0), axis=1)


def load_balance(counts: np.ndarray) -> pd.DataFrame:
    """Per layer: entropy (bits, log2 E when uniform), max/mean load, coefficient of variation,
    and the number of experts never chosen."""
    c = np.asarray(counts, float)
    mean = c.mean(axis=1)
    safe = np.where(mean > 0, mean, 1)
    return pd.DataFrame(
        {
            "layer": np.arange(len(c)),
            "entropy_bits": entropy_bits(c),
            "uniform_bits": np.log2(c.shape[1]),
            "max_over_mean": np.where(mean > 0, c.max(axis=1) / safe, np.nan),
            "cv": np.where(mean > 0, c.std(axis=1) / safe, np.nan),
            "unused": (c == 0).sum(axis=1),
        }
    )


def coactivation(routes: Routes, n_experts: int) -> np.ndarray:
    """int [L, E, E]: tokens that chose both i and j in the same layer (diagonal: chose i)."""
    parts = _parts(routes)
    out = np.zeros((parts[0].shape[0], n_experts, n_experts), np.int64)
    for r in parts:
        onehot = np.zeros((*r.shape[:2], n_experts), np.int64)  # [L, T, E]
        np.put_along_axis(onehot, r, 1, axis=2)
        out += np.einsum("lti,ltj->lij", onehot, onehot)
    return out


def conditional_coactivation(co: np.ndarray) -> np.ndarray:
    """float [L, E, E]: P(j chosen | i chosen) in the same token and layer (row i; diagonal 0)."""
    diag = np.diagonal(co, axis1=1, axis2=2)[..., None].astype(float)  # [L, E, 1]
    p = np.divide(co, diag, out=np.zeros(co.shape, float), where=diag > 0)
    idx = np.arange(co.shape[1])
    p[:, idx, idx] = 0.0
    return p


def consecutive_overlap(routes: Routes) -> np.ndarray:
    """float [L]: mean share of token t's experts that token t+1 chose again, per layer.

    Two independent uniform choices of K of E experts share K/E on average (`chance_overlap`).
    """
    shared, pairs = None, 0
    parts = _parts(routes)
    k = parts[0].shape[2]
    for r in parts:
        if r.shape[1] < 2:
            continue
        a, b = r[:, :-1, :, None], r[:, 1:, None, :]  # [L, T-1, K, 1], [L, T-1, 1, K]
        same = (a == b).any(axis=3).sum(axis=2)  # [L, T-1] experts of t kept at t+1
        s = same.sum(axis=1)
        shared = s if shared is None else shared + s
        pairs += r.shape[1] - 1
    if shared is None:
        raise ValueError("consecutive overlap needs a trace of at least two tokens")
    return shared / (pairs * k)


def chance_overlap(top_k: int, n_experts: int) -> float:
    """Expected share of K experts found again among another uniform random K of E."""
    return top_k / n_experts


def transitions(routes: Routes, n_experts: int) -> np.ndarray:
    """int [L-1, E, E]: tokens that chose i at layer l and j at layer l+1."""
    parts = _parts(routes)
    out = np.zeros((parts[0].shape[0] - 1, n_experts, n_experts), np.int64)
    for r in parts:
        onehot = np.zeros((*r.shape[:2], n_experts), np.int64)
        np.put_along_axis(onehot, r, 1, axis=2)
        out += np.einsum("lti,ltj->lij", onehot[:-1], onehot[1:])
    return out


def layer_ahead(fit: Routes, test: Routes, n_experts: int) -> pd.DataFrame:
    """How well layer l's choices predict layer l+1's, per layer pair (l -> l+1).

    The predictor learns transition counts on `fit`; for each token of `test` it guesses the K
    experts of layer l+1 with the most transitions from the K chosen at layer l. `recall` is the
    share of the true K it finds; `popular` guesses layer l+1's K most frequent experts in `fit`
    for every token (no look at layer l); `chance` is K/E. Fit and test on different prompts.
    """
    trans = transitions(fit, n_experts).astype(float)  # [L-1, E, E]
    popular = np.argsort(-expert_counts(fit, n_experts), axis=1, kind="stable")  # [L, E]
    hit = np.zeros(trans.shape[0])
    base = np.zeros(trans.shape[0])
    total = 0
    parts = _parts(test)
    K = parts[0].shape[2]
    for r in parts:
        T = r.shape[1]
        for layer in range(trans.shape[0]):
            score = trans[layer][r[layer]].sum(axis=1)  # [T, E]: transitions from l's choices
            guess = np.argsort(-score, axis=1, kind="stable")[:, :K]  # [T, K]
            truth = r[layer + 1]  # [T, K]
            hit[layer] += (guess[:, :, None] == truth[:, None, :]).any(axis=2).sum()
            base[layer] += np.isin(truth, popular[layer + 1, :K]).sum()
        total += T * K
    if total == 0:
        raise ValueError("no test tokens")
    return pd.DataFrame(
        {
            "layer": np.arange(trans.shape[0]),
            "next_layer": np.arange(1, trans.shape[0] + 1),
            "recall": hit / total,
            "popular": base / total,
            "chance": chance_overlap(K, n_experts),
        }
    )
