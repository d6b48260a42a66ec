"""Jitted pieces of one forward, for the layer-by-layer path that stages experts between them."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from colibri.config import ModelConfig
from colibri.model import attention, indexer, transformer
from colibri.model.layers import rms_norm, widen

# Every function takes the static ModelConfig first; KV caches are donated (updated in place).


@partial(jax.jit, static_argnums=(0,))
def embed(cfg: ModelConfig, params: dict, tokens: jax.Array) -> jax.Array:
    return widen(params["embed"][tokens])


@partial(jax.jit, static_argnums=(0,), static_argnames=("kv_len",), donate_argnums=(2,))
def attend(cfg, lw, cache, x, pos, slots, *, kv_len: int):
    """x + attention(norm(x)) for one layer; returns (x, cache)."""
    return transformer.attention_block(cfg, lw, cache, x, pos, slots, kv_len)


@partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def mla_project(cfg, lw, cache, x, pos, slots):
    """MLA, first part: queries, and the new latents and roped keys written to the cache."""
    return attention.mla_project(
        cfg, lw["attn"], cache, rms_norm(x, lw["ln1"], cfg.rms_eps), pos, slots
    )


@partial(jax.jit, static_argnums=(0,), static_argnames=("kv_len",), donate_argnums=(2,))
def dsa_project(cfg, lw, cache, x, pos, slots, prev, *, kv_len: int):
    """DSA, first part: queries, the positions each attends to (`indexer.select`; `prev`: the
    layer before's, reused by a layer without an indexer), and the new latents, roped keys
    and indexer keys written to the cache."""
    xn = rms_norm(x, lw["ln1"], cfg.rms_eps)
    return indexer.dsa_project(cfg, lw["attn"], cache, xn, pos, slots, kv_len, prev=prev)


@partial(jax.jit, static_argnums=(0,), static_argnames=("kv_len",))
def mla_expand(cfg, lw, cache, slots, *, kv_len: int):
    """MLA kv_b expansion of the cached latents (the t_kvb phase)."""
    return attention.mla_expand_cached(cfg, lw["attn"], cache, slots, kv_len)


@partial(jax.jit, static_argnums=(0,), static_argnames=("kv_len",))
def mla_attend(cfg, lw, cache, x, q, k_nope, v, pos, slots, keep=None, *, kv_len: int):
    out = attention.mla_attend(cfg, lw["attn"], cache, q, k_nope, v, pos, slots, kv_len, keep)
    return x + out


@partial(jax.jit, static_argnums=(0,), static_argnames=("kv_len",))
def mla_attend_latent(cfg, lw, cache, x, q, pos, slots, keep=None, *, kv_len: int):
    """MLA attention of a decode step in the latent space (no t_kvb expansion)."""
    out = attention.mla_attend_latent(cfg, lw["attn"], cache, q, pos, slots, kv_len, keep)
    return x + out


@partial(jax.jit, static_argnums=(0,))
def route(cfg, lw, x):
    return transformer.moe_route(cfg, lw, x)


@partial(jax.jit, static_argnums=(0,))
def lookahead(cfg, lw_next, h):
    """PILOT: the next MoE layer's router applied to this layer's normed input h [N, D]."""
    from colibri.model.moe import route as route_rows

    return route_rows(cfg.moe, lw_next["moe"], h)[0]


@partial(jax.jit, static_argnums=(0,))
def expert_outputs(cfg, bufs, h, slot_map, ids):
    """Routed outputs from the device slots: ids [N, K] mapped through slot_map [E] (-1 absent)."""
    return transformer.moe_outputs(cfg, bufs, h, jnp.take(slot_map, ids))


@partial(jax.jit, static_argnums=(0,))
def combine(cfg, lw, x, h, y, wts):
    return transformer.moe_combine(cfg, lw, x, h, y, wts)


@partial(jax.jit, static_argnums=(0,))
def dense_mlp(cfg, lw, x):
    return transformer.dense_mlp_block(cfg, lw, x)


@partial(jax.jit, static_argnums=(0,), static_argnames=("all_logits",))
def head(cfg, params, x, last, *, all_logits: bool = False):
    if not all_logits:
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
    return transformer.head(cfg, params, x)
