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

    Streams each distinct chosen expert once (its slabs read by one dynamic slice, which XLA
    feeds to the matmul without a gather copy) and applies it to all N rows. Each (n, k) output
    is row n of one [N, D] x [D, F] product, whichever slot or staging chunk the expert sits
    in, so outputs assembled over several chunks are bitwise those of one pass.
    """
    N, K = ids.shape
    # The trip count depends on the model, never on the slot count: the same compiled loop
    # serves every placement. Padding entries (-1) skip their matmuls.
    U = min(num_experts, N * K)
    distinct = jnp.unique(ids, size=U, fill_value=-1)

    def one(y, e):
        def apply(y):
            out = _expert_mlp(experts, x, e)  # [N, D]
            return jnp.where((ids == e)[..., None], out[:, None, :], y)

        return jax.lax.cond(e >= 0, apply, lambda y: y, y), None

    y, _ = jax.lax.scan(one, jnp.zeros((N, K, x.shape[-1]), x.dtype), distinct)
    return y


def _expert_mlp(experts: Experts, x: jax.Array, slot: jax.Array) -> jax.Array:
    """SwiGLU of slot `slot` over every row of x [N, D]."""
    F, D = experts["gate"].shape[1:]
    g = jax.lax.dynamic_slice(experts["gate"], (slot, 0, 0), (1, F, D))[0]
    u = jax.lax.dynamic_slice(experts["up"], (slot, 0, 0), (1, F, D))[0]
    d = jax.lax.dynamic_slice(experts["down"], (slot, 0, 0), (1, D, F))[0]
    return (jax.nn.silu(x @ g.T) * (x @ u.T)) @ d.T


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
