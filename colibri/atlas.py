"""The expert atlas: which topics each routed expert serves, measured on probe prompts, and where
it sits in a 3-D map of co-activation.

Three parts, used by `experiments/atlas.py` (which writes `data/experts.json`) and by the
notebook that draws it:

- probes: short held-out snippets per topic, chosen deterministically from the corpus;
- measurement: each probe's per-token routes from the in-process `RouteTracer` (the engine's own
  `Runner`), reduced to selection counts ``[P, L, E]`` and a co-activation graph;
- statistics: pure functions of those counts (topic distributions, specialisation, lift,
  replication, a leave-one-probe-out topic classifier, a spectral layout).

Shapes: P probes, L MoE layers, E experts per layer, N = L * E experts in all, C topics
(categories).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from colibri.analysis import RouteTracer

ATLAS = Path(__file__).resolve().parent.parent / "data" / "experts.json"  # the committed atlas
SCHEMA_VERSION = 1
FIRE_RATIO = 2.0  # an expert fires in a probe used at >= 2x its own mean per-token rate
MIN_REPLICAS = 2  # a specialisation counts as replicated if it fires in >= 2 top-topic probes
SPECIALIST_SPEC = 0.25  # a specialist is as peaked as uniform over 6 of 11 topics, or more
DECIMALS = 6  # floats in experts.json: fixed rounding, so reruns write the same bytes


# ------------------------------------------------------------------------------- probes


@dataclass(frozen=True)
class Probe:
    """One probe prompt: `text` is bytes [offset, offset + len(text.encode())) of `source`."""

    id: str  # "<topic>/<index>"
    topic: str
    source: str  # the held-out file, relative to the corpus folder ("python/heldout.txt")
    offset: int  # byte offset of the text in `source`
    text: str


def _cut(data: bytes, start: int, min_bytes: int, max_bytes: int) -> int:
    """End of a snippet from `start`: the last line end in [min, max] bytes, else the last
    space, else the last UTF-8 character boundary within `max_bytes`."""
    lo, hi = start + min_bytes, min(start + max_bytes, len(data))
    for sep in (b"\n", b" "):
        i = data.rfind(sep, lo, hi + 1)
        if i >= 0:
            return i
    end = hi
    while end > start and end < len(data) and data[end] & 0xC0 == 0x80:  # a continuation byte
        end -= 1
    return end


def select_probes(
    corpus: str | Path,
    topics: Sequence[str],
    per_topic: int,
    min_bytes: int = 200,
    max_bytes: int = 400,
) -> list[Probe]:
    """`per_topic` snippets of each topic's `heldout.txt`, spread evenly over the file.

    Snippet i starts at the first paragraph (blank-line) boundary after (i + 1/2) / n of the
    file (the last one before it if none is left), so the snippets lie ~1/n of the held-out
    text apart (different documents wherever the file holds that many); it ends at a line end
    between `min_bytes` and `max_bytes`.
    """
    probes = []
    for topic in topics:
        rel = f"{topic}/heldout.txt"
        data = (Path(corpus) / rel).read_bytes()
        for i in range(per_topic):
            target = len(data) * (2 * i + 1) // (2 * per_topic)
            at = data.find(b"\n\n", max(target - 1, 0))
            if at < 0 or len(data) - at < min_bytes:  # none left after: take the one before
                at = data.rfind(b"\n\n", 0, target)
            start = at + 2 if at >= 0 else 0
            while data[start : start + 1] == b"\n":
                start += 1
            end = _cut(data, start, min_bytes, max_bytes)
            text = data[start:end].decode("utf-8")
            probes.append(Probe(f"{topic}/{i}", topic, rel, start, text))
    return probes


def check_probe(probe: Probe, corpus: str | Path) -> bool:
    """Whether the probe's text is still found at its offset in the corpus file."""
    data = (Path(corpus) / probe.source).read_bytes()
    raw = probe.text.encode("utf-8")
    return data[probe.offset : probe.offset + len(raw)] == raw


def save_probes(path: str | Path, probes: Sequence[Probe], meta: dict) -> None:
    """`{"meta": ..., "probes": [...]}`, keys sorted, one probe per block (diff-friendly)."""
    doc = {"meta": meta, "probes": [asdict(p) for p in probes]}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False) + "\n")


def load_probes(path: str | Path) -> tuple[list[Probe], dict]:
    doc = json.loads(Path(path).read_text())
    return [Probe(**p) for p in doc["probes"]], doc["meta"]


def topics_of(probes: Sequence[Probe]) -> list[str]:
    """Topics in first-seen order."""
    return list(dict.fromkeys(p.topic for p in probes))


# -------------------------------------------------------------------------- measurement


@dataclass(frozen=True)
class Measurement:
    """Selection counts of every probe, measured alone, and co-activation over all of them."""

    counts: np.ndarray  # int [P, L, E]: tokens of probe p that chose expert e in MoE layer l
    tokens: np.ndarray  # int [P]: tokens fed per probe
    coactivation: np.ndarray  # int [N, N]: tokens that chose both experts (any two layers)


def joint_coactivation(routes: Iterable[np.ndarray], n_experts: int) -> np.ndarray:
    """int [N, N]: tokens whose routes hold both experts, across and within layers (N = L * E;
    expert (l, e) is node l * E + e; the diagonal counts tokens that chose the expert)."""
    out = None
    for r in routes:  # [L, T, K]
        L, T, _ = r.shape
        onehot = np.zeros((T, L, n_experts), np.int64)
        np.put_along_axis(onehot, r.transpose(1, 0, 2), 1, axis=2)
        x = onehot.reshape(T, L * n_experts)  # [T, N]
        out = x.T @ x if out is None else out + x.T @ x
    if out is None:
        raise ValueError("no routes")
    return out


def measure(
    tracer: RouteTracer, probes: Sequence[Probe], decode: int = 0, progress: bool = False
) -> Measurement:
    """Run every probe alone from position 0 of an in-process model (`analysis.RouteTracer`).

    The runner's usage counters are zeroed before each probe and must equal the counts taken
    from its routes after it: each probe's counts are that probe's alone, as an engine with a
    fresh usage history would report them. `decode` greedy tokens follow the prefill (0: the
    prompt only, so the counts depend on the probe text and nothing the model writes).
    """
    from tqdm import tqdm

    from colibri.analysis import expert_counts

    E = tracer.n_experts
    usage = tracer.runner.stats.counts  # [L, E] the engine's cumulative selection counts
    counts, tokens, routes = [], [], []
    for probe in tqdm(probes, desc="probes", unit="probe", disable=not progress):
        usage[:] = 0
        trace = tracer.trace(probe.text, max_tokens=decode, temperature=0.0)
        c = expert_counts(trace.routes, E)
        if not np.array_equal(c, usage):
            raise RuntimeError(f"{probe.id}: routes and the engine's usage counters disagree")
        counts.append(c)
        tokens.append(trace.routes.shape[1])
        routes.append(trace.routes)
    return Measurement(np.stack(counts), np.asarray(tokens), joint_coactivation(routes, E))


# --------------------------------------------------------------------------- statistics


def topic_rates(
    counts: np.ndarray, tokens: np.ndarray, topic_of: np.ndarray, n_topics: int
) -> np.ndarray:
    """float [L, E, C]: selections per token of each topic (its probes' counts over their tokens).

    Dividing by the topic's tokens keeps a topic with longer (or more) probes from weighing more.
    """
    L, E = counts.shape[1:]
    sums = np.zeros((n_topics, L, E))
    toks = np.zeros(n_topics)
    np.add.at(sums, topic_of, counts)
    np.add.at(toks, topic_of, tokens)
    if (toks == 0).any():
        raise ValueError(f"topics without tokens: {np.flatnonzero(toks == 0).tolist()}")
    return (sums / toks[:, None, None]).transpose(1, 2, 0)


def topic_distribution(rates: np.ndarray) -> np.ndarray:
    """float [..., C]: p(topic | expert), each expert's rates normalised to sum 1 (an expert no
    probe chose gets the uniform distribution: it says nothing about any topic)."""
    total = rates.sum(axis=-1, keepdims=True)
    uniform = np.full(rates.shape, 1.0 / rates.shape[-1])
    return np.divide(rates, total, out=uniform, where=total > 0)


def specialisation(p: np.ndarray) -> np.ndarray:
    """float [...]: 1 - H(p) / log C; 0 for a uniform distribution, 1 for a single topic."""
    logs = np.log(np.where(p > 0, p, 1.0))
    h = -(p * logs).sum(axis=-1)
    return np.clip(1.0 - h / math.log(p.shape[-1]), 0.0, 1.0)


def lift(p: np.ndarray) -> np.ndarray:
    """float [...]: p(top topic) over the uniform base rate 1 / C (1 for a uniform expert).

    The base rate is uniform because the rates are per token: an expert chosen equally often in
    every topic's tokens has p = 1 / C everywhere.
    """
    return p.max(axis=-1) * p.shape[-1]


def fires(counts: np.ndarray, tokens: np.ndarray, rates: np.ndarray) -> np.ndarray:
    """bool [P, L, E]: the probe used the expert at >= FIRE_RATIO times its mean per-token rate
    over topics (an expert nobody chose never fires)."""
    per_token = counts / tokens[:, None, None]  # [P, L, E]
    base = rates.mean(axis=-1)  # [L, E]
    return (per_token >= FIRE_RATIO * base) & (counts > 0)


def reliability(fired: np.ndarray, topic_of: np.ndarray, top: np.ndarray) -> np.ndarray:
    """(float [L, E], int [L, E]): the share and the number of the top topic's probes in which
    each expert fires."""
    in_top = topic_of[:, None, None] == top[None]  # [P, L, E]
    n = (fired & in_top).sum(axis=0)
    return n / in_top.sum(axis=0), n


def usage_vectors(counts: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """float [P, N]: each probe's selections per token, all layers side by side."""
    return (counts / tokens[:, None, None]).reshape(len(counts), -1)


def lopo_predict(vectors: np.ndarray, topic_of: np.ndarray, n_topics: int) -> np.ndarray:
    """int [P]: each probe's topic guessed from the others (leave one probe out).

    A topic's profile is the mean usage vector of its other probes; the guess is the profile of
    highest cosine similarity, both sides centred on the mean of the profiles (so the usage all
    topics share, the bulk of every vector, does not decide). Ties go to the first topic.
    """
    out = np.empty(len(vectors), np.int64)
    for p in range(len(vectors)):
        keep = np.arange(len(vectors)) != p
        profiles = np.stack(
            [vectors[keep & (topic_of == t)].mean(axis=0) for t in range(n_topics)]
        )  # [C, N]
        centre = profiles.mean(axis=0)
        a, b = vectors[p] - centre, profiles - centre
        cos = b @ a / np.maximum(np.linalg.norm(b, axis=1) * np.linalg.norm(a), 1e-12)
        out[p] = int(np.argmax(cos))
    return out


def confusion(truth: np.ndarray, guess: np.ndarray, n_topics: int) -> np.ndarray:
    """int [C, C]: row = true topic, column = guessed topic."""
    m = np.zeros((n_topics, n_topics), np.int64)
    np.add.at(m, (truth, guess), 1)
    return m


def spectral_positions(weights: np.ndarray, dim: int = 3) -> np.ndarray:
    """float [N, dim]: spectral embedding of a weighted undirected graph.

    Eigenvectors of the normalised Laplacian I - D^-1/2 W D^-1/2 (self-loops dropped) for the
    `dim` smallest eigenvalues after the trivial one, mapped back by D^-1/2 (random-walk
    coordinates), scaled to unit RMS per axis. Sign convention: each axis points so that its
    largest-magnitude coordinate is positive. Isolated nodes sit at the origin.
    """
    w = np.asarray(weights, float).copy()
    np.fill_diagonal(w, 0.0)
    w = (w + w.T) / 2
    deg = w.sum(axis=1)
    inv = np.where(deg > 0, 1.0 / np.sqrt(np.where(deg > 0, deg, 1.0)), 0.0)
    lap = np.eye(len(w)) - inv[:, None] * w * inv[None, :]
    _, vecs = np.linalg.eigh(lap)  # ascending eigenvalues
    pos = vecs[:, 1 : dim + 1] * inv[:, None]
    rms = np.sqrt((pos**2).mean(axis=0))
    pos = pos / np.where(rms > 0, rms, 1.0)
    flip = np.sign(pos[np.argmax(np.abs(pos), axis=0), np.arange(dim)])
    return pos * np.where(flip == 0, 1.0, flip)


# ----------------------------------------------------------------------------- the atlas


def file_sha256(*paths: str | Path) -> str:
    """sha256 over the files' bytes, in the order given."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def model_hash(model_dir: str | Path) -> str:
    """sha256 over config.json, then every *.safetensors file in name order."""
    d = Path(model_dir)
    return file_sha256(d / "config.json", *sorted(d.glob("*.safetensors")))


def _r(x) -> float:
    return round(float(x), DECIMALS) + 0.0  # + 0.0: no "-0.0" in the file


def shuffled_specialists(
    counts: np.ndarray, tokens: np.ndarray, topic_of: np.ndarray, n_topics: int, rounds: int
) -> float:
    """Mean number of replicated specialists when the probes' topic labels are shuffled
    (group sizes kept; seeded, so reruns agree): what noise alone would call a specialist."""
    rng = np.random.default_rng(0)
    found = []
    for _ in range(rounds):
        t = rng.permutation(topic_of)
        found.append(int(_replicated_specialists(counts, tokens, t, n_topics).sum()))
    return float(np.mean(found)) if found else 0.0


def _replicated_specialists(
    counts: np.ndarray, tokens: np.ndarray, topic_of: np.ndarray, n_topics: int
) -> np.ndarray:
    """bool [L, E]."""
    rates = topic_rates(counts, tokens, topic_of, n_topics)
    dist = topic_distribution(rates)
    _, n = reliability(fires(counts, tokens, rates), topic_of, dist.argmax(axis=-1))
    return (specialisation(dist) >= SPECIALIST_SPEC) & (n >= MIN_REPLICAS)


def neighbour_agreement(pos: np.ndarray, top: np.ndarray, among: np.ndarray) -> tuple[float, float]:
    """(share, chance): of the experts `among` (bool [N]), the share whose nearest other expert
    in `pos` [N, D] has the same top topic; chance = the same share for a random neighbour."""
    d = ((pos[:, None] - pos[None]) ** 2).sum(axis=-1)
    np.fill_diagonal(d, np.inf)
    same = top[d.argmin(axis=1)] == top
    idx = np.flatnonzero(among)
    if len(idx) == 0:
        return 0.0, 0.0
    others = np.bincount(top, minlength=top.max() + 1)
    chance = np.mean([(others[top[i]] - 1) / (len(top) - 1) for i in idx])
    return float(same[idx].mean()), float(chance)


def build_atlas(
    m: Measurement, probes: Sequence[Probe], info: dict, null_rounds: int = 200
) -> dict:
    """The atlas as a JSON-ready dict (schema version `SCHEMA_VERSION`, see `describe()`).

    `info` holds what the statistics cannot know: "model" and "probes" provenance and the
    "measurement" method (merged into "method").
    """
    topics = topics_of(probes)
    C = len(topics)
    topic_of = np.asarray([topics.index(p.topic) for p in probes])
    rates = topic_rates(m.counts, m.tokens, topic_of, C)  # [L, E, C]
    dist = topic_distribution(rates)
    spec, lft = specialisation(dist), lift(dist)
    top = dist.argmax(axis=-1)  # [L, E]
    rel, n_fired = reliability(fires(m.counts, m.tokens, rates), topic_of, top)
    guess = lopo_predict(usage_vectors(m.counts, m.tokens), topic_of, C)
    pos = spectral_positions(m.coactivation)
    L, E = rates.shape[:2]
    by_topic = [np.flatnonzero(topic_of == t) for t in range(C)]

    experts = []
    for layer in range(L):
        for e in range(E):
            c = m.counts[:, layer, e]
            experts.append(
                {
                    "layer": layer,
                    "expert": e,
                    "total": int(c.sum()),
                    "counts": [[int(c[i]) for i in idx] for idx in by_topic],
                    "affinity": [_r(x) for x in dist[layer, e]],
                    "spec": _r(spec[layer, e]),
                    "top": topics[top[layer, e]],
                    "lift": _r(lft[layer, e]),
                    "reliability": _r(rel[layer, e]),
                    "replicated": bool(n_fired[layer, e] >= MIN_REPLICAS),
                    "position": [_r(x) for x in pos[layer * E + e]],
                }
            )
    specialist = spec >= SPECIALIST_SPEC
    replicated = n_fired >= MIN_REPLICAS
    both = specialist & replicated
    near, near_chance = neighbour_agreement(pos, top.reshape(-1), both.reshape(-1))
    correct = int((guess == topic_of).sum())
    return {
        "version": SCHEMA_VERSION,
        "schema": describe(),
        "model": info["model"],
        "probes": {
            **info["probes"],
            "count": len(probes),
            "ids": [[probes[i].id for i in idx] for idx in by_topic],
            "tokens": [int(m.tokens[idx].sum()) for idx in by_topic],
        },
        "method": {**info["measurement"], **method(null_rounds)},
        "categories": topics,
        "layers": L,
        "experts_per_layer": E,
        "lopo": {
            "accuracy": _r(correct / len(probes)),
            "chance": _r(1 / C),
            "correct": correct,
            "total": len(probes),
            "confusion": confusion(topic_of, guess, C).tolist(),
            "predicted": [[topics[guess[i]] for i in idx] for idx in by_topic],
        },
        "summary": {
            "specialists": int(specialist.sum()),
            "replicated": int(replicated.sum()),
            "replicated_specialists": int(both.sum()),
            "replicated_specialists_per_category": [
                int((both & (top == t)).sum()) for t in range(C)
            ],
            "replicated_specialists_shuffled": _r(
                shuffled_specialists(m.counts, m.tokens, topic_of, C, null_rounds)
            ),
            "position_neighbour_same_top": _r(near),
            "position_neighbour_chance": _r(near_chance),
        },
        "experts": experts,
    }


def make_atlas(
    model_dir: str | Path,
    probes: Sequence[Probe],
    probes_path: str | Path,
    decode: int = 0,
    null_rounds: int = 200,
    progress: bool = False,
    names: tuple[str, str] | None = None,
) -> dict:
    """Load the model in this process, measure every probe alone, and build the atlas.

    `names` are the (model, probes) paths to record, by default as given.
    """
    from colibri.analysis import RouteTracer

    model_dir = Path(model_dir)
    tracer = RouteTracer(model_dir, capacity=_context(model_dir))
    m = measure(tracer, probes, decode=decode, progress=progress)
    info = {
        "model": {
            "path": names[0] if names else model_dir.as_posix(),
            "sha256": model_hash(model_dir),
            "family": tracer.cfg.family,
            "moe_layers": tracer.n_layers,
            "experts": tracer.n_experts,
            "top_k": tracer.top_k,
        },
        "probes": {
            "path": names[1] if names else Path(probes_path).as_posix(),
            "sha256": file_sha256(probes_path),
        },
        "measurement": {
            "routes": "colibri.analysis.RouteTracer: the engine's Runner in this process, "
            "expert store all resident, one probe at a time from position 0 of KV slot 0 "
            "(nothing carried over), usage counters zeroed per probe and checked equal to "
            "the counts of the probe's routes",
            "decode_tokens": decode,
            "tokens": "the probe's prompt tokens (no special tokens)"
            + (f", then {decode} greedy tokens" if decode else "; prefill only, no decode"),
        },
    }
    return build_atlas(m, probes, info, null_rounds)


def _context(model_dir: Path) -> int:
    """KV positions for the tracer: the model's context, at most 512 (probes are short)."""
    from colibri.config import load_config

    return min(load_config(model_dir).max_position_embeddings, 512)


def method(null_rounds: int) -> dict:
    """How each statistic is computed, with its thresholds (stored in the atlas)."""
    return {
        "distribution": "p(topic | expert): per topic, the expert's selections in the topic's "
        "probes over the topic's tokens; normalised over topics (uniform if never chosen)",
        "spec": "1 - H(p) / log(n_categories), natural logs",
        "lift": "p(top) / (1 / n_categories)",
        "fires": f"the probe chose the expert at >= {FIRE_RATIO} x its mean per-token rate "
        "over categories",
        "fire_ratio": FIRE_RATIO,
        "reliability": "share of the top category's probes in which the expert fires",
        "replicated": f"fires in >= {MIN_REPLICAS} probes of its top category",
        "min_replicas": MIN_REPLICAS,
        "specialist": f"spec >= {SPECIALIST_SPEC}",
        "specialist_spec": SPECIALIST_SPEC,
        "lopo": "leave one probe out: per-category mean of the other probes' usage vectors "
        "(selections per token, all layers concatenated); the held-out probe takes the "
        "category of highest cosine similarity, vectors centred on the mean of the profiles",
        "position": "spectral embedding of the expert co-activation graph (tokens choosing "
        "both experts, any two layers, self-loops dropped): eigenvectors 2-4 of the "
        "normalised Laplacian, times D^-1/2, unit RMS per axis, largest-magnitude coordinate "
        "of each axis positive",
        "shuffled": f"replicated specialists averaged over {null_rounds} shuffles of the "
        "probes' category labels (seed 0)",
        "null_rounds": null_rounds,
        "decimals": DECIMALS,
    }


def describe() -> dict:
    """The schema of data/experts.json, field by field."""
    return {
        "version": "schema version (int)",
        "model": "path, sha256 (config.json then *.safetensors), family, moe_layers, "
        "experts, top_k",
        "probes": "path and sha256 of the probe file, count, ids[c] (probe ids per category), "
        "tokens[c] (tokens per category)",
        "method": "how the routes were measured and each statistic computed",
        "categories": "the topics, in order: every per-category list follows it",
        "lopo": "accuracy, chance, correct, total, confusion[true][predicted], "
        "predicted[c][i] (the category guessed for probe ids[c][i])",
        "summary": "numbers of specialists, replicated experts and replicated specialists (in "
        "all, per category, and mean under shuffled labels); position_neighbour_same_top: "
        "share of replicated specialists whose nearest expert in 3-D has their top category "
        "(position_neighbour_chance: the same for a random neighbour)",
        "experts": "one per (layer, expert), layer-major: layer, expert, total (selections), "
        "counts[c][i] (selections in probe ids[c][i]), affinity[c] (p(category | expert), sums "
        "to 1), spec, top (argmax of affinity), lift, reliability, replicated, position [x, y, z]",
    }


def dumps(atlas: dict) -> str:
    """The atlas as text: keys sorted, floats already rounded, no timestamps; objects one key a
    line, lists of numbers or strings on one line (an expert is a dozen lines)."""
    return _dump(atlas, 0) + "\n"


def _dump(x, depth: int) -> str:
    pad, inner = " " * depth, " " * (depth + 1)
    if isinstance(x, dict):
        items = [f"{inner}{json.dumps(k)}: {_dump(x[k], depth + 1)}" for k in sorted(x)]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}" if items else "{}"
    if isinstance(x, list) and any(isinstance(v, dict) for v in x):
        return "[\n" + ",\n".join(inner + _dump(v, depth + 1) for v in x) + f"\n{pad}]"
    return json.dumps(x, ensure_ascii=False)


def load_atlas(path: str | Path = ATLAS) -> dict:
    return json.loads(Path(path).read_text())


def upstream_view(atlas: dict) -> dict:
    """The atlas with `experts` keyed ``"layer:expert"``, as colibrì's web UI reads it: each
    expert's `affinity` as {category: p}, `entropy` (bits of that distribution), and `label`
    (``specialist`` when spec >= SPECIALIST_SPEC, else ``generalist``), beside its own fields.
    The layer is the atlas's (the MoE layer's index)."""
    experts = {}
    for x in atlas["experts"]:
        p = np.asarray(x["affinity"], np.float64)
        bits = float(-(p[p > 0] * np.log2(p[p > 0])).sum())
        experts[f"{x['layer']}:{x['expert']}"] = {
            **x,
            "affinity": dict(zip(atlas["categories"], x["affinity"], strict=True)),
            "entropy": round(bits, 3),
            "label": "specialist" if x["spec"] >= SPECIALIST_SPEC else "generalist",
        }
    return {**atlas, "experts": experts}


def experts_frame(atlas: dict):
    """pandas DataFrame, one row per expert: layer, expert, total, spec, top, lift,
    reliability, replicated, x, y, z, and one affinity column per category."""
    import pandas as pd

    rows = []
    for x in atlas["experts"]:
        row = {k: x[k] for k in ("layer", "expert", "total", "spec", "top", "lift")}
        row |= {"reliability": x["reliability"], "replicated": x["replicated"]}
        row |= dict(zip("xyz", x["position"], strict=True))
        row |= dict(zip(atlas["categories"], x["affinity"], strict=True))
        rows.append(row)
    return pd.DataFrame(rows)
