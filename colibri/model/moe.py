"""Routers (softmax top-k, grouped softmax, grouped sigmoid) and routed-expert mixing from stacked
weights."""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from colibri import formats, kernels
from colibri.config import MoeConfig
from colibri.model.layers import EXACT, linear, swiglu, widen_rows

# Routed experts of one layer: {"gate", "up": [S, F, D], "down": [S, D, F]}. S is the number of
# resident experts (all E when fully resident, or a slot cache); indices passed in are slot ids.
# Float32, bfloat16 held as bit patterns (uint16; int16 for bfloat16 products, whose inputs
# and hidden rows are rounded to bfloat16), or quantized experts held as rows of values
# and scales (FP8 uint8, int4 int8, int4 with zero points uint32, int8 int32: rows longer or
# shorter than D or F; weights.expert_dtype), widened as used: the native kernel gives
# bitwise what the widened weights give, XLA's loops (which fuse the widening into their
# products) the same to float32 rounding.
Experts = dict[str, jax.Array]


def route(m: MoeConfig, w: dict, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Choose K experts per row of x [N, D]: (ids [N, K] int32, mixing weights [N, K])."""
    return _choose(m, w, linear(x.astype(jnp.float32), w["router"]))  # logits [N, E]


def route_traced(
    m: MoeConfig, w: dict, x: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """`route` and, per row, the entropy (bits) and top-1 minus top-2 margin of the router's
    probability distribution over all E experts: (ids, weights, entropy [N], margin [N]).

    The distribution is softmax(logits) for softmax routers (DeepSeek-V2's too: before its
    group limit); for sigmoid routers (DeepSeek-V3, GLM-4.5) it is the sigmoid scores
    normalised to sum to 1, without the selection bias (which steers the choice, never the
    weights). Only these two numbers per row leave the program, not the [N, E] distribution."""
    logits = linear(x.astype(jnp.float32), w["router"])
    ids, wts = _choose(m, w, logits)
    if m.router in ("softmax", "softmax_group"):
        probs = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    plogp = jnp.where(probs > 0, probs * jnp.log2(jnp.where(probs > 0, probs, 1.0)), 0.0)
    top2 = jax.lax.top_k(probs, min(2, probs.shape[-1]))[0]
    margin = top2[:, 0] - (top2[:, 1] if top2.shape[1] > 1 else 0.0)
    return ids, wts, -jnp.sum(plogp, axis=-1), margin


def _choose(m: MoeConfig, w: dict, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    if m.router == "softmax":
        return _route_softmax(m, logits)
    if m.router == "softmax_group":
        return _route_softmax_group(m, logits)
    return _route_sigmoid_group(m, logits, w["bias"])


def _route_softmax(m: MoeConfig, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    if logits.ndim == 2 and kernels.usable(logits):  # CPU: one call instead of ~7 ops
        return _native_route(logits, m.top_k, m.norm_topk_prob)
    probs = jax.nn.softmax(logits, axis=-1)
    top_w, top_i = jax.lax.top_k(probs, m.top_k)
    if m.norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    return top_i.astype(jnp.int32), top_w


def _chosen_weights(logits: jax.Array, ids: jax.Array, norm: bool) -> jax.Array:
    """The weights of experts ids among softmax(logits), renormalised where `norm`: the
    softmax router's weights once its choice is made (top_k's gradient is this gather's)."""
    w = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), ids, axis=-1)
    return w / jnp.sum(w, axis=-1, keepdims=True) if norm else w


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _native_route(logits: jax.Array, k: int, norm: bool) -> tuple[jax.Array, jax.Array]:
    return kernels.route_softmax(logits, k, norm)


def _native_route_fwd(logits, k, norm):
    ids, w = kernels.route_softmax(logits, k, norm)
    return (ids, w), (logits, ids)


def _native_route_bwd(k, norm, res, g):
    logits, ids = res
    _, pull = jax.vjp(lambda lg: _chosen_weights(lg, ids, norm), logits)
    return pull(g[1])


_native_route.defvjp(_native_route_fwd, _native_route_bwd)


def _route_softmax_group(m: MoeConfig, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V2 rule (transformers' DeepseekV2TopkRouter): softmax over all E experts; with
    groups, only the topk_group groups whose best expert scores highest stay in the running
    (the others' scores set to 0, not -inf, as transformers masks them); top-k of what stays,
    times routed_scaling_factor, never renormalised. "greedy" is one group."""
    N, E = logits.shape
    probs = jax.nn.softmax(logits, axis=-1)
    if m.n_group > 1:
        grouped = probs.reshape(N, m.n_group, E // m.n_group)
        _, top_groups = jax.lax.top_k(jnp.max(grouped, axis=-1), m.topk_group)  # [N, topk_group]
        keep = jnp.zeros((N, m.n_group), bool).at[jnp.arange(N)[:, None], top_groups].set(True)
        probs = jnp.where(jnp.repeat(keep, E // m.n_group, axis=1), probs, 0.0)
    top_w, top_i = jax.lax.top_k(probs, m.top_k)
    return top_i.astype(jnp.int32), top_w * m.routed_scaling_factor


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


def expert_outputs(
    experts: Experts,
    x: jax.Array,
    ids: jax.Array,
    num_experts: int,
    plan: tuple[int, int] | None = None,
    native: bool | None = None,
) -> jax.Array:
    """y [N, K, D]: expert ids[n, k] applied to x[n]; 0 where ids[n, k] == -1 (not staged).

    On CPU the native kernel (`colibri.kernels.moe_experts`) computes it when it is built and
    x is float32 (`native=None`; True insists, False keeps to the XLA loops below).
    It reads each chosen expert's weights once for all its rows, on every core, and is bitwise
    independent of batching, chunking and slots in the same way.

    The N*K assignments are sorted by expert. Each expert's rows go through in blocks of
    `block` rows (one [block, D] x [D, F] product per matrix, slabs read by a dynamic slice,
    no gather copy of weights); a remainder of fewer than `least` rows goes row by row
    (matrix-vector products). `plan` = (block, least), by default `expert_plan`. Loops run
    only the blocks and rows that exist. How a row is computed depends only on how many rows
    chose its expert in this forward and its rank among them, never on which slot or staging
    chunk the expert sits in, and padding lanes are zero rows, so outputs assembled over
    several chunks are bitwise those of one pass.
    """
    N, K = ids.shape
    S, D = experts["gate"].shape[0], x.shape[1]
    if native is None:
        native = kernels.usable_weights(x, experts["gate"], experts["up"], experts["down"])
    if native:
        return kernels.moe_experts(experts["gate"], experts["up"], experts["down"], x, ids)
    NK = N * K
    x = formats.round_inputs(x, experts["gate"].dtype)  # as bfloat16 products take it (BF16P)
    block, least = plan or expert_plan(N, K, num_experts)
    flat = ids.reshape(-1)
    key = jnp.where(flat >= 0, flat, S)  # unstaged entries sort last and are never computed
    order = jnp.argsort(key, stable=True)  # sorted position -> assignment
    skey = key[order]
    if block == 1:  # row by row, in expert order: no blocks to lay out
        return _one_by_one(experts, x, order, skey, S, K).reshape(N, K, D)
    counts = jnp.bincount(key, length=S + 1)[:S]  # rows per slot
    start = jnp.cumsum(counts) - counts  # first sorted position of each slot
    full = counts // block
    rem = counts - full * block
    padded = rem >= least  # the remainder fills one more, padded block
    nbig = full + padded
    big_end = jnp.cumsum(nbig)
    xs = jnp.concatenate([x, jnp.zeros((1, D), x.dtype)])  # row N: zeros for padding lanes
    row_of = jnp.concatenate([order // K, jnp.full((block,), N, order.dtype)])
    out = jnp.zeros((NK + block, D), x.dtype)  # sorted order, room for a padded block's tail

    # Blocks of one expert, in ascending sorted position: a padded block's tail lanes spill
    # onto the next expert's positions, which a later block or the row loop then overwrites.
    max_big = min(NK // block + min(num_experts, NK), NK) if least <= block else NK // block
    j = jnp.arange(max(max_big, 1))
    owner = jnp.minimum(jnp.searchsorted(big_end, j, side="right"), S - 1)
    rank = j - (big_end[owner] - nbig[owner])
    first = start[owner] + rank * block
    lanes = jnp.minimum(counts[owner] - rank * block, block)  # real rows in block j

    def one_block(j, out):
        lane = jnp.arange(block)
        rows = jnp.where(lane < lanes[j], row_of[first[j] + lane], N)
        y = _expert_mlp(experts, xs[rows], owner[j])
        return jax.lax.dynamic_update_slice(out, y, (first[j], 0))

    out = jax.lax.fori_loop(0, big_end[-1], one_block, out)

    # Remainders shorter than `least`: one row at a time.
    p = jnp.arange(NK)
    e = jnp.minimum(skey, S - 1)
    single = (skey < S) & ~padded[e] & (p - start[e] >= full[e] * block)
    (pos,) = jnp.nonzero(single, size=NK, fill_value=0)

    def one_row(i, out):
        q = pos[i]
        y = _expert_mlp(experts, xs[row_of[q]][None], skey[q])
        return jax.lax.dynamic_update_slice(out, y, (q, 0))

    out = jax.lax.fori_loop(0, jnp.sum(single), one_row, out)
    y = jnp.zeros((NK, D), x.dtype).at[order].set(jnp.where((skey < S)[:, None], out[:NK], 0))
    return y.reshape(N, K, D)


def _one_by_one(
    experts: Experts, x: jax.Array, order: jax.Array, skey: jax.Array, S: int, K: int
) -> jax.Array:
    """[N*K, D]: assignment order[p] computed as one row for p over the staged positions."""

    def one(p, out):
        a = order[p]
        y = _expert_mlp(experts, jax.lax.dynamic_slice_in_dim(x, a // K, 1), skey[p])
        return jax.lax.dynamic_update_slice(out, y, (a, 0))

    staged = jnp.sum(skey < S)
    return jax.lax.fori_loop(0, staged, one, jnp.zeros((order.shape[0], x.shape[1]), x.dtype))


def expert_plan(rows: int, top_k: int, num_experts: int) -> tuple[int, int]:
    """(block, least) for `expert_outputs`' XLA loops, from the rows each chosen expert can
    expect (the native CPU kernel needs no plan).

    On CPU, XLA streams a slab through a matrix-vector product at memory speed and a repeated
    expert's slabs come back from cache, while a small matrix-matrix product costs as much as
    several of them: decode batches (under 8 rows per expert) go row by row, and only prefill
    chunks use blocks (measured: experiments/bench_peers.py shapes, 1-256 rows). Elsewhere
    every row goes in a block sized to the expected rows.
    """
    per_expert = rows * top_k / min(num_experts, rows * top_k)
    grow = 1 << max(0, math.ceil(math.log2(per_expert)))
    if jax.default_backend() == "cpu":
        if per_expert < 8:
            return 1, 1
        block = min(max(grow, 8), 32)
        return block, block // 4
    return min(grow, 64), 1


def _expert_mlp(experts: Experts, x: jax.Array, slot: jax.Array) -> jax.Array:
    """SwiGLU of slot `slot` over every row of x [N, D]."""
    F, D = experts["gate"].shape[1], x.shape[1]

    def matrix(name: str, cols: int) -> jax.Array:
        a = experts[name]
        return widen_rows(jax.lax.dynamic_slice(a, (slot, 0, 0), (1, *a.shape[1:]))[0], cols)

    g, u, d = matrix("gate", D), matrix("up", D), matrix("down", F)
    # x as the products take it (rounded once by expert_outputs); h too, for bfloat16 products
    gate, up = jnp.matmul(x, g.T, precision=EXACT), jnp.matmul(x, u.T, precision=EXACT)
    h = formats.round_inputs(jax.nn.silu(gate) * up, experts["gate"].dtype)
    return jnp.matmul(h, d.T, precision=EXACT)


def combine(y: jax.Array, wts: jax.Array) -> jax.Array:
    """sum_k wts[n, k] * y[n, k]: [N, K, D], [N, K] -> [N, D], added in order of k: elementwise,
    so that XLA fuses it with what follows (an einsum was a dot of its own) and a row's bits
    do not depend on the rows beside it (docs/kernels.md, "The weighted sum of the experts")."""
    out = wts[:, 0, None] * y[:, 0]
    for k in range(1, y.shape[1]):
        out = out + wts[:, k, None] * y[:, k]
    return out


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
