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
from colibri.model import transformer
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
    ids = model.tokenizer.encode(PROMPT)[:12]  # a prefill of <= 16 rows runs on the kernels

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


def test_incremental_decode_matches_full_forward(case):
    _, model, _ = case
    tiny.check_incremental_decode(model, model.tokenizer.encode(PROMPT))


def test_greedy_tokens_identical_to_transformers_generate(case):
    _, model, hf = case
    tiny.check_greedy(model, hf, model.tokenizer.encode(PROMPT))


def test_every_product_asks_for_float32_precision(case):
    """JAX's default lets a GPU run a float32 product as TF32 (it did, on an H200: the logits
    missed the oracle's 1e-4): every product of a 32-token prefill, XLA's and not the
    kernels', asks for float32 precision itself, whatever the process's setting."""
    _, model, _ = case
    runner = Runner(model, slots=1, capacity=64)
    T = 32
    hlo = transformer.forward.lower(
        runner.cfg,
        model.params,
        runner.store.resident,
        runner.cache,
        np.zeros((1, T), np.int32),
        np.arange(T, dtype=np.int32)[None],
        np.zeros(1, np.int32),
        np.full(1, T - 1, np.int32),
        kv_len=64,
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
