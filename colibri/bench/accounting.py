"""The roofline's accounting: the bytes of weights, and of keys and values, one decode step
reads, and the FLOPs it computes (tests/test_bench_accounting.py checks them against
transformers, and MLA's cache against the engine's)."""

from __future__ import annotations

import numpy as np


def step_bytes(cfg, experts_per_layer: list[float], rows: int) -> float:
    """f32 bytes of weights one decode step of `rows` rows reads (each weight once)."""
    D, V = cfg.hidden, cfg.vocab_size
    q = cfg.num_heads * cfg.head_dim
    kv = 2 * cfg.num_kv_heads * cfg.head_dim
    attn = D * q + D * kv + q * D + 2 * D  # projections and norms (q/k norms are tiny)
    m = cfg.moe
    per_expert = 3 * D * m.moe_ff
    params = cfg.num_layers * (attn + D * m.num_experts)  # + router
    params += sum(e * per_expert for e in experts_per_layer)
    params += rows * D + V * D + D  # embedding rows, lm_head, final norm
    return 4.0 * params


def held_step_bytes(params: dict, stacks: list[dict], experts_per_layer: list[float]) -> float:
    """Bytes of weights one decode step of one row reads as the engine holds them (bfloat16
    bits, FP8, int4 or int8 rows with their scales, or float32): every dense array once (the
    embedding table: one row), and of each MoE layer's stacked experts ([E, ...] arrays) the
    share its chosen experts are."""
    import jax

    total = 0.0
    for key, value in params.items():  # a tied lm_head is its own key: counted whole
        for a in jax.tree_util.tree_leaves(value):
            total += a.nbytes / a.shape[0] if key == "embed" else a.nbytes
    for layer, chosen in zip(stacks, experts_per_layer, strict=True):
        for a in jax.tree_util.tree_leaves(layer):
            total += a.nbytes * chosen / a.shape[0]
    return total


def distinct_experts(steps, rows: int | None = None) -> list[float]:
    """Distinct experts the first `rows` rows (default: all) chose in each MoE layer, the mean
    over steps of routes ([n_moe, B, K] a step)."""
    return np.mean([[len(np.unique(r[:rows])) for r in step] for step in steps], axis=0).tolist()


def mean_context(prompt: int, tokens: int) -> float:
    """Positions a decode step attends over, the mean over the benchmark's steps (step i, from
    0, attends over prompt + i + 1)."""
    return prompt + (tokens + 1) / 2


def step_flops(cfg, rows: int, prompt: int, tokens: int) -> float:
    """FLOPs of one decode step of `rows` conversations: projections, routers, every routed
    expert assignment, lm_head, and attention over the mean context."""
    D, V, L = cfg.hidden, cfg.vocab_size, cfg.num_layers
    q = cfg.num_heads * cfg.head_dim
    kv = 2 * cfg.num_kv_heads * cfg.head_dim
    per_row = L * (D * q + D * kv + q * D + D * cfg.moe.num_experts) + V * D
    return (
        2.0 * rows * per_row + expert_flops(cfg, rows) + attention_flops(cfg, rows, prompt, tokens)
    )


def expert_flops(cfg, rows: int) -> float:
    """FLOPs of one decode step's routed experts: every row's every chosen expert, in every
    layer (step_flops' share of them)."""
    m = cfg.moe
    return 2.0 * rows * cfg.num_layers * m.top_k * 3 * cfg.hidden * m.moe_ff


def attention_flops(cfg, rows: int, prompt: int, tokens: int) -> float:
    """FLOPs of one decode step's attention over the mean context: each query head's scores
    and weighted values; MLA's in the absorbed form the engine decodes in (scores over a
    latent and its roped key, the latents weighed: 2 r + R a head and position; DSA's
    indexer left out)."""
    per_head = 2 * cfg.head_dim
    if cfg.mla is not None:
        per_head = 2 * cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
    per_row = cfg.num_layers * cfg.num_heads * per_head * mean_context(prompt, tokens)
    return 2.0 * rows * per_row


def kv_bytes(cfg, rows: int, prompt: int, tokens: int) -> float:
    """f32 bytes of the cache one decode step of `rows` conversations reads over the mean
    context, as the engine holds it: keys and values, or MLA's latents and roped keys (and
    DSA's indexer keys), not the keys and values they expand to."""
    import functools

    import jax

    from colibri.model.attention import init_layer_cache

    per_position = 0
    for layer in range(cfg.num_layers):
        shapes = jax.eval_shape(functools.partial(init_layer_cache, cfg, 1, 1, layer))
        per_position += sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(shapes))
    return rows * per_position * mean_context(prompt, tokens)


def streaming_bound(step: float, experts: float, stream_gb_s: float, probe_gb_s: float) -> float:
    """The most of a step's roofline (`step` bytes over the probe's rate) its kernels' own
    streaming allows: the chosen experts' `experts` bytes at `stream_gb_s`, the rest of the
    step at the probe's rate; at most 1."""
    at_best = experts / stream_gb_s + (step - experts) / probe_gb_s
    return min(1.0, step / probe_gb_s / at_best)


def part_bound(parts: dict, read_gb_s: float, rates: dict) -> float:
    """The most of the memory roofline (every part's bytes at `read_gb_s`) a step can reach
    where each of its parts (`parts`: {name: (bytes, FLOPs)}) takes the longer of reading its
    bytes and computing its FLOPs at its rate (`rates`: {name: GFLOP/s}): a part bound by its
    arithmetic lends no time to one bound by its reads (1: the reads bound every part)."""
    reading = sum(b for b, _ in parts.values()) / read_gb_s
    at_best = sum(max(b / read_gb_s, f / rates[n]) for n, (b, f) in parts.items())
    return min(1.0, reading / at_best)  # (the two sums, in their orders, may round apart)


def f32_step_parts(cfg, experts_per_layer: list[float], rows: int, prompt: int, tokens: int):
    """{part: (bytes, FLOPs)} of a decode step of `rows` rows with float32 weights: the routed
    experts the rows chose (each read once), the rest of the weights, and the keys and values
    over the mean context (step_bytes, kv_bytes and step_flops split so)."""
    weights = step_bytes(cfg, experts_per_layer, rows)
    experts = weights - step_bytes(cfg, [0.0] * len(experts_per_layer), rows)
    return step_parts(cfg, experts, weights, rows, prompt, tokens)


def step_parts(cfg, experts: float, weights: float, rows: int, prompt: int, tokens: int):
    """{part: (bytes, FLOPs)} of a decode step of `rows` rows whose routed experts' bytes are
    `experts` of the `weights` bytes of weights it reads (as held): the routed experts, the
    rest of the weights, the keys and values over the mean context."""
    attention = attention_flops(cfg, rows, prompt, tokens)
    routed = expert_flops(cfg, rows)
    return {
        "experts": (experts, routed),
        "dense": (weights - experts, step_flops(cfg, rows, prompt, tokens) - routed - attention),
        "attention": (kv_bytes(cfg, rows, prompt, tokens), attention),
    }


def part_rates(weights_gflop_s: float, attention_gflop_s: float) -> dict:
    """`part_bound`'s rates for step_parts' parts: the weights' (routed experts and the rest)
    at one rate, the keys and values at another."""
    return {"experts": weights_gflop_s, "dense": weights_gflop_s, "attention": attention_gflop_s}
