"""Elementwise building blocks shared by every family: RMSNorm, rotary embeddings, SwiGLU."""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from colibri import formats, kernels
from colibri.config import RopeConfig

# Every product of the model at full float32 precision, on every backend: JAX's default lets a
# GPU run float32 products as TF32, which moves logits beyond the oracle's 1e-4 and can change
# tokens. On CPU this is what XLA computes anyway.
EXACT = jax.lax.Precision.HIGHEST


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32 (on CPU by the native kernel, each row
    as it is alone: one call instead of XLA's four ops)."""
    x = x.astype(jnp.float32)
    rows = math.prod(x.shape[:-1])
    if rows > 0 and w.ndim == 1 and kernels.usable(x, w):
        return _native_rms_norm(x.reshape(rows, -1), w, eps).reshape(x.shape)
    return _xla_rms_norm(x, w, eps)


def _xla_rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    return w * (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _native_rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    return kernels.rms_norm(x, w, eps)


def _native_rms_norm_fwd(x, w, eps):
    return kernels.rms_norm(x, w, eps), (x, w)


def _native_rms_norm_bwd(eps, res, dy):  # XLA's gradient of the same norm
    x, w = res
    return jax.vjp(lambda x, w: _xla_rms_norm(x, w, eps), x, w)[1](dy)


_native_rms_norm.defvjp(_native_rms_norm_fwd, _native_rms_norm_bwd)


# Up to this many rows (a decode step of up to 16 conversations, a prefill chunk of up to 64
# tokens), linears on CPU go to the native kernel: it streams w once for all rows on every
# core, where XLA's small products cost several passes (and over held rows widen the whole
# matrix first); past it XLA's blocked products are as fast or faster
# (experiments/bench_linear_rows.py). Each row's result is what it alone gives, so such a
# prefill's tokens get bitwise what decoding them one by one gives (docs/kernels.md,
# "Prefill chunks of up to 64 tokens through the kernel").
NATIVE_ROWS = 64


def widen(w: jax.Array) -> jax.Array:
    """Float32 weights as they are; bfloat16 bits (uint16 or, for bfloat16 products, int16, as
    colibri holds a bfloat16 checkpoint's matrices: weights.hold_bf16) as the float32s they
    stand for."""
    return widen_rows(w, w.shape[-1]) if w.dtype in formats.BF16_HELD else w


def widen_rows(w: jax.Array, cols: int) -> jax.Array:
    """Weights held in any format (`formats.FORMATS`: rows of `cols` weights) as the float32
    [..., cols] they stand for."""
    fmt = formats.held(w.dtype)
    return w if fmt is None else fmt.unpack(w, cols)


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """x @ w.T (+ b), with w stored as Hugging Face does: [out, in], in any held format (the
    native kernel: bitwise what the widened weights give; XLA, which fuses the widening into
    its product: the same to float32 rounding). Weights held for bfloat16 products (BF16P)
    take x rounded to bfloat16, in both."""
    if _native_ok(x, w):
        y = _native_linear(x, w)
    else:
        x = formats.round_inputs(x, w.dtype)
        y = jnp.einsum("...i,oi->...o", x, widen_rows(w, x.shape[-1]), precision=EXACT)
    return y if b is None else y + b


def _native_ok(x: jax.Array, w: jax.Array) -> bool:
    rows = math.prod(x.shape[:-1])
    return 0 < rows <= NATIVE_ROWS and w.ndim == 2 and kernels.usable_weights(x, w)


@jax.custom_vjp
def _native_linear(x: jax.Array, w: jax.Array) -> jax.Array:
    return kernels.linear(x, w)


def _native_linear_fwd(x, w):
    return kernels.linear(x, w), (x, w)


def _native_linear_bwd(res, dy):
    x, w = res
    dx = jnp.einsum("...o,oi->...i", dy, w, precision=EXACT)
    return dx, jnp.einsum("...o,...i->oi", dy, x, precision=EXACT)


_native_linear.defvjp(_native_linear_fwd, _native_linear_bwd)


Rope = tuple[jax.Array, jax.Array]  # rotary cos and sin of each frequency, [B, T, R/2] each


def rope_cos_sin(rope: RopeConfig, pos: jax.Array) -> Rope:
    """cos and sin for integer positions [...] (e.g. [B, T]) -> two [..., R/2] (R rotated dims
    per head): one value a frequency, which both dims of its pair take."""
    inv = jnp.asarray(rope.inv_freq, jnp.float32)
    freqs = pos.astype(jnp.float32)[..., None] * inv  # [B, T, R/2]
    return jnp.cos(freqs) * rope.attention_scaling, jnp.sin(freqs) * rope.attention_scaling


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleave: bool) -> jax.Array:
    """Rotate the first R dims of each head of x [B, T, H, Dh] by cos and sin [B, T, R/2]; the
    rest passes through. Each pair (x1, x2) becomes (x1 c - x2 s, x2 c + x1 s), laid out as
    all the first then all the second: bitwise what XLA computes for transformers' x cos +
    rotate_half(x) sin, whose cos and sin hold each value twice (tests/test_oracle.py)."""
    half = cos.shape[-1]
    R = 2 * half
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    rot, rest = x[..., :R], x[..., R:]
    if interleave:
        # DeepSeek pairs (x0, x1), (x2, x3), ...; the result is laid out de-interleaved,
        # as transformers does, which is harmless because q and k get the same layout.
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
    rot = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return jnp.concatenate([rot, rest], axis=-1) if rest.shape[-1] else rot


def swiglu(x: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
    """down(silu(gate x) * up x) with HF-layout weights gate/up [F, D], down [D, F]."""
    return linear(jax.nn.silu(linear(x, w["gate"])) * linear(x, w["up"]), w["down"])
