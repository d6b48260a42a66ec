"""Per-token routing analysis: trace expert choices in-process, then measure load balance,
co-activation, consecutive-token overlap and one-layer-ahead predictability.

The wire protocol reports routing per turn (ENTROPY) and per window (HITS), not per token, so
`RouteTracer` runs the model in this process through the same `Runner` the engine uses and keeps
the expert ids of every token it feeds. The statistics are pure functions of routes
``[L, T, K]`` (MoE layers, tokens, chosen experts), or of a list of them (one per trace, so
nothing pairs tokens across traces).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

Routes = np.ndarray | Sequence[np.ndarray]  # [L, T, K] or several with the same L and K


@dataclass(frozen=True)
class Trace:
    """One greedy (or sampled) turn with the expert choices of every token fed to the model."""

    prompt: str
    text: str  # the generated text
    tokens: tuple[int, ...]  # prompt then generated tokens
    n_prompt: int
    routes: np.ndarray  # [L, T, K]: T = prompt + generated tokens fed back (all but the last)


class RouteTracer:
    """A checkpoint loaded in this process, recording routes token by token (in KV slot 0).

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
        from colibri.engine.runner import Row
        from colibri.engine.sampling import sample

        tok = self.model.tokenizer
        if tok is None:
            raise ValueError(f"{self.model.dir}: no tokenizer.json")
        ids = tok.encode(prompt)
        n = min(max_tokens, self.runner.capacity - len(ids))
        logits, r = self.runner.prefill(0, ids)
        routes, out = [r], []
        rng = np.random.default_rng(seed)
        stop = set(self.cfg.eos_token_ids)
        while len(out) < n:
            t = sample(logits, temperature, 1.0, rng)
            if t in stop:
                break
            out.append(t)
            if len(out) == n:
                break
            step_logits, r = self.runner.decode([Row(0, t, len(ids) + len(out) - 1)])
            logits = step_logits[0]
            routes.append(r)
        text = b"".join(tok.token_bytes(t) for t in out).decode("utf-8", errors="replace")
        return Trace(prompt, text, (*ids, *out), len(ids), np.concatenate(routes, axis=1))


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
