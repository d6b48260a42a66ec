"""colibri against transformers on the same tiny checkpoints: logits, incremental decode, greedy."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import tiny
from conftest import FAMILIES, VARIANTS

from colibri.engine.model import load_model
from colibri.engine.runner import Row, Runner
from colibri.model import layers, transformer
from colibri.weights import load_dense

PROMPT = "def add(a, b): The quick brown fox, naïve café 🐦"


# fp8: linear layers block-quantized (DeepSeek-V3's layout), against transformers' dequantized
# float32 weights (its CPU path); the fp8 weights move logits by ~1-4 from the float32 ones.
# int4: pack-quantized (compressed-tensors W4A16), against transformers on the weights as
# compressed-tensors decompresses them. gptq4: GPTQ (Qwen's "-GPTQ-Int4" layout), awq4: AutoAWQ
# (zero points), against transformers on the weights as the layouts give them (tiny.gptq_weight,
# tiny.awq_weight).
EXTRA = [
    ("qwen3_moe", "bfloat16"),
    ("deepseek_v3", "fp8"),
    ("qwen3_moe", "fp8"),
    ("deepseek_v3", "int4"),
    ("mixtral", "int4"),
    ("qwen2_moe", "gptq4"),
    ("mixtral", "awq4"),
    ("olmoe", "int8"),
]


@pytest.fixture(scope="module", params=FAMILIES + VARIANTS + EXTRA, ids=str)
def case(request, checkpoints):
    family, dtype = (
        request.param if isinstance(request.param, tuple) else (request.param, "float32")
    )
    if dtype in ("int4", "int8"):  # the oracle's view of them: compressed-tensors' decompression
        pytest.importorskip("compressed_tensors")
    d = checkpoints(family, dtype)
    model = load_model(d, progress=False)
    hf = tiny.hf_model(d)
    return d, model, hf


def test_full_sequence_logits_match_transformers(case):
    _, model, hf = case
    tiny.check_full_logits(model, hf, model.tokenizer.encode(PROMPT))


def test_stacked_qkv_computes_bitwise_what_three_projections_do(case):
    """load_model stacks each GQA layer's q, k, v (and biases) into one matrix: prefill and
    decode on the kernels give bitwise the logits of the three separate projections (on a GPU,
    the same within float32 rounding)."""
    _, model, _ = case
    attn = model.params["layers"][0]["attn"]
    if model.cfg.attention == "gqa":
        assert "qkv" in attn and "q" not in attn
    separate = dataclasses.replace(model, params=jax.device_put(load_dense(model.ckpt, model.cfg)))
    ids = model.tokenizer.encode(PROMPT)[:12]  # a prefill of <= 64 rows runs on the kernels

    def run(m):
        runner = Runner(m, slots=2, capacity=64)
        out = [runner.prefill(1, ids)[0]]
        for p in range(len(ids), len(ids) + 3):
            out.append(runner.decode([Row(1, 7, p), Row(0, 9, p - 8)])[0][0])
        return np.stack(out)

    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(run(model), run(separate))
    else:  # a GPU's library may sum one stacked product in another order than three apart
        np.testing.assert_allclose(run(model), run(separate), rtol=0, atol=1e-4)


def test_a_prefill_gives_bitwise_what_its_tokens_fed_one_by_one_give(case):
    """A prefill of up to NATIVE_ROWS tokens runs on the kernels, each token as it would alone:
    its last logits and every token's routes are bitwise those of the same tokens fed one at a
    time. MLA's prefill expands the cached latents through kv_b where a token alone scores
    them in the latent space: the same within float32 rounding, as on a GPU (XLA's
    products)."""
    _, model, _ = case
    ids = (model.tokenizer.encode(PROMPT) * 4)[: layers.NATIVE_ROWS]
    assert len(ids) == layers.NATIVE_ROWS
    whole = Runner(model, slots=1, capacity=128)
    logits, routes = whole.prefill(0, ids)
    one = Runner(model, slots=1, capacity=128)
    steps = [one.prefill(0, [t], start=p) for p, t in enumerate(ids)]
    last, by_one = steps[-1][0], np.concatenate([r for _, r in steps], axis=-2)
    if jax.default_backend() == "cpu" and model.cfg.attention != "mla":
        np.testing.assert_array_equal(logits, last)
        np.testing.assert_array_equal(routes, by_one)
    else:
        np.testing.assert_allclose(logits, last, rtol=0, atol=1e-4)


def test_a_rows_logits_are_the_same_alone_and_among_sixteen(case):
    _, model, _ = case
    tiny.check_rows_alone(model, model.tokenizer.encode(PROMPT))


def test_incremental_decode_matches_full_forward(case):
    _, model, _ = case
    tiny.check_incremental_decode(model, model.tokenizer.encode(PROMPT))


def test_greedy_tokens_identical_to_transformers_generate(case):
    _, model, hf = case
    tiny.check_greedy(model, hf, model.tokenizer.encode(PROMPT))


def test_every_product_asks_for_float32_precision(case):
    """JAX's default lets a GPU run a float32 product as TF32 (it did, on an H200: the logits
    missed the oracle's 1e-4): every product of a prefill longer than NATIVE_ROWS, XLA's and
    not the kernels', asks for float32 precision itself, whatever the process's setting."""
    _, model, _ = case
    runner = Runner(model, slots=1, capacity=128)
    T = 2 * layers.NATIVE_ROWS
    hlo = transformer.forward.lower(
        runner.cfg,
        model.params,
        runner.store.resident,
        runner.cache,
        np.zeros((1, T), np.int32),
        np.arange(T, dtype=np.int32)[None],
        np.zeros(1, np.int32),
        np.full(1, T - 1, np.int32),
        kv_len=128,
    ).as_text()
    dots = [line for line in hlo.splitlines() if "stablehlo.dot_general" in line]
    assert dots
    loose = [d for d in dots if "precision = [HIGHEST, HIGHEST]" not in d]
    assert not loose, loose[0]


@pytest.mark.parametrize(("family", "dtype"), [("deepseek_v3", "float32"), ("deepseek_v3", "int4")])
def test_mla_decode_in_the_latent_space_is_the_expanded_attention(family, dtype, checkpoints):
    """A decode step's MLA attention scores and weights the cached latents themselves (the
    queries taken through kv_b's key rows, the result through its value rows) instead of
    expanding every cached latent through kv_b: the same attention within float32 rounding,
    DSA's selection of positions (`keep`) and slots' own lengths included."""
    if dtype == "int4":
        pytest.importorskip("compressed_tensors")
    from colibri.model import attention

    model = load_model(checkpoints(family, dtype), progress=False)
    cfg, w = model.cfg, model.params["layers"][0]["attn"]
    m = cfg.mla
    rng = np.random.default_rng(3)
    S, C, B, kv_len = 3, 40, 2, 32
    cache = {
        "lat": jax.numpy.asarray(rng.standard_normal((S, C, m.kv_lora_rank)), "float32"),
        "kr": jax.numpy.asarray(rng.standard_normal((S, C, m.qk_rope_head_dim)), "float32"),
    }
    q = jax.numpy.asarray(rng.standard_normal((B, 1, cfg.num_heads, m.qk_head_dim)), "float32")
    slots = jax.numpy.asarray([2, 0], "int32")
    pos = jax.numpy.asarray([[29], [7]], "int32")
    keep = jax.numpy.asarray(rng.random((B, 1, kv_len)) < 0.7)
    assert attention.mla_in_latents(w, 1) and not attention.mla_in_latents(w, 2)
    for k in (None, keep):
        k_nope, v = attention.mla_expand_cached(cfg, w, cache, slots, kv_len)
        want = attention.mla_attend(cfg, w, cache, q, k_nope, v, pos, slots, kv_len, k)
        got = attention.mla_attend_latent(cfg, w, cache, q, pos, slots, kv_len, k)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("interleave", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("rest", [0, 16], ids=["full", "partial"])
def test_rope_rotates_as_transformers(interleave, rest):
    """apply_rope on rope_cos_sin's R/2 values against transformers' rotation with its cos and
    sin (the R/2 values twice): Llama's x cos + rotate_half(x) sin, DeepSeek-V3's on
    interleaved pairs, within the rounding of a product (XLA may fuse one into the sum, which
    torch rounds apart); bitwise what XLA computes for that formula as transformers
    writes it (the engine's bits before its rotation was written in halves); dims past R pass
    through."""
    import jax.numpy as jnp
    import torch
    from transformers.models.deepseek_v3 import modeling_deepseek_v3
    from transformers.models.llama import modeling_llama

    from colibri.config import RopeConfig
    from colibri.model.layers import apply_rope, rope_cos_sin

    B, T, H, R = 3, 5, 4, 32
    rng = np.random.default_rng(7)
    inv = tuple(float(f) for f in 1.0 / 10000.0 ** (np.arange(0, R, 2) / R))
    rope = RopeConfig(inv_freq=inv, attention_scaling=0.75, interleave=interleave)
    pos = rng.integers(0, 4096, (B, T)).astype(np.int32)
    x = rng.standard_normal((B, T, H, R + rest)).astype(np.float32)

    cos, sin = jax.jit(lambda p: rope_cos_sin(rope, p))(pos)
    assert cos.shape == (B, T, R // 2)
    got = np.asarray(jax.jit(lambda x, c, s: apply_rope(x, c, s, interleave))(x, cos, sin))
    assert np.array_equal(got[..., R:], x[..., R:])
    got = got[..., :R]

    c2, s2 = (np.concatenate([np.asarray(a)] * 2, -1) for a in (cos, sin))  # [B, T, R]

    def rotate_half_sum(x, c, s):  # transformers' formula, in XLA
        x = x[..., :R]
        if interleave:
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        half = jnp.concatenate([-x[..., R // 2 :], x[..., : R // 2]], axis=-1)
        return x * c[:, :, None] + half * s[:, :, None]

    before = np.asarray(jax.jit(rotate_half_sum)(x, c2, s2))
    assert np.array_equal(got.view(np.int32), before.view(np.int32))

    tx = torch.from_numpy(x[..., :R].copy()).transpose(1, 2)  # heads before positions
    tc, ts = torch.from_numpy(c2), torch.from_numpy(s2)
    if interleave:
        want = modeling_deepseek_v3.apply_rotary_pos_emb_interleave(tx, tx, tc, ts)[0]
    else:
        want = modeling_llama.apply_rotary_pos_emb(tx, tx, tc, ts)[0]
    want = want.transpose(1, 2).numpy()
    assert np.abs(got - want).max() <= np.spacing(np.abs(x).max())
    assert not np.allclose(got, x[..., :R], atol=1e-2)  # it rotated
