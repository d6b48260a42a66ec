"""Bfloat16 products (COLIBRI_BF16=products, formats.BF16P): a bfloat16 checkpoint's matrices
times inputs rounded to bfloat16, summed in float32, as cpu/bf16p.h defines them. The kernels
against a numpy model of that order, bitwise; their products against torch's bfloat16 linear;
the engine's kernel and XLA paths against each other, and placement never changing a bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri import formats, kernels
from colibri.formats import BF16P, Holding

pytestmark = pytest.mark.skipif(not kernels.available(), reason="CPU kernels unavailable")


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits: to nearest, ties to even; subnormals to a zero of their sign;
    NaNs quiet."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    r = np.where((u & 0x7FFFFFFF) > 0x7F800000, ((u >> 16) | 0x40).astype(np.uint16), r)
    return np.where((u & 0x7F800000) == 0, ((u >> 16) & 0x8000).astype(np.uint16), r)


def value(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits as float32, subnormals as zero (the instruction's rule)."""
    f = (bits.astype(np.uint32) << 16).view(np.float32)
    return np.where((bits & 0x7F80) == 0, np.float32(0), f).astype(np.float32)


def reference(w_bits: np.ndarray, x: np.ndarray) -> np.ndarray:
    """[M, O]: x [M, L] times w [O, L] in cpu/bf16p.h's order: 16 lanes over chunks of 32
    columns, lane l adding column 2l + 1's product and then column 2l's (each product exact,
    each sum rounded), lanes l and l + 8 added, summed as hsum does, then the tail in order."""
    w, xb = value(w_bits), value(round_bf16(x))
    L = xb.shape[1]
    L32 = L // 32 * 32
    acc = np.zeros((xb.shape[0], w.shape[0], 16), np.float32)
    for c in range(0, L32, 32):
        acc = acc + xb[:, None, c + 1 : c + 32 : 2] * w[None, :, c + 1 : c + 32 : 2]
        acc = acc + xb[:, None, c : c + 32 : 2] * w[None, :, c : c + 32 : 2]
    v = acc[..., :8] + acc[..., 8:]
    s = ((v[..., 0] + v[..., 4]) + (v[..., 1] + v[..., 5])) + (
        (v[..., 2] + v[..., 6]) + (v[..., 3] + v[..., 7])
    )
    for t in range(L32, L):
        s = s + xb[:, None, t] * w[None, :, t]
    return s


def bits_of(a: np.ndarray) -> np.ndarray:
    """Random normals as bfloat16 bits (truncated)."""
    return (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


@settings(max_examples=12, deadline=None)
@given(
    rows=st.integers(1, 20),
    dim_in=st.integers(1, 140),
    dim_out=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_linear_is_the_reference_order_bitwise(rows, dim_in, dim_out, seed):
    """Every row count (one tile of up to 8 inputs, or several), column counts below, at and
    past multiples of 32 (the scalar tail): bitwise the numpy model, each row as it is alone."""
    rng = np.random.default_rng(seed)
    w = bits_of(rng.standard_normal((dim_out, dim_in)))
    x = rng.standard_normal((rows, dim_in)).astype(np.float32)
    held = jnp.asarray(w.view(BF16P.storage))
    y = np.asarray(kernels.linear(jnp.asarray(x), held))
    np.testing.assert_array_equal(y, reference(w, x))
    np.testing.assert_array_equal(np.asarray(kernels.linear(jnp.asarray(x[-1:]), held))[0], y[-1])


def test_inputs_are_rounded_as_the_instruction_rounds():
    """Through an identity matrix each output is its input rounded to bfloat16: to nearest,
    ties to even, subnormals to zero; formats.round_inputs (XLA's path) rounds the same, NaNs,
    infinities and floats past bfloat16's largest too."""
    f32 = np.float32
    special = [1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 1e-39, -1e-39, 3.3e38, -3.3e38]
    x = np.concatenate([special, np.random.default_rng(0).standard_normal(57) * 1e3]).astype(f32)
    x = np.tile(x, (2, 1))
    eye = np.eye(64, dtype=f32)
    w = bits_of(eye).view(BF16P.storage)
    y = np.asarray(kernels.linear(jnp.asarray(x), jnp.asarray(w)))
    want = (round_bf16(x).astype(np.uint32) << 16).view(f32)
    np.testing.assert_array_equal(y, want)
    assert y[0, 0] == 1.0 and y[0, 1] == 1.0 + 4 * 2**-8 and y[0, 3] == 0.0
    x[1, :4] = np.nan, np.inf, -np.inf, 3.4e38
    want = (round_bf16(x).astype(np.uint32) << 16).view(f32)
    np.testing.assert_array_equal(np.asarray(formats.round_inputs(jnp.asarray(x), w.dtype)), want)
    np.testing.assert_array_equal(np.asarray(formats.round_inputs(jnp.asarray(x), np.uint16)), x)


def test_products_are_torchs_bfloat16_linear():
    """transformers' bfloat16 linear layers (torch on the CPU: bfloat16 inputs, float32 sums,
    the result rounded to bfloat16): ours rounded to bfloat16 are the same numbers; the
    float32 products of the same weights (COLIBRI_BF16=1) differ in about half of them."""
    torch = pytest.importorskip("torch")

    def as_bf16(y) -> np.ndarray:
        return torch.from_numpy(np.array(y)).bfloat16().view(torch.int16).numpy()

    rng = np.random.default_rng(1)
    for rows, cols, outs in ((1, 2048, 256), (16, 768, 512), (5, 99, 300)):
        w = bits_of(rng.standard_normal((outs, cols)))
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        tw = torch.from_numpy((w.astype(np.uint32) << 16).view(np.float32)).bfloat16()
        theirs = torch.nn.functional.linear(torch.from_numpy(x).bfloat16(), tw)
        theirs = theirs.view(torch.int16).numpy()
        ours = as_bf16(kernels.linear(jnp.asarray(x), jnp.asarray(w.view(BF16P.storage))))
        wide = as_bf16(kernels.linear(jnp.asarray(x), jnp.asarray(w)))
        ulps = np.abs(ours.astype(np.int32) - theirs)
        assert (ours == theirs).mean() >= 0.999 and ulps.max() <= 1, (rows, cols)
        assert (wide == theirs).mean() < 0.8


def test_experts_are_the_reference_products_and_rows_stand_alone():
    """The expert kernel: gate and up over x rounded to bfloat16, silu(gate) * up in float32
    rounded to bfloat16, then down; within the rounding of silu's exp (the kernel's own) of the
    numpy model, and each row bitwise as it is alone, with unstaged ids giving zeros."""
    rng = np.random.default_rng(2)
    S, F, D, N, K = 6, 80, 99, 20, 4
    gate, up = (bits_of(rng.standard_normal((S, F, D))) for _ in "gu")
    down = bits_of(rng.standard_normal((S, D, F)) * 0.1)
    x = rng.standard_normal((N, D)).astype(np.float32)
    ids = rng.integers(0, S, (N, K)).astype(np.int32)
    ids[3, 1], ids[7, 0] = -1, S
    held = [jnp.asarray(a.view(BF16P.storage)) for a in (gate, up, down)]
    call = jax.jit(kernels.moe_experts)
    y = np.asarray(call(*held, jnp.asarray(x), jnp.asarray(ids)))
    want = np.zeros_like(y)
    for n in range(N):
        for k in range(K):
            s = ids[n, k]
            if not 0 <= s < S:
                continue
            g, u = reference(gate[s], x[n : n + 1])[0], reference(up[s], x[n : n + 1])[0]
            h = (g / (1 + np.exp(-g)) * u).astype(np.float32)
            want[n, k] = reference(down[s], h[None])[0]
    assert not y[3, 1].any() and not y[7, 0].any()
    np.testing.assert_allclose(y, want, rtol=0, atol=2e-2 * np.abs(want).max())
    assert (y == want).mean() > 0.9  # a flip of h's rounding moves only the outputs it feeds
    for n in (0, 3, 19):
        alone = call(*held, jnp.asarray(x[n : n + 1]), jnp.asarray(ids[n : n + 1]))
        np.testing.assert_array_equal(np.asarray(alone)[0], y[n])


PROMPTS = [[5, 9, 300, 17], [44, 2, 2, 81, 6, 7], list(range(3, 43))]


def _logits(d, holding: Holding, tiered: bool = False):
    model, probe = tiny.load_placed(d, tiered, holding)
    held = (model.store.held, model.params["lm_head"].dtype, model.params["final_norm"].dtype)
    out = tiny.prefill_then_decode(model, PROMPTS)
    model.store.close()
    probe.store.close()
    return held, out


def test_the_engine_computes_bfloat16_products_on_either_path(checkpoints, monkeypatch):
    """A bfloat16 checkpoint loaded with COLIBRI_BF16=products holds its matrices for bfloat16
    products (int16 bits; norms stay float32). The prefill logits with the kernels and with
    XLA's loops (kernels off) agree to float32 rounding, while both lie well away from float32
    products of the same weights: each path rounds where the other does (the odd input on a
    rounding boundary may still round apart, and then a few decode logits with it). Tiered
    placement gives bitwise the resident logits, prefill and decode."""
    d = checkpoints("qwen3_moe", "bfloat16")
    products = Holding.from_env({"COLIBRI_BF16": "products"})
    held, (pre, dec) = _logits(d, products)
    assert held == (BF16P.storage, BF16P.storage, np.float32)
    _, (pre32, _) = _logits(d, Holding())
    _, (pre_t, dec_t) = _logits(d, products, tiered=True)
    np.testing.assert_array_equal(pre_t, pre)
    np.testing.assert_array_equal(dec_t, dec)

    monkeypatch.setattr(kernels, "available", lambda: False)
    jax.clear_caches()  # programs traced with the kernels would be reused
    try:
        _, (pre_x, _) = _logits(d, products)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    gap = np.abs(pre - pre32).max()
    assert gap > 5e-3
    assert np.abs(pre - pre_x).max() < gap / 50
