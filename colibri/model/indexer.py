"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): MLA whose queries each attend only to the
`index_topk` cached positions a lightning indexer scores highest.

The indexer of a layer projects the query LoRA's latent into `n_heads` small queries and the
layer's normed input into one key per token (LayerNorm'd, the first qk_rope_head_dim dims
rotated: in pairs in GLM-5, by halves in DeepSeek-V3.2), cached beside the latents as "ik".
A position's score for a query is the sum over heads of relu(q_h . k) times a per-token,
per-head weight; each query keeps its top-k positions, all of them while it sees no more.
GLM-5's "shared" layers run no indexer and attend where the layer before them chose.

The selection is a mask over the positions attention reads, not a gather: the engine still
attends over every cached position, so this buys exactness, not speed. As in transformers, a
tie at the cut keeps every tied position here (transformers keeps an arbitrary k of them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from colibri.config import ModelConfig
from colibri.model import attention
from colibri.model.layers import EXACT, Rope, apply_rope, linear, rope_cos_sin

_K_NORM_EPS = 1e-6  # transformers builds the indexer's LayerNorm with eps 1e-6


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis (biased variance, as torch), computed in float32."""
    x = x.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * w + b


def index_keys(cfg: ModelConfig, w: dict, x: jax.Array, rope: Rope) -> jax.Array:
    """The indexer's key of each token of normed x [B, T, D]: [B, T, Di]."""
    d = cfg.dsa
    assert d is not None
    k = layer_norm(linear(x, w["wk"]), w["k_norm"], w["k_norm_bias"], _K_NORM_EPS)
    cos, sin = rope
    return apply_rope(k[:, :, None], cos, sin, d.interleave)[:, :, 0]


def index_scores(
    cfg: ModelConfig,
    w: dict,
    keys: jax.Array,
    x: jax.Array,
    q_lat: jax.Array,
    pos: jax.Array,
    rope: Rope,
) -> jax.Array:
    """Scores [B, T, S] of cached indexer keys [B, S, Di] for the queries of normed x
    [B, T, D] with query latent q_lat [B, T, q_lora_rank] at positions pos [B, T]:
    sum_h weight[h] relu(q_h . k) / sqrt(Di H), -inf past each query's own position."""
    d = cfg.dsa
    assert d is not None
    B, T, _ = x.shape
    q = linear(q_lat, w["wq_b"]).reshape(B, T, d.n_heads, d.head_dim)
    cos, sin = rope
    q = apply_rope(q, cos, sin, d.interleave)
    dots = jax.nn.relu(jnp.einsum("bthd,bsd->bths", q, keys, precision=EXACT) * d.head_dim**-0.5)
    heads = linear(x, w["weights"]) * d.n_heads**-0.5  # [B, T, H]
    scores = jnp.einsum("bth,bths->bts", heads, dots, precision=EXACT)
    visible = jnp.arange(keys.shape[1])[None, None, :] <= pos[:, :, None]
    return jnp.where(visible, scores, -jnp.inf)


def select(
    cfg: ModelConfig,
    w: dict,
    cache: attention.Cache,
    x: jax.Array,
    q_lat: jax.Array,
    pos: jax.Array,
    slots: jax.Array,
    kv_len: int,
    rope: Rope | None = None,
    prev: jax.Array | None = None,
) -> tuple[jax.Array | None, attention.Cache]:
    """The positions each query of one DSA layer attends to: keep [B, T, kv_len] (None: all
    it sees), and the cache with the new tokens' indexer keys. x: the layer's normed input;
    q_lat: its query latent (`attention.mla_query_latent`); `prev`: the selection of the layer
    before, which a layer without an indexer (GLM-5's "shared") reuses."""
    if "indexer" not in w:
        return prev, cache
    d, iw = cfg.dsa, w["indexer"]
    assert d is not None
    rope = rope or rope_cos_sin(cfg.rope, pos)
    cache = {**cache, "ik": attention._write(cache["ik"], slots, pos, index_keys(cfg, iw, x, rope))}
    if kv_len <= d.topk:  # no query sees more positions than it may keep
        return None, cache
    keys = attention._read(cache["ik"], slots, kv_len)
    scores = index_scores(cfg, iw, keys, x, q_lat, pos, rope)
    cut = jax.lax.top_k(scores, d.topk)[0][..., -1:]  # -inf while a query sees fewer
    return (scores >= cut) & jnp.isfinite(scores), cache


def dsa_project(
    cfg: ModelConfig,
    w: dict,
    cache: attention.Cache,
    x: jax.Array,
    pos: jax.Array,
    slots: jax.Array,
    kv_len: int,
    rope: Rope | None = None,
    prev: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None, attention.Cache]:
    """`attention.mla_project` of normed x and the layer's selection (`select`): queries,
    keep, and the cache with the new latents, roped keys and indexer keys."""
    rope = rope or rope_cos_sin(cfg.rope, pos)
    q_lat = attention.mla_query_latent(w, x)
    q, cache = attention.mla_project(cfg, w, cache, x, pos, slots, rope, q_lat)
    keep, cache = select(cfg, w, cache, x, q_lat, pos, slots, kv_len, rope, prev)
    return q, keep, cache


def dsa(
    cfg: ModelConfig,
    w: dict,
    cache: attention.Cache,
    x: jax.Array,
    pos: jax.Array,
    slots: jax.Array,
    kv_len: int,
    rope: Rope | None = None,
    prev: jax.Array | None = None,
) -> tuple[jax.Array, attention.Cache, jax.Array | None]:
    """One DSA layer's attention of normed x: [B, T, D], the cache, and the selection (for the
    next layer to reuse where it has no indexer)."""
    q, keep, cache = dsa_project(cfg, w, cache, x, pos, slots, kv_len, rope, prev)
    out = attention.mla_attend_cached(cfg, w, cache, q, pos, slots, kv_len, keep)
    return out, cache, keep
