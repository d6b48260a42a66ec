"""The decoder stack: embed, per-layer attention + MLP/MoE, final norm and head, over a KV cache."""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from colibri.config import ModelConfig
from colibri.model import attention, indexer, moe, parallel
from colibri.model.layers import Rope, linear, rms_norm, rope_cos_sin, swiglu, widen

Cache = list[attention.Cache]


class Routing(NamedTuple):
    """What a traced forward reports per MoE layer and token (`forward(..., trace=True)`):
    ids [n_moe, B, T, K] int32, the gate weights that mix those experts [n_moe, B, T, K]
    float32, and the entropy (bits) and top-1 minus top-2 margin of the router's distribution
    over all experts [n_moe, B, T] (`moe.route_traced`)."""

    ids: jax.Array
    weights: jax.Array
    entropy: jax.Array
    margin: jax.Array


def init_cache(cfg: ModelConfig, slots: int, capacity: int) -> Cache:
    return [attention.init_layer_cache(cfg, slots, capacity, i) for i in range(cfg.num_layers)]


def attention_block(
    cfg: ModelConfig,
    lw: dict,
    cache: attention.Cache,
    x: jax.Array,
    pos: jax.Array,
    slots: jax.Array,
    kv_len: int,
    rope: Rope | None = None,
) -> tuple[jax.Array, attention.Cache]:
    """x + attention(norm(x)) for x [B, T, D]; `rope` as attention.gqa takes it."""
    attend = attention.mla if cfg.attention == "mla" else attention.gqa
    h, cache = attend(
        cfg, lw["attn"], cache, rms_norm(x, lw["ln1"], cfg.rms_eps), pos, slots, kv_len, rope
    )
    return x + h, cache


def dsa_block(
    cfg: ModelConfig,
    lw: dict,
    cache: attention.Cache,
    x: jax.Array,
    pos: jax.Array,
    slots: jax.Array,
    kv_len: int,
    rope: Rope | None = None,
    prev: jax.Array | None = None,
) -> tuple[jax.Array, attention.Cache, jax.Array | None]:
    """`attention_block` of a DSA layer (`indexer.dsa`): also returns the positions it chose,
    which the next layer reuses where it runs no indexer (`prev`)."""
    xn = rms_norm(x, lw["ln1"], cfg.rms_eps)
    h, cache, keep = indexer.dsa(cfg, lw["attn"], cache, xn, pos, slots, kv_len, rope, prev)
    return x + h, cache, keep


def moe_route(cfg: ModelConfig, lw: dict, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Normed rows h [N, D] of x [B, T, D] and their routing (ids [N, K], weights [N, K])."""
    h = rms_norm(x, lw["ln2"], cfg.rms_eps).reshape(-1, cfg.hidden)
    ids, wts = moe.route(cfg.moe, lw["moe"], h)
    return h, ids, wts


def moe_route_traced(cfg: ModelConfig, lw: dict, x: jax.Array):
    """`moe_route` with the router's entropy and margin by row: h, ids, weights, entropy, margin."""
    h = rms_norm(x, lw["ln2"], cfg.rms_eps).reshape(-1, cfg.hidden)
    return h, *moe.route_traced(cfg.moe, lw["moe"], h)


def moe_outputs(cfg: ModelConfig, experts: moe.Experts, h: jax.Array, slot_ids: jax.Array):
    """Routed outputs y [N, K, D] from `experts` (a slot cache when slot_ids are slot numbers);
    split over the devices when there are several (`parallel`), bitwise the same."""

    def compute(stacks, h, ids):  # the plan from the global expert count, on every device
        return moe.expert_outputs(stacks, h, ids, cfg.moe.num_experts)

    if parallel.mesh() is not None:
        return parallel.expert_outputs(compute, experts, h, slot_ids)
    return compute(experts, h, slot_ids)


def moe_combine(
    cfg: ModelConfig, lw: dict, x: jax.Array, h: jax.Array, y: jax.Array, wts: jax.Array
) -> jax.Array:
    """x + weighted routed outputs + shared expert, for x [B, T, D] and h, y, wts by row."""
    out = moe.combine(y, wts) + moe.shared_expert(cfg.moe, lw["moe"], h)
    return x + out.reshape(x.shape)


def dense_mlp_block(cfg: ModelConfig, lw: dict, x: jax.Array) -> jax.Array:
    return x + swiglu(rms_norm(x, lw["ln2"], cfg.rms_eps), lw["mlp"])


def head(cfg: ModelConfig, params: dict, x: jax.Array) -> jax.Array:
    """Final norm and lm_head: x [..., D] -> logits [..., V]."""
    return linear(rms_norm(x, params["final_norm"], cfg.rms_eps), params["lm_head"])


@partial(
    jax.jit,
    static_argnums=(0,),
    static_argnames=("kv_len", "all_logits", "trace"),
    donate_argnums=(3,),
)
def forward(
    cfg: ModelConfig,
    params: dict,
    experts: list,
    cache: Cache,
    tokens: jax.Array,
    pos: jax.Array,
    slots: jax.Array,
    last: jax.Array,
    *,
    kv_len: int,
    all_logits: bool = False,
    rope: Rope | None = None,
    trace: bool = False,
) -> tuple[jax.Array, Cache, jax.Array | Routing]:
    """One forward with every routed expert resident.

    tokens, pos [B, T]; slots [B] (the KV slot of each row); last [B] (the row's last real token).
    `experts[i]` holds MoE layer i's stacked experts (by MoE-layer order). Returns logits
    ([B, V] at `last`, or [B, T, V] with all_logits), the updated cache, and the routing
    ids [n_moe, B, T, K] for telemetry. `rope`: the rotary cos and sin of `pos`
    (`layers.rope_cos_sin`) when the caller has them; else computed here, once for all layers.
    `trace` (a separate program: the engine's steps never set it): a `Routing` in place of
    the ids, with the gate weights and the router's entropy and margin as well.
    """
    x = widen(params["embed"][tokens])
    if rope is None:
        rope = rope_cos_sin(cfg.rope, pos)
    new_cache, routes, traced, keep = [], [], [], None
    for i, lw in enumerate(params["layers"]):
        if cfg.dsa is not None:
            x, c, keep = dsa_block(cfg, lw, cache[i], x, pos, slots, kv_len, rope, keep)
        else:
            x, c = attention_block(cfg, lw, cache[i], x, pos, slots, kv_len, rope)
        new_cache.append(c)
        if "moe" in lw:
            if trace:
                h, ids, wts, ent, margin = moe_route_traced(cfg, lw, x)
                traced.append((wts, ent, margin))
            else:
                h, ids, wts = moe_route(cfg, lw, x)
            y = moe_outputs(cfg, experts[len(routes)], h, ids)
            x = moe_combine(cfg, lw, x, h, y, wts)
            routes.append(ids.reshape(*tokens.shape, -1))
        else:
            x = dense_mlp_block(cfg, lw, x)
    if not all_logits:
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
    routes_arr = jnp.stack(routes) if routes else jnp.zeros((0, *tokens.shape, 1), jnp.int32)
    if trace:
        routes_arr = traced_routing(routes_arr, traced, tokens.shape)
    return head(cfg, params, x), new_cache, routes_arr


def traced_routing(ids: jax.Array, traced: list, shape: tuple[int, int]) -> Routing:
    """A `Routing` from stacked ids [n_moe, B, T, K] and each MoE layer's (weights [N, K],
    entropy [N], margin [N]) by row."""
    if not traced:
        empty = jnp.zeros((0, *shape), jnp.float32)
        return Routing(ids, jnp.zeros(ids.shape, jnp.float32), empty, empty)
    wts, ent, margin = (jnp.stack([t[j] for t in traced]) for j in range(3))
    n = len(traced)
    return Routing(
        ids,
        wts.astype(jnp.float32).reshape(ids.shape),
        ent.astype(jnp.float32).reshape(n, *shape),
        margin.astype(jnp.float32).reshape(n, *shape),
    )
