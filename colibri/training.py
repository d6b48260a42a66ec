"""Training a MoE language model in colibri's parameter tree: init, loss, optimiser, saving."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from colibri.checkpoint import write_safetensors
from colibri.config import ModelConfig
from colibri.model import attention, moe
from colibri.model.layers import linear
from colibri.model.transformer import attention_block, dense_mlp_block, head, moe_route

# What is trained: the dense tree of `weights.load_dense` and the stacked experts of
# `weights.load_experts`, one entry per MoE layer, so saving is a renaming.
State = dict[str, Any]  # {"params": Params, "experts": list[moe.Experts]}
_FAMILIES = ("qwen3_moe", "olmoe")


@dataclass(frozen=True)
class LossWeights:
    """Multipliers of the auxiliary router losses added to next-token cross-entropy."""

    balance: float = 0.01  # Switch/OLMoE load balancing, per MoE layer, averaged over layers
    z: float = 0.001  # router z-loss (ST-MoE): keeps router logits small


def init_state(cfg: ModelConfig, seed: int, std: float = 0.02) -> State:
    """Weights as transformers initialises them: normal(0, std) matrices, norms at 1."""
    if cfg.family not in _FAMILIES or cfg.qkv_bias or cfg.o_bias or cfg.moe.shared_ff:
        raise ValueError(f"family={cfg.family!r}: training supports {', '.join(_FAMILIES)}")
    rng = np.random.default_rng(seed)

    def mat(*shape: int) -> np.ndarray:
        return (std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)

    D, V, F, E = cfg.hidden, cfg.vocab_size, cfg.moe.moe_ff, cfg.moe.num_experts
    params: dict[str, Any] = {"embed": mat(V, D), "layers": []}
    experts = []
    for is_moe in cfg.moe_layers:
        layer = {"ln1": _ones(D), "ln2": _ones(D), "attn": _init_attention(cfg, mat)}
        if is_moe:
            layer["moe"] = {"router": mat(E, D)}
            experts.append({"gate": mat(E, F, D), "up": mat(E, F, D), "down": mat(E, D, F)})
        else:
            layer["mlp"] = {"gate": mat(cfg.dense_ff, D), "up": mat(cfg.dense_ff, D)}
            layer["mlp"]["down"] = mat(D, cfg.dense_ff)
        params["layers"].append(layer)
    params["final_norm"] = _ones(D)
    params["lm_head"] = mat(V, D)
    return jax.device_put({"params": params, "experts": experts})


def _ones(n: int) -> np.ndarray:
    return np.ones(n, np.float32)


def _init_attention(cfg: ModelConfig, mat) -> dict[str, np.ndarray]:
    D, H, Hkv, Dh = cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    w = {"q": mat(H * Dh, D), "k": mat(Hkv * Dh, D), "v": mat(Hkv * Dh, D), "o": mat(D, H * Dh)}
    if cfg.qk_norm == "head":
        w["q_norm"], w["k_norm"] = _ones(Dh), _ones(Dh)
    elif cfg.qk_norm == "full":
        w["q_norm"], w["k_norm"] = _ones(H * Dh), _ones(Hkv * Dh)
    return w


def expert_outputs_blocked(
    experts: moe.Experts, x: jax.Array, ids: jax.Array, block: int = 64
) -> jax.Array:
    """y [N, K, D]: expert ids[n, k] applied to x[n] [N, D], each expert on its own rows only.

    The N*K assignments are sorted by expert and each expert's run is padded to whole blocks
    of `block` rows, so every block belongs to one expert (dropless, MegaBlocks-style). Unlike
    the inference loop (`moe.expert_outputs`), it gathers each block's weights, so it has a
    fixed shape and reverse-mode gradients.
    """
    N, K = ids.shape
    E, NK = experts["gate"].shape[0], N * K
    n_blocks = NK // block + E  # each expert wastes less than one block
    flat = ids.reshape(-1)  # [NK]
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=E)  # [E]
    padded = (sizes + block - 1) // block * block
    ends = jnp.cumsum(padded)
    e = flat[order]
    dest = ends[e] - padded[e] + jnp.arange(NK) - (jnp.cumsum(sizes) - sizes)[e]  # sorted -> row
    src = jnp.full((n_blocks * block,), N, jnp.int32).at[dest].set(order // K)  # N: a zero row
    owner = jnp.minimum(jnp.searchsorted(ends, jnp.arange(n_blocks) * block, side="right"), E - 1)
    rows = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[src]
    rows = rows.reshape(n_blocks, block, -1)  # [n_blocks, block, D]
    g, u, d = (experts[k][owner] for k in ("gate", "up", "down"))  # [n_blocks, F, D] ...
    h = jax.nn.silu(jnp.einsum("bcd,bfd->bcf", rows, g)) * jnp.einsum("bcd,bfd->bcf", rows, u)
    y = jnp.einsum("bcf,bdf->bcd", h, d).reshape(n_blocks * block, -1)
    row_of = jnp.zeros((NK,), jnp.int32).at[order].set(dest)  # assignment -> row
    return y[row_of].reshape(N, K, -1)


def balance_loss(probs: jax.Array, ids: jax.Array) -> jax.Array:
    """E * sum_e f_e * P_e: f_e the share of the N*K assignments, P_e the mean router prob.

    probs [N, E] (softmax over all experts), ids [N, K]. Perfect balance gives 1.
    """
    E = probs.shape[-1]
    f = jnp.bincount(ids.reshape(-1), length=E) / ids.size  # no gradient: counts
    return E * jnp.sum(f * jnp.mean(probs, axis=0))


def z_loss(logits: jax.Array) -> jax.Array:
    """Mean squared log-partition of router logits [N, E]."""
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)


def forward(cfg: ModelConfig, state: State, tokens: jax.Array) -> tuple[jax.Array, dict]:
    """Cache-free forward of tokens [B, T] -> logits [B, T, V] and router losses per MoE layer.

    The same pure layers as inference (a fresh KV cache of capacity T per layer), with the
    routed experts computed by `expert_outputs_blocked`.
    """
    params, experts = state["params"], state["experts"]
    B, T = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    slots = jnp.arange(B, dtype=jnp.int32)
    x = params["embed"][tokens]  # [B, T, D]
    bal, zs = [], []
    for lw in params["layers"]:
        cache = attention.init_layer_cache(cfg, B, T)
        x, _ = attention_block(cfg, lw, cache, x, pos, slots, T)
        if "moe" not in lw:
            x = dense_mlp_block(cfg, lw, x)
            continue
        h, ids, wts = moe_route(cfg, lw, x)  # h [N, D], ids/wts [N, K]
        logits = linear(h, lw["moe"]["router"])  # [N, E], the router's own logits again
        bal.append(balance_loss(jax.nn.softmax(logits, axis=-1), ids))
        zs.append(z_loss(logits))
        y = expert_outputs_blocked(experts[len(bal) - 1], h, ids)  # [N, K, D]
        mixed = jnp.einsum("nkd,nk->nd", y, wts) + moe.shared_expert(cfg.moe, lw["moe"], h)
        x = x + mixed.reshape(x.shape)
    return head(cfg, params, x), {"balance": jnp.stack(bal), "z": jnp.stack(zs)}


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Negative log-likelihood (nats) of each target [...] under logits [..., V]."""
    logits = logits.astype(jnp.float32)
    # a one-hot product, not take_along_axis: its gradient is a slow scatter on CPU
    picked = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), -1)
    return jax.nn.logsumexp(logits, axis=-1) - picked


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token negative log-likelihood (nats) of logits [..., V] at targets [...]."""
    return jnp.mean(token_nll(logits, targets))


def loss(
    cfg: ModelConfig, weights: LossWeights, state: State, batch: jax.Array
) -> tuple[jax.Array, dict]:
    """Total loss over batch [B, T+1] (inputs batch[:, :-1], targets batch[:, 1:]) and parts."""
    logits, aux = forward(cfg, state, batch[:, :-1])
    ce = cross_entropy(logits, batch[:, 1:])
    bal, z = jnp.mean(aux["balance"]), jnp.mean(aux["z"])
    total = ce + weights.balance * bal + weights.z * z
    return total, {"loss": total, "ce": ce, "balance": bal, "z": z}


def make_optimizer(lr: float, steps: int, warmup: int, weight_decay: float, clip: float = 1.0):
    """AdamW with linear warmup and cosine decay to lr/10; matrices decay, norms do not."""
    import optax

    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, end_value=lr / 10)
    return optax.chain(
        optax.clip_by_global_norm(clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=_matrices),
    )


def _matrices(tree):
    return jax.tree_util.tree_map(lambda a: a.ndim >= 2, tree)


def make_train_step(cfg: ModelConfig, optimizer, weights: LossWeights = LossWeights()):
    """A jitted step (state, opt_state, batch [B, T+1]) -> (state, opt_state, metrics)."""
    import optax

    grad_fn = jax.value_and_grad(lambda s, b: loss(cfg, weights, s, b), has_aux=True)

    def step(state: State, opt_state, batch: jax.Array):
        (_, metrics), grads = grad_fn(state, batch)
        updates, opt_state = optimizer.update(grads, opt_state, state)
        metrics["grad_norm"] = _global_norm(grads)
        return optax.apply_updates(state, updates), opt_state, metrics

    return jax.jit(step, donate_argnums=(0, 1))


def _global_norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree_util.tree_leaves(tree)))


def make_eval_step(cfg: ModelConfig):
    """A jitted (state, batch [B, T+1]) -> NLL (nats) of every next token [B, T]."""

    def nll(state: State, batch: jax.Array) -> jax.Array:
        logits, _ = forward(cfg, state, batch[:, :-1])
        return token_nll(logits, batch[:, 1:])

    return jax.jit(nll)


def hf_tensors(cfg: ModelConfig, state: State) -> dict[str, np.ndarray]:
    """The trained tree under Hugging Face tensor names (inverse of `weights.load_dense`)."""
    params, experts = jax.device_get(state["params"]), jax.device_get(state["experts"])
    out = {"model.embed_tokens.weight": params["embed"]}
    moe_ids = iter(range(len(experts)))
    for i, lw in enumerate(params["layers"]):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = lw["ln1"]
        out[f"{p}.post_attention_layernorm.weight"] = lw["ln2"]
        for k, v in lw["attn"].items():
            name = f"{k}_proj" if k in ("q", "k", "v", "o") else k
            out[f"{p}.self_attn.{name}.weight"] = v
        if "moe" in lw:
            out[f"{p}.mlp.gate.weight"] = lw["moe"]["router"]
            stacked = experts[next(moe_ids)]
            for e in range(cfg.moe.num_experts):
                for k in ("gate", "up", "down"):
                    out[f"{p}.mlp.experts.{e}.{k}_proj.weight"] = stacked[k][e]
        else:
            for k in ("gate", "up", "down"):
                out[f"{p}.mlp.{k}_proj.weight"] = lw["mlp"][k]
    out["model.norm.weight"] = params["final_norm"]
    out["lm_head.weight"] = params["lm_head"]
    return {k: np.asarray(v, np.float32) for k, v in out.items()}


def save_checkpoint(out: Path, raw_config: dict, state: State, eos_id: int) -> None:
    """model.safetensors (float32), config.json and generation_config.json in `out`."""
    from colibri.config import config_from_dict

    out.mkdir(parents=True, exist_ok=True)
    raw = {**raw_config, "eos_token_id": eos_id}
    write_safetensors(out / "model.safetensors", hf_tensors(config_from_dict(raw), state))
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    gen = {"eos_token_id": eos_id, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def sample_windows(
    rng: np.random.Generator, streams: list[np.ndarray], rows: int, length: int, first: int = 0
) -> np.ndarray:
    """[rows, length] token windows at random offsets; row r reads stream (first + r) % S.

    Cycling through the streams gives every domain the same share of the batches,
    whatever its size.
    """
    out = np.empty((rows, length), np.int32)
    for r in range(rows):
        s = streams[(first + r) % len(streams)]
        at = rng.integers(0, len(s) - length + 1)
        out[r] = s[at : at + length]
    return out


def even_windows(stream: np.ndarray, length: int, count: int) -> np.ndarray:
    """Up to `count` non-overlapping windows [n, length] spread evenly over a stream."""
    n = min(count, len(stream) // length)
    starts = np.linspace(0, len(stream) - length, n).astype(np.int64)
    return np.stack([stream[s : s + length] for s in starts]).astype(np.int32)
