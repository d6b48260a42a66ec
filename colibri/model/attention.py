"""Causal attention over a slot-indexed KV cache: grouped-query (GQA) and latent (MLA) variants."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from colibri import formats, kernels
from colibri.config import ModelConfig
from colibri.model.layers import (
    EXACT,
    Rope,
    apply_rope,
    linear,
    rms_norm,
    rope_cos_sin,
    widen_rows,
)

# Cache layout per layer: GQA {"k", "v": [S, Hkv, C, Dh]}; MLA {"lat": [S, C, r], "kr": [S, C, R]}
# (and DSA's indexer keys "ik": [S, C, Di] where the layer runs an indexer, `indexer.select`)
# with S slots and C cached positions. Rows of a batch name their slot; row b's token t sits
# at position pos[b, t]. Padding rows use slot S (out of range): their writes are dropped.
# GQA keeps each head's positions together: decode attention streams one head's keys and
# values of a conversation from one contiguous block, twice as fast as from rows of all heads
# a position apart (olmoe shape, 16 rows). `export_positions` gives every array by position.
Cache = dict[str, jax.Array]
_HEADS_FIRST = ("k", "v")  # the arrays laid out [S, Hkv, C, Dh]


def init_layer_cache(cfg: ModelConfig, slots: int, capacity: int, layer: int = 0) -> Cache:
    """Zeroed cache of layer `layer` for `slots` conversations of up to `capacity` positions."""
    if cfg.attention == "mla":
        assert cfg.mla is not None
        cache = {
            "lat": jnp.zeros((slots, capacity, cfg.mla.kv_lora_rank), jnp.float32),
            "kr": jnp.zeros((slots, capacity, cfg.mla.qk_rope_head_dim), jnp.float32),
        }
        if cfg.dsa is not None and not cfg.dsa.shared[layer]:
            cache["ik"] = jnp.zeros((slots, capacity, cfg.dsa.head_dim), jnp.float32)
        return cache
    shape = (slots, cfg.num_kv_heads, capacity, cfg.head_dim)
    return {"k": jnp.zeros(shape, jnp.float32), "v": jnp.zeros(shape, jnp.float32)}


def _write(buf: jax.Array, slots: jax.Array, pos: jax.Array, new: jax.Array) -> jax.Array:
    """buf[slots[b], pos[b, t]] = new[b, t]; out-of-range slots or positions are dropped."""
    return buf.at[slots[:, None], pos].set(new, mode="drop")


def _write_heads(buf: jax.Array, slots: jax.Array, pos: jax.Array, new: jax.Array) -> jax.Array:
    """buf[slots[b], :, pos[b, t]] = new[b, t] for buf [S, Hkv, C, Dh], new [B, T, Hkv, Dh]."""
    return buf.at[slots[:, None], :, pos].set(new, mode="drop")


def _read(buf: jax.Array, slots: jax.Array, kv_len: int) -> jax.Array:
    """The first kv_len cached positions of each row's slot: [B, kv_len, ...]."""
    return jnp.take(buf[:, :kv_len], slots, axis=0, mode="clip")


def _read_heads(buf: jax.Array, slots: jax.Array, kv_len: int) -> jax.Array:
    """As `_read` for buf [S, Hkv, C, Dh]: [B, Hkv, kv_len, Dh]."""
    return jnp.take(buf[:, :, :kv_len], slots, axis=0, mode="clip")


def _softmax_attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pos: jax.Array,
    scale: float,
    keep: jax.Array | None = None,
) -> jax.Array:
    """q [B, T, Hkv, G, Dq], k [B, Hkv, S, Dq], v [B, Hkv, S, Dv] -> [B, T, Hkv, G, Dv];
    `keep` [B, T, S]: the only positions each query may attend to (DSA), besides causality."""
    scores = jnp.einsum("btkgd,bksd->bkgts", q, k, precision=EXACT) * scale
    visible = jnp.arange(k.shape[2])[None, None, :] <= pos[:, :, None]  # [B, T, S]
    if keep is not None:
        visible = visible & keep
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1)
    return jnp.einsum("bkgts,bksd->btkgd", probs, v, precision=EXACT)


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _native_attend(q, k, v, slots, pos, scale: float) -> jax.Array:
    """Attention of q [B, T, H, Dh] at positions pos [B, T] over the caches k, v [S, Hkv, C,
    Dh] (the new keys and values written): one row of `kernels.attend` a token, which takes a
    row's consecutive tokens together (their keys and values read once for several) and
    gives each bitwise what decoding it alone computes, over positions 0..pos (not a bucket
    of them, and no [T, kv_len] scores held). Training differentiates XLA's masked softmax of
    the same (`_xla_attend`)."""
    return _native_attend_fwd(q, k, v, slots, pos, scale)[0]


def _native_attend_fwd(q, k, v, slots, pos, scale):
    B, T, H, Dh = q.shape
    rows = (q.reshape(B * T, H, Dh), k, v, jnp.repeat(slots, T), pos.reshape(-1))
    return kernels.attend(*rows, scale).reshape(q.shape), (q, k, v, slots, pos)


def _native_attend_bwd(scale, res, dy):
    q, k, v, slots, pos = res
    grads = jax.vjp(lambda q, k, v: _xla_attend(q, k, v, slots, pos, scale), q, k, v)[1](dy)
    return (*grads, None, None)


_native_attend.defvjp(_native_attend_fwd, _native_attend_bwd)


def _xla_attend(q, k, v, slots, pos, scale: float) -> jax.Array:
    """`_native_attend` in XLA's ops: the masked softmax over every cached position (rows of a
    slot outside the cache give zeros, as the kernel's)."""
    B, T, H, Dh = q.shape
    S, Hkv, C, _ = k.shape
    ks, vs = _read_heads(k, slots, C), _read_heads(v, slots, C)
    out = _softmax_attend(q.reshape(B, T, Hkv, H // Hkv, Dh), ks, vs, pos, scale)
    inside = (slots >= 0) & (slots < S)
    return jnp.where(inside[:, None, None, None], out.reshape(q.shape), 0.0)


def export_positions(layer: Cache, slot: int | jax.Array, length: int) -> Cache:
    """The first `length` positions of `slot` in one layer's cache, position first
    ([length, ...] per array, whatever the layout). For use under `jit`, `length` static and
    `slot` traced: called eagerly, each new length would compile (and keep) new programs."""
    out = {}
    for name, buf in layer.items():
        rows = jax.lax.dynamic_index_in_dim(buf, slot, axis=0, keepdims=False)
        if name in _HEADS_FIRST:
            out[name] = rows[:, :length].swapaxes(0, 1)
        else:
            out[name] = rows[:length]
    return out


def import_positions(layer: Cache, slot: int, arrays: dict[str, np.ndarray]) -> Cache:
    """`layer` with positions 0..n-1 of `slot` set from `export_positions`' arrays."""
    out = {}
    for name, buf in layer.items():
        data = arrays[name]
        if name in _HEADS_FIRST:
            out[name] = buf.at[slot, :, : data.shape[0]].set(data.swapaxes(0, 1))
        else:
            out[name] = buf.at[slot, : data.shape[0]].set(data)
    return out


def gqa(
    cfg: ModelConfig,
    w: dict,
    cache: Cache,
    x: jax.Array,
    pos: jax.Array,
    slots: jax.Array,
    kv_len: int,
    rope: Rope | None = None,
) -> tuple[jax.Array, Cache]:
    """Grouped-query attention of x [B, T, D] at positions pos [B, T]; returns [B, T, D].
    `rope`: rope_cos_sin(cfg.rope, pos) when the caller computed it once for every layer."""
    B, T, _ = x.shape
    H, Hkv, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if "qkv" in w:  # stacked at load (weights.fuse_qkv): one linear call
        qkv = linear(x, w["qkv"], w.get("qkv_bias"))
        q, k, v = jnp.split(qkv, [H * Dh, (H + Hkv) * Dh], axis=-1)
    else:
        q = linear(x, w["q"], w.get("q_bias"))
        k = linear(x, w["k"], w.get("k_bias"))
        v = linear(x, w["v"], w.get("v_bias"))
    if cfg.qk_norm == "full":  # OLMoE normalises the whole projection before splitting heads
        q, k = rms_norm(q, w["q_norm"], cfg.rms_eps), rms_norm(k, w["k_norm"], cfg.rms_eps)
    if cfg.clip_qkv is not None:
        q, k, v = (jnp.clip(t, -cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
    q, k, v = q.reshape(B, T, H, Dh), k.reshape(B, T, Hkv, Dh), v.reshape(B, T, Hkv, Dh)
    if cfg.qk_norm == "head":
        q, k = rms_norm(q, w["q_norm"], cfg.rms_eps), rms_norm(k, w["k_norm"], cfg.rms_eps)
    cos, sin = rope or rope_cos_sin(cfg.rope, pos)
    q, k = (
        apply_rope(q, cos, sin, cfg.rope.interleave),
        apply_rope(k, cos, sin, cfg.rope.interleave),
    )
    if T == 1 and kernels.usable(q, cache["k"], cache["v"]):  # CPU decode: the cache in place
        out, ck, cv = kernels.attend_write(
            q[:, 0], cache["k"], cache["v"], slots, pos[:, 0], k[:, 0], v[:, 0], cfg.attn_scale
        )
        return linear(out.reshape(B, T, H * Dh), w["o"], w.get("o_bias")), {"k": ck, "v": cv}
    cache = {
        "k": _write_heads(cache["k"], slots, pos, k),
        "v": _write_heads(cache["v"], slots, pos, v),
    }
    if kernels.usable(q, cache["k"], cache["v"]):  # CPU prefill: each token as decode attends
        out = _native_attend(q, cache["k"], cache["v"], slots, pos, cfg.attn_scale)
        return linear(out.reshape(B, T, H * Dh), w["o"], w.get("o_bias")), cache
    ks, vs = _read_heads(cache["k"], slots, kv_len), _read_heads(cache["v"], slots, kv_len)
    out = _softmax_attend(q.reshape(B, T, Hkv, H // Hkv, Dh), ks, vs, pos, cfg.attn_scale)
    return linear(out.reshape(B, T, H * Dh), w["o"], w.get("o_bias")), cache


def mla_expand(cfg: ModelConfig, w: dict, lat: jax.Array) -> tuple[jax.Array, jax.Array]:
    """kv_b expansion of latents [B, S, r] into k_nope [B, S, H, Dn] and v [B, S, H, Dv]."""
    m = cfg.mla
    assert m is not None
    B, S, _ = lat.shape
    kv = linear(lat, w["kv_b"]).reshape(B, S, cfg.num_heads, m.qk_nope_head_dim + m.v_head_dim)
    return kv[..., : m.qk_nope_head_dim], kv[..., m.qk_nope_head_dim :]


def mla_project(
    cfg: ModelConfig,
    w: dict,
    cache: Cache,
    x: jax.Array,
    pos: jax.Array,
    slots: jax.Array,
    rope: Rope | None = None,
    q_lat: jax.Array | None = None,
) -> tuple[jax.Array, Cache]:
    """Queries [B, T, H, Dn + R] (rope applied) for normed x; new latents and keys cached.
    `q_lat`: `mla_query_latent` of x when the caller has it (DSA's indexer reads it too)."""
    m = cfg.mla
    assert m is not None
    B, T, _ = x.shape
    if m.q_lora_rank is None:
        q = linear(x, w["q"])
    else:
        q = linear(mla_query_latent(w, x) if q_lat is None else q_lat, w["q_b"])
    q = q.reshape(B, T, cfg.num_heads, m.qk_head_dim)
    ckv = linear(x, w["kv_a"], w.get("kv_a_bias"))
    lat = rms_norm(ckv[..., : m.kv_lora_rank], w["kv_a_norm"], 1e-6)
    kr = ckv[..., m.kv_lora_rank :][:, :, None, :]  # [B, T, 1, R]: one roped key for all heads
    cos, sin = rope or rope_cos_sin(cfg.rope, pos)
    q_rope = apply_rope(q[..., m.qk_nope_head_dim :], cos, sin, cfg.rope.interleave)
    kr = apply_rope(kr, cos, sin, cfg.rope.interleave)[:, :, 0]
    cache = {
        **cache,
        "lat": _write(cache["lat"], slots, pos, lat),
        "kr": _write(cache["kr"], slots, pos, kr),
    }
    return jnp.concatenate([q[..., : m.qk_nope_head_dim], q_rope], axis=-1), cache


def mla_query_latent(w: dict, x: jax.Array) -> jax.Array:
    """The query LoRA's normed latent of x [B, T, D]: [B, T, q_lora_rank] (transformers builds
    q_a_layernorm with its default eps, 1e-6)."""
    return rms_norm(linear(x, w["q_a"], w.get("q_a_bias")), w["q_a_norm"], 1e-6)


def mla_expand_cached(
    cfg: ModelConfig, w: dict, cache: Cache, slots: jax.Array, kv_len: int
) -> tuple[jax.Array, jax.Array]:
    """k_nope and v of the first kv_len cached positions of each row's slot."""
    return mla_expand(cfg, w, _read(cache["lat"], slots, kv_len))


def mla_in_latents(w: dict, T: int) -> bool:
    """Whether MLA attention of T new tokens a row runs in the latent space
    (`mla_attend_latent`): a decode step's (T == 1) does, where kv_b is held in float32 or
    widened to it (not for bfloat16 products, whose products are defined on the latents'
    side). Expanding every cached latent through kv_b costs each step kv_len x r x H x (Dn +
    Dv) multiply-adds a layer; the latent space, about kv_len x H x (2 r + R)."""
    return T == 1 and not formats.bf16_inputs(w["kv_b"].dtype)


def mla_attend_latent(
    cfg: ModelConfig,
    w: dict,
    cache: Cache,
    q: jax.Array,
    pos: jax.Array,
    slots: jax.Array,
    kv_len: int,
    keep: jax.Array | None = None,
) -> jax.Array:
    """`mla_attend` without expanding the cached latents: each head's query taken into the
    latent space through its rows of kv_b (q_nope . W_UK[h]), scored against the latents
    (plus the roped part against the shared roped key), the latents weighted by the softmax,
    then taken out through the head's value rows (W_UV[h]) and o_proj: the same attention to
    float32 rounding, [B, T, D]."""
    m = cfg.mla
    assert m is not None
    B, T, H = q.shape[0], q.shape[1], cfg.num_heads
    Dn, Dv, r = m.qk_nope_head_dim, m.v_head_dim, m.kv_lora_rank
    # Through the kernels on CPU: kv_b's rows read where they lie, as held (XLA widened them
    # and copied each half out first), the cache's latents and roped keys read in place (XLA
    # gathered each row's), and each row's bits as it is alone (XLA's dots sum in orders that
    # move with the rows); docs/kernels.md, "MLA's per-head products", "MLA's attention over
    # the latents".
    held = w["kv_b"]
    native = (
        kernels.usable_weights(q, held)
        and kernels.usable(cache["lat"], cache["kr"])
        and not formats.bf16_inputs(held.dtype)
    )
    if native:
        kv_b = held.reshape(H, Dn + Dv, -1)  # as held: rows of r weights
        q_lat = kernels.linear_heads_t(q[..., :Dn].reshape(B * T, H, Dn), kv_b, cols=r)
        q_lat = q_lat.reshape(B, T, H, r)
        if T == 1 and r % 8 == 0 and m.qk_rope_head_dim % 8 == 0:  # (every MLA model's)
            o_lat = kernels.mla_attend(
                q_lat[:, 0],
                q[:, 0, :, Dn:],
                cache["lat"],
                cache["kr"],
                slots,
                pos[:, 0],
                cfg.attn_scale,
                None if keep is None else keep[:, 0],
            )[:, None]
        else:
            o_lat = _latent_attend(cfg, cache, q[..., Dn:], q_lat, pos, slots, kv_len, keep)
        out = kernels.linear_heads(o_lat.reshape(B * T, H, r), kv_b, first=Dn)
    else:
        kv_b = widen_rows(held, r).reshape(H, Dn + Dv, r)
        q_lat = jnp.einsum("bthd,hdr->bthr", q[..., :Dn], kv_b[:, :Dn], precision=EXACT)
        o_lat = _latent_attend(cfg, cache, q[..., Dn:], q_lat, pos, slots, kv_len, keep)
        out = jnp.einsum("bthr,hvr->bthv", o_lat, kv_b[:, Dn:], precision=EXACT)
    return linear(out.reshape(B, T, H * Dv), w["o"], w.get("o_bias"))


def _latent_attend(
    cfg: ModelConfig,
    cache: Cache,
    q_rope: jax.Array,
    q_lat: jax.Array,
    pos: jax.Array,
    slots: jax.Array,
    kv_len: int,
    keep: jax.Array | None,
) -> jax.Array:
    """`mla_attend_latent`'s attention in XLA: the latents [B, T, H, r] the softmax weighs."""
    lat = _read(cache["lat"], slots, kv_len)  # [B, S, r]
    kr = _read(cache["kr"], slots, kv_len)  # [B, S, R]
    # Scores position-major, [B, S, T, H]: the latents the left operand of both products as
    # they lie in the cache (head-major scores had XLA transpose the latents twice a layer:
    # 5x the time of the products at 4096 positions).
    scores = (
        jnp.einsum("bsr,bthr->bsth", lat, q_lat, precision=EXACT)
        + jnp.einsum("bsd,bthd->bsth", kr, q_rope, precision=EXACT)
    ) * cfg.attn_scale
    visible = jnp.arange(kv_len)[None, :, None] <= pos[:, None, :]  # [B, S, T]
    if keep is not None:
        visible = visible & keep.swapaxes(1, 2)
    scores = jnp.where(visible[..., None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=1)
    return jnp.einsum("bsth,bsr->bthr", probs, lat, precision=EXACT)


def mla_attend_cached(
    cfg: ModelConfig,
    w: dict,
    cache: Cache,
    q: jax.Array,
    pos: jax.Array,
    slots: jax.Array,
    kv_len: int,
    keep: jax.Array | None = None,
) -> jax.Array:
    """MLA attention of q over the cached latents, then o_proj: in the latent space where
    `mla_in_latents`, else through the latents expanded by kv_b."""
    if mla_in_latents(w, q.shape[1]):
        return mla_attend_latent(cfg, w, cache, q, pos, slots, kv_len, keep)
    k_nope, v = mla_expand_cached(cfg, w, cache, slots, kv_len)
    return mla_attend(cfg, w, cache, q, k_nope, v, pos, slots, kv_len, keep)


def mla_attend(
    cfg: ModelConfig,
    w: dict,
    cache: Cache,
    q: jax.Array,
    k_nope: jax.Array,
    v: jax.Array,
    pos: jax.Array,
    slots: jax.Array,
    kv_len: int,
    keep: jax.Array | None = None,
) -> jax.Array:
    """Softmax attention of q over [k_nope, shared roped key], then o_proj: [B, T, D];
    `keep` [B, T, kv_len]: DSA's selection (`indexer.select`), None for every position."""
    m = cfg.mla
    assert m is not None
    B, T = q.shape[:2]
    kr = _read(cache["kr"], slots, kv_len)[:, :, None]
    k_rope = jnp.broadcast_to(kr, (*k_nope.shape[:3], m.qk_rope_head_dim))
    kf = jnp.concatenate([k_nope, k_rope], axis=-1)
    kf, v = kf.swapaxes(1, 2), v.swapaxes(1, 2)  # [B, H, S, ...]: heads as Hkv, G = 1
    out = _softmax_attend(q[:, :, :, None], kf, v, pos, cfg.attn_scale, keep)
    return linear(out.reshape(B, T, cfg.num_heads * m.v_head_dim), w["o"], w.get("o_bias"))


def mla(
    cfg: ModelConfig,
    w: dict,
    cache: Cache,
    x: jax.Array,
    pos: jax.Array,
    slots: jax.Array,
    kv_len: int,
    rope: Rope | None = None,
) -> tuple[jax.Array, Cache]:
    """DeepSeek multi-head latent attention; the cache holds the normed latent and roped key."""
    q, cache = mla_project(cfg, w, cache, x, pos, slots, rope)
    return mla_attend_cached(cfg, w, cache, q, pos, slots, kv_len), cache
