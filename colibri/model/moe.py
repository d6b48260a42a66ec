"""Routers (softmax top-k, grouped sigmoid) and routed-expert mixing from stacked weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from colibri.config import MoeConfig
from colibri.model.layers import linear, swiglu

# Routed experts of one layer: {"gate", "up": [S, F, D], "down": [S, D, F]}. S is the number of
# resident experts (all E when fully resident, or a slot cache); indices passed in are slot ids.
Experts = dict[str, jax.Array]


def route(m: MoeConfig, w: dict, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Choose K experts per row of x [N, D]: (ids [N, K] int32, mixing weights [N, K])."""
    logits = linear(x.astype(jnp.float32), w["router"])  # [N, E]
    if m.router == "softmax":
        return _route_softmax(m, logits)
    return _route_sigmoid_group(m, logits, w["bias"])


def _route_softmax(m: MoeConfig, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    probs = jax.nn.softmax(logits, axis=-1)
    top_w, top_i = jax.lax.top_k(probs, m.top_k)
    if m.norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    return top_i.astype(jnp.int32), top_w


def _route_sigmoid_group(
    m: MoeConfig, logits: jax.Array, bias: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V3 rule: the bias steers which experts are chosen, never their weights."""
    N, E = logits.shape
    scores = jax.nn.sigmoid(logits)
    choice = scores + bias
    grouped = choice.reshape(N, m.n_group, E // m.n_group)
    group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N, G]: sum of its top two
    _, top_groups = jax.lax.top_k(group_score, m.topk_group)
    keep = jnp.zeros((N, m.n_group), bool).at[jnp.arange(N)[:, None], top_groups].set(True)
    keep = jnp.repeat(keep, E // m.n_group, axis=1)
    _, top_i = jax.lax.top_k(jnp.where(keep, choice, -jnp.inf), m.top_k)
    top_w = jnp.take_along_axis(scores, top_i, axis=1)
    if m.norm_topk_prob:
        top_w = top_w / (jnp.sum(top_w, axis=-1, keepdims=True) + 1e-20)
    return top_i.astype(jnp.int32), top_w * m.routed_scaling_factor


def expert_outputs(experts: Experts, x: jax.Array, ids: jax.Array, num_experts: int) -> jax.Array:
    """y [N, K, D]: expert ids[n, k] applied to x[n]; 0 where ids[n, k] == -1 (not staged).

    Each (n, k) output is computed once, by one expert, so outputs assembled over several staging
    chunks are bitwise those of one pass. Few rows gather just the chosen slabs; many rows stream
    every slot once, which reads fewer bytes as soon as N*K reaches the number of experts. The
    choice depends on the model's expert count, not on the slot count, so every placement of
    the same experts takes the same path.
    """
    N, K = ids.shape
    if N * K < num_experts:
        return _outputs_gather(experts, x, ids)
    return _outputs_dense(experts, x, ids)


def _outputs_gather(experts: Experts, x: jax.Array, ids: jax.Array) -> jax.Array:
    idx = jnp.maximum(ids, 0)
    g, u, d = (jnp.take(experts[k], idx, axis=0) for k in ("gate", "up", "down"))  # [N, K, ...]
    h = jax.nn.silu(jnp.einsum("nd,nkfd->nkf", x, g)) * jnp.einsum("nd,nkfd->nkf", x, u)
    y = jnp.einsum("nkf,nkdf->nkd", h, d)
    return jnp.where((ids >= 0)[..., None], y, 0.0)


def _outputs_dense(experts: Experts, x: jax.Array, ids: jax.Array) -> jax.Array:
    N, K = ids.shape
    S = experts["gate"].shape[0]

    def one(y, e):
        slot, g, u, d = e
        out = (jax.nn.silu(x @ g.T) * (x @ u.T)) @ d.T  # [N, D]
        return jnp.where((ids == slot)[..., None], out[:, None, :], y), None

    xs = (jnp.arange(S, dtype=ids.dtype), experts["gate"], experts["up"], experts["down"])
    y, _ = jax.lax.scan(one, jnp.zeros((N, K, x.shape[-1]), x.dtype), xs)
    return y


def combine(y: jax.Array, wts: jax.Array) -> jax.Array:
    """sum_k wts[n, k] * y[n, k]: [N, K, D], [N, K] -> [N, D]."""
    return jnp.einsum("nkd,nk->nd", y, wts)


def mix_experts(experts: Experts, x: jax.Array, ids: jax.Array, wts: jax.Array) -> jax.Array:
    """All experts resident: sum_k wts[n, k] * expert_{ids[n, k]}(x[n]) for x [N, D] -> [N, D]."""
    return combine(expert_outputs(experts, x, ids, experts["gate"].shape[0]), wts)


def shared_expert(m: MoeConfig, w: dict, x: jax.Array) -> jax.Array:
    """The always-on shared expert(s), gated by sigmoid(x @ w) in Qwen2-MoE; 0 when absent."""
    if "shared" not in w:
        return jnp.zeros_like(x)
    y = swiglu(x, w["shared"])
    if m.shared_gate:
        y = jax.nn.sigmoid(linear(x, w["shared_gate"])) * y
    return y
