"""The native CPU kernels (colibri.kernels): built here, exact, batch-invariant, and optional.

The routed-expert kernel is tested beside XLA's loops in test_expert_loop.py.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from colibri import kernels
from colibri.checkpoint import (
    Fp8Scales,
    GroupScales,
    integer_grid,
    quantize_fp8,
    quantize_packed,
    to_f32,
)
from colibri.formats import FORMATS, INT4Z_ROWS, INT8_ROWS
from colibri.model import layers

_native = jax.jit(kernels.linear)


@settings(max_examples=12, deadline=None)
@given(
    rows=st.integers(1, 20),
    dim_in=st.integers(1, 40),
    dim_out=st.integers(1, 70),
    seed=st.integers(0, 2**16),
)
def test_linear_matches_numpy_and_rows_are_batch_invariant(rows, dim_in, dim_out, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, dim_in)).astype(np.float32)
    w = rng.standard_normal((dim_out, dim_in)).astype(np.float32)
    y = np.asarray(_native(x, w))
    np.testing.assert_allclose(
        y, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-4
    )
    for n in rng.choice(rows, min(rows, 3), replace=False):
        np.testing.assert_array_equal(np.asarray(_native(x[n : n + 1], w))[0], y[n])


@settings(max_examples=12, deadline=None)
@given(
    rows=st.integers(1, 20),
    heads=st.integers(1, 5),
    dim_in=st.integers(1, 72),
    per_head=st.integers(1, 40),
    data=st.data(),
)
# 16 rows of 512 columns (the paired tiles, two groups a pass; MLA's latents) and items of
# part of a head (256 KiB of its rows: 192 rows of 512 columns take two).
@example(rows=16, heads=3, dim_in=512, per_head=192, data=None)
def test_linear_heads_is_each_heads_linear_bitwise(rows, heads, dim_in, per_head, data):
    """kernels.linear_heads: head h's outputs bitwise kernels.linear of x[:, h] and rows
    [first, R) of w[h], read in place; each row as it is alone."""
    first = data.draw(st.integers(0, per_head - 1)) if data else per_head // 3
    rng = np.random.default_rng(rows * 1000 + heads * 100 + dim_in + per_head)
    x = rng.standard_normal((rows, heads, dim_in)).astype(np.float32)
    w = rng.standard_normal((heads, per_head, dim_in)).astype(np.float32)
    f = jax.jit(kernels.linear_heads, static_argnames="first")
    y = np.asarray(f(x, w, first=first))
    assert y.shape == (rows, heads, per_head - first)
    each = [np.asarray(_native(x[:, h], w[h, first:])) for h in range(heads)]
    np.testing.assert_array_equal(y, np.stack(each, axis=1))
    np.testing.assert_array_equal(np.asarray(f(x[-1:], w, first=first))[0], y[-1])


@settings(max_examples=12, deadline=None)
@given(
    rows=st.integers(1, 20),
    heads=st.integers(1, 5),
    dim_in=st.integers(1, 40),
    cols=st.integers(1, 140),
    data=st.data(),
)
# 16 rows of MLA's shape: 128 of a head's rows of 512 columns weighed.
@example(rows=16, heads=2, dim_in=128, cols=512, data=None)
def test_linear_heads_t_is_each_columns_multiply_add_chain(rows, heads, dim_in, cols, data):
    """kernels.linear_heads_t: y[m, h, c] one multiply-add chain over w's rows first .. first
    + I of head h in order, from zero (float32 multiply-adds, modelled exactly in float64),
    bitwise; each row as it is alone."""
    first = data.draw(st.integers(0, 7)) if data else 3
    rng = np.random.default_rng(rows * 1000 + heads * 100 + dim_in + cols)
    x = rng.standard_normal((rows, heads, dim_in)).astype(np.float32)
    w = rng.standard_normal((heads, first + dim_in + 2, cols)).astype(np.float32)
    f = jax.jit(kernels.linear_heads_t, static_argnames="first")
    y = np.asarray(f(x, w, first=first))
    want = np.zeros((rows, heads, cols), np.float32)
    for i in range(dim_in):  # a float32 product is exact in float64: one rounding, as an FMA
        step = x[:, :, i, None].astype(np.float64) * w[None, :, first + i].astype(np.float64)
        want = (step + want).astype(np.float32)
    np.testing.assert_array_equal(y, want)
    np.testing.assert_array_equal(np.asarray(f(x[-1:], w, first=first))[0], y[-1])


@pytest.mark.parametrize("fmt", [f for f in FORMATS if not f.bf16_inputs], ids=lambda f: f.name)
def test_the_heads_products_over_held_rows_are_those_over_the_widened_rows(fmt):
    """MLA's kv_b as checkpoints hold it: both per-head products over held rows (FP8 with
    scales of 2^8 and more among them, int4, int8 and bfloat16) bitwise the same products
    over the rows widened to float32 beforehand (layers.widen_rows)."""
    rng = np.random.default_rng(7)
    heads, per_head, cols, rows = 3, 24, 64, 16
    held = _held_rows(fmt, rng, heads * per_head, cols)
    if fmt.zero_points:  # offsets -z s, exact products, as checkpoints' rows are made
        values = rng.integers(0, 256, (heads * per_head, cols * fmt.value_bits // 8), np.uint8)
        scales = (rng.integers(1, 64, (heads * per_head, cols // 8)) / 1024).astype(np.float32)
        zeros = rng.integers(0, 2**fmt.value_bits, scales.shape).astype(np.float32)
        held = fmt.pack(values, scales, -zeros * scales).reshape(heads * per_head, -1)
    if fmt.name == "fp8":  # some blocks' scales huge: widened in two exact steps
        scales = held.view(np.uint8)[:, cols:].view(np.float32)
        scales[::5] *= 4096.0
    wide = np.asarray(layers.widen_rows(jnp.asarray(held), cols)).reshape(heads, per_head, cols)
    held = held.reshape(heads, per_head, -1)
    x = rng.standard_normal((rows, heads, cols)).astype(np.float32)
    xt = rng.standard_normal((rows, heads, 10)).astype(np.float32)
    for f, args in ((kernels.linear_heads, (x, 9)), (kernels.linear_heads_t, (xt, 5))):
        kw = {} if f is kernels.linear_heads else {"cols": cols}
        got = f(args[0], jnp.asarray(held), first=args[1], **kw)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(f(args[0], wide, first=args[1])))


def test_the_heads_products_refuse_rows_past_the_heads():
    x, w = jnp.ones((2, 3, 8)), jnp.ones((3, 5, 8))
    with pytest.raises(Exception, match="colibri_linear_heads: shapes disagree"):
        jax.block_until_ready(kernels.linear_heads(x, w[:, :, :4], first=0))
    call = jax.ffi.ffi_call("colibri_linear_heads", jax.ShapeDtypeStruct((2, 3, 4), jnp.float32))
    with pytest.raises(Exception, match="colibri_linear_heads: shapes disagree"):
        jax.block_until_ready(call(x, w, first=np.int64(2)))  # rows 2 .. 6 of 5
    x = jnp.ones((2, 3, 4))  # four rows of each head weighed, from row 2 on: 2 .. 6 of 5
    with pytest.raises(Exception, match="colibri_linear_heads_t: shapes disagree"):
        jax.block_until_ready(kernels.linear_heads_t(x, w, first=2))


# Rows of the held-linear tests: decode's few, and either side of NATIVE_ROWS (the native
# kernel up to it, XLA's products past it).
LINEAR_ROWS = st.integers(1, 20) | st.integers(layers.NATIVE_ROWS - 2, layers.NATIVE_ROWS + 3)


def _held_linear_is_widened_linear(x: np.ndarray, held: np.ndarray, wide: np.ndarray) -> None:
    """Up to NATIVE_ROWS rows (the native kernel) the linear over weights `held` as bf16 bits,
    FP8 or int4 rows is bitwise the linear over `wide`, the float32 they stand for, each row as
    it is alone; more rows (XLA) the same to float32 rounding."""
    f = jax.jit(layers.linear)
    y, want = np.asarray(f(x, held)), np.asarray(f(x, wide))
    if x.shape[0] <= layers.NATIVE_ROWS:
        assert layers._native_ok(jnp.asarray(x), jnp.asarray(held))
        np.testing.assert_array_equal(y, want)
        np.testing.assert_array_equal(np.asarray(f(x[-1:], held))[0], y[-1])
    else:
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(want).max()))


@settings(max_examples=10, deadline=None)
@given(
    rows=LINEAR_ROWS,
    dim_in=st.integers(1, 40),
    dim_out=st.integers(1, 70),
    seed=st.integers(0, 2**16),
)
def test_linear_over_bfloat16_bits_is_linear_over_the_widened_weights(rows, dim_in, dim_out, seed):
    """Weights held as bfloat16 bits: up to NATIVE_ROWS rows (the native kernel) bitwise what
    the same weights widened to float32 give, each row as it is alone; more rows (XLA) the same
    to float32 rounding."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, dim_in)).astype(np.float32)
    bits = rng.standard_normal((dim_out, dim_in)).astype(np.float32).view(np.uint32) >> 16
    bits = bits.astype(np.uint16)
    wide = to_f32(bits, "BF16")
    _held_linear_is_widened_linear(x, bits, wide)


@settings(max_examples=10, deadline=None)
@given(
    rows=LINEAR_ROWS,
    blocks=st.integers(1, 5),
    block=st.sampled_from([8, 16, 32, 128]),
    dim_out=st.integers(1, 70),
    seed=st.integers(0, 2**16),
)
# Blocks of whole cache lines of values at one to four rows (row pairs a line at a time).
@example(rows=1, blocks=2, block=128, dim_out=9, seed=1)
@example(rows=3, blocks=1, block=128, dim_out=13, seed=2)
def test_linear_over_fp8_rows_is_linear_over_the_dequantized_weights(
    rows, blocks, block, dim_out, seed
):
    """Weights held as FP8 rows (e4m3 values, then block scales): up to NATIVE_ROWS rows (the native
    kernel) bitwise what the dequantized float32 weights give, each row as it is alone; more
    rows (XLA) the same to float32 rounding. Some blocks' scales are 2^8 or more (two exact
    steps instead of one folded scale), beside rows whose scales are not."""
    rng = np.random.default_rng(seed)
    dim_in = blocks * block
    x = rng.standard_normal((rows, dim_in)).astype(np.float32)
    w = rng.standard_normal((dim_out, dim_in)).astype(np.float32)
    w[rng.random(w.shape) < 0.2] *= 1e-4  # fp8 subnormals and zeros
    bits, scale_inv = quantize_fp8(w, (block, block))
    scale_inv[rng.random(scale_inv.shape) < 0.3] *= np.float32(2.0**16)
    scales = Fp8Scales(scale_inv, 0, block, block, dim_in)
    packed = scales.pack(bits.reshape(-1)).reshape(dim_out, -1)
    wide = scales.dequantize(bits)
    _held_linear_is_widened_linear(x, packed, wide)


@settings(max_examples=10, deadline=None)
@given(
    rows=LINEAR_ROWS,
    groups=st.integers(1, 5),
    group=st.sampled_from([8, 16, 32, 64, 128]),
    dim_out=st.integers(1, 70),
    seed=st.integers(0, 2**16),
)
@example(rows=1, groups=2, group=128, dim_out=9, seed=1)
@example(rows=3, groups=2, group=128, dim_out=13, seed=2)
@example(rows=2, groups=4, group=32, dim_out=11, seed=3)  # lane by lane in half groups
def test_linear_over_int4_rows_is_linear_over_the_dequantized_weights(
    rows, groups, group, dim_out, seed
):
    """Weights held as int4 rows (four-bit values two a byte, then group scales; with zero
    points, words of values, scales and offsets): up to NATIVE_ROWS rows (the native kernel) bitwise
    what the dequantized float32 weights give, each row as it is alone; more rows (XLA) the
    same to float32 rounding."""
    rng = np.random.default_rng(seed)
    dim_in = groups * group
    x = rng.standard_normal((rows, dim_in)).astype(np.float32)
    w = rng.standard_normal((dim_out, dim_in)).astype(np.float32)
    packed, scale, _ = quantize_packed(w, 4, group)
    scales = GroupScales(scale, np.arange(dim_in) // group, 4, dim_in, group)
    raw = packed.view(np.uint8).reshape(-1)
    held, wide = scales.pack(raw).reshape(dim_out, -1), scales.dequantize(raw).reshape(w.shape)
    assert held.dtype == np.int8 and held.shape == (dim_out, dim_in // 2 + 4 * groups)
    _held_linear_is_widened_linear(x, held, wide)
    # Zero points (GPTQ's asymmetric grid), held as INT4Z_ROWS.
    q, zero, scale, _ = integer_grid(w + rng.uniform(-1, 1, (dim_out, 1)), 4, group, sym=False)
    u = q.astype(np.uint8)
    raw = np.ascontiguousarray(u[:, 0::2] | (u[:, 1::2] << 4)).reshape(-1)
    scales = GroupScales(scale, np.arange(dim_in) // group, 4, dim_in, group, zero - 8)
    held, wide = scales.pack(raw, INT4Z_ROWS), scales.dequantize(raw).reshape(w.shape)
    held = held.reshape(dim_out, -1)
    assert held.dtype == np.uint32 and held.shape == (dim_out, dim_in // 8 + 2 * groups)
    _held_linear_is_widened_linear(x, held, wide)


@settings(max_examples=8, deadline=None)
@given(
    rows=LINEAR_ROWS,
    groups=st.integers(1, 5),
    group=st.sampled_from([8, 16, 32, 128]),
    dim_out=st.integers(1, 70),
    sym=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(rows=1, groups=2, group=128, dim_out=9, sym=True, seed=1)
@example(rows=3, groups=1, group=128, dim_out=13, sym=False, seed=2)
def test_linear_over_int8_rows_is_linear_over_the_dequantized_weights(
    rows, groups, group, dim_out, sym, seed
):
    """Weights held as int8 rows (bytes of values four a word, group scales, offsets):
    compressed-tensors' symmetric ones (zero point 128) and GPTQ's asymmetric grid, up to
    NATIVE_ROWS rows (the native kernel) bitwise what the dequantized float32 weights give,
    each row as it is alone; more rows (XLA) the same to float32 rounding."""
    rng = np.random.default_rng(seed)
    dim_in = groups * group
    x = rng.standard_normal((rows, dim_in)).astype(np.float32)
    w = rng.standard_normal((dim_out, dim_in)).astype(np.float32)
    if sym:
        packed, scale, _ = quantize_packed(w, 8, group)
        raw, zeros = packed.view(np.uint8).reshape(-1), None
    else:
        q, zero, scale, _ = integer_grid(w + rng.uniform(-1, 1, (dim_out, 1)), 8, group, False)
        raw, zeros = q.astype(np.uint8).reshape(-1), zero - 128
    scales = GroupScales(scale, np.arange(dim_in) // group, 8, dim_in, group, zeros)
    assert scales.held == INT8_ROWS
    held = scales.pack(raw, INT8_ROWS).reshape(dim_out, -1)
    wide = scales.dequantize(raw).reshape(w.shape)
    assert held.dtype == np.int32 and held.shape == (dim_out, dim_in // 4 + 2 * groups)
    _held_linear_is_widened_linear(x, held, wide)


def test_linear_keeps_leading_axes_and_bias():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 24)).astype(np.float32)
    w = rng.standard_normal((40, 24)).astype(np.float32)
    b = rng.standard_normal(40).astype(np.float32)
    assert layers._native_ok(jnp.asarray(x), jnp.asarray(w))  # 6 rows: the native path
    y = np.asarray(jax.jit(layers.linear)(x, w, b))
    assert y.shape == (2, 3, 40)
    np.testing.assert_allclose(y, x @ w.T + b, rtol=1e-5, atol=1e-5)


def test_linear_routes_by_rows_and_dtype():
    w = jnp.zeros((8, 4), jnp.float32)
    assert layers._native_ok(jnp.zeros((layers.NATIVE_ROWS, 4)), w)
    assert not layers._native_ok(jnp.zeros((layers.NATIVE_ROWS + 1, 4)), w)  # prefill: XLA
    assert not layers._native_ok(jnp.zeros((1, 4), jnp.bfloat16), w.astype(jnp.bfloat16))


def test_linear_gradient_is_the_matrix_product_gradient():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((4, 12)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((9, 12)).astype(np.float32))
    t = jnp.asarray(rng.standard_normal((4, 9)).astype(np.float32))

    def loss(f):
        return lambda x, w: jnp.sum((f(x, w) - t) ** 2)

    got = jax.grad(loss(layers.linear), argnums=(0, 1))(x, w)
    want = jax.grad(loss(lambda x, w: x @ w.T), argnums=(0, 1))(x, w)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_calls_shared_among_threads_equal_each_row_alone():
    """Calls big enough to be shared out among XLA's threads (over ~512 KiB of work; the test
    models' calls are smaller and run on the caller alone), with ragged last slices: each row
    is bitwise what the row alone gives (for attention, a call small enough to run alone)."""
    rng = np.random.default_rng(3)
    f32 = np.float32
    x = rng.standard_normal((16, 260)).astype(f32)
    w = rng.standard_normal((1030, 260)).astype(f32)
    y = np.asarray(_native(x, w))
    np.testing.assert_allclose(y, x.astype(np.float64) @ w.T, rtol=1e-4, atol=1e-3)
    for n in (0, 7, 15):
        np.testing.assert_array_equal(np.asarray(_native(x[n : n + 1], w))[0], y[n])

    S, F, D, K = 12, 136, 130, 4
    gate, up = (rng.standard_normal((S, F, D)).astype(f32) * 0.1 for _ in range(2))
    down = rng.standard_normal((S, D, F)).astype(f32) * 0.1
    ids = rng.integers(0, S, (16, K)).astype(np.int32)
    xe = rng.standard_normal((16, D)).astype(f32)
    _experts_are_each_row_alone(gate, up, down, xe, ids, (0, 9))

    C, Hkv, G, Dh = 300, 2, 2, 64
    k, v = (rng.standard_normal((16, Hkv, C, Dh)).astype(f32) for _ in range(2))
    q = rng.standard_normal((16, Hkv * G, Dh)).astype(f32)
    slots, pos = np.arange(16, dtype=np.int32), rng.integers(150, C, 16).astype(np.int32)
    attend = jax.jit(kernels.attend, static_argnums=5)
    got = np.asarray(attend(q, k, v, slots, pos, 0.125))
    for b in (0, 5, 15):
        alone = attend(q[b : b + 1], k, v, slots[b : b + 1], pos[b : b + 1], 0.125)
        np.testing.assert_array_equal(np.asarray(alone)[0], got[b])


def test_an_experts_items_on_both_threads_share_its_packed_inputs():
    """Sixteen rows on one expert whose hidden rows take three work items: the caller and the
    helper start on items of the same expert, and its inputs, packed by whichever item starts
    first (the other waits for them), must be those of its rows. Each row is bitwise what it
    gives alone (unpacked), over several calls, the two threads racing."""
    rng = np.random.default_rng(5)
    f32 = np.float32
    S, F, D = 2, 1100, 130  # 504 rows of gate and up an item: three items
    gate, up = (rng.standard_normal((S, F, D)).astype(f32) * 0.1 for _ in range(2))
    down = rng.standard_normal((S, D, F)).astype(f32) * 0.1
    for trial in range(6):
        x = rng.standard_normal((16, D)).astype(f32)
        ids = np.full((16, 1), trial % 2, np.int32)
        _experts_are_each_row_alone(gate, up, down, x, ids, (0, 15))


_experts = jax.jit(kernels.moe_experts)


def _experts_are_each_row_alone(gate, up, down, x, ids, rows) -> None:
    """The expert kernel on every row of x: the SwiGLU experts' products (numpy), and each of
    `rows` bitwise what it gives alone."""
    y = np.asarray(_experts(gate, up, down, x, ids))
    h = np.einsum("nd,nkfd->nkf", x, gate[ids]), np.einsum("nd,nkfd->nkf", x, up[ids])
    ref = np.einsum("nkf,nkdf->nkd", h[0] / (1 + np.exp(-h[0])) * h[1], down[ids])
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)
    for n in rows:
        alone = _experts(gate, up, down, x[n : n + 1], ids[n : n + 1])
        np.testing.assert_array_equal(np.asarray(alone)[0], y[n])


def test_kernels_can_be_turned_off():
    env = dict(os.environ, COLIBRI_CPU_KERNELS="0")
    code = (
        "import jax.numpy as jnp\n"
        "from colibri import kernels\n"
        "from colibri.model import layers\n"
        "assert not kernels.available()\n"
        "assert not layers._native_ok(jnp.zeros((1, 4)), jnp.zeros((8, 4)))\n"
        "print('off')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "off"


def test_build_is_cached_and_atomic(tmp_path, monkeypatch):
    """Each source folder gets one library in the cache folder, named by a key of the content of
    its every .cc and .h file: found, not rebuilt, the next time (given the folder or its cpu.cc);
    another revision, of cpu.cc or of a header, gets its own; a source that does not compile
    leaves nothing behind. The engine's library is built this way once (before the suite) and
    the one loaded is the one found."""
    lib = kernels._library()
    assert lib is not None and Path(lib._name) == kernels.build()
    assert kernels.build(kernels.SOURCE) == kernels.build(kernels.SOURCE_DIR) == kernels.build()
    monkeypatch.setenv("COLIBRI_KERNEL_CACHE", str(tmp_path))
    folder = tmp_path / "src"
    folder.mkdir()
    source, header = folder / "cpu.cc", folder / "answer.h"
    header.write_text("constexpr int kAnswer = 42;\n")
    source.write_text('#include "answer.h"\nextern "C" int colibri_answer() { return kAnswer; }\n')
    first = kernels.build(folder)
    assert first.parent == tmp_path and first.suffix == ".so"
    assert ctypes.CDLL(str(first)).colibri_answer() == 42
    built = first.stat().st_mtime_ns
    (folder / "notes.txt").write_text("not a source file\n")
    assert kernels.build(folder) == kernels.build(source) == first  # found
    assert first.stat().st_mtime_ns == built
    header.write_text("constexpr int kAnswer = 43;\n")
    second = kernels.build(folder)
    assert second.parent == tmp_path and second != first
    assert ctypes.CDLL(str(second)).colibri_answer() == 43
    source.write_text(source.read_text() + "// another revision\n")
    third = kernels.build(source)
    assert third not in (first, second)
    source.write_text("not C++\n")
    with pytest.raises(RuntimeError, match="failed"):
        kernels.build(folder)
    with pytest.raises(FileNotFoundError):
        kernels.build(tmp_path / "nowhere")
    kept = [first.name, second.name, third.name, "src"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)


def test_builds_started_together_compile_once(tmp_path, monkeypatch):
    """Builds of one library started at once (the processes of a fresh machine) wait for the
    first: the compiler runs once, every caller gets the library, and no lock file stays."""
    from concurrent.futures import ThreadPoolExecutor

    cache, runs = tmp_path / "cache", tmp_path / "runs"
    monkeypatch.setenv("COLIBRI_KERNEL_CACHE", str(cache))
    cxx = tmp_path / "cxx"
    cxx.write_text(f'#!/bin/sh\necho run >> {runs}\nsleep 1\nexec {kernels.compiler()} "$@"\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "cpu.cc").write_text('extern "C" int colibri_answer() { return 42; }\n')
    with ThreadPoolExecutor(3) as pool:
        libs = list(pool.map(lambda _: kernels.build(folder), range(3)))
    assert len(set(libs)) == 1 and ctypes.CDLL(str(libs[0])).colibri_answer() == 42
    assert runs.read_text().split() == ["run"]
    assert [p.name for p in cache.iterdir()] == [libs[0].name]


# ffi::DataType of a held format's buffers (cpu/formats.h) -> the dtype colibri stores it as.
_BUFFER_DTYPES = {
    "F32": "<f4",
    "U16": "<u2",
    "S16": "<i2",
    "U8": "u1",
    "S8": "i1",
    "U32": "<u4",
    "S32": "<i4",
}


def _held_formats_in_cpp() -> list[tuple[str, str, str, str]]:
    """The lines X(Name, suffix, buffer, T) of COLIBRI_HELD_FORMATS in cpu/formats.h."""
    text = (kernels.SOURCE_DIR / "formats.h").read_text()
    found = re.search(r"#define COLIBRI_HELD_FORMATS\(X\)((?:.*\\\n)*.*)", text)
    assert found, "no COLIBRI_HELD_FORMATS in cpu/formats.h"
    return re.findall(r"X\(\s*(\w*)\s*,\s*(\w*)\s*,\s*(\w+)\s*,\s*(\w+)\s*\)", found.group(1))


def test_the_kernels_hold_the_formats_colibri_formats_lists():
    """The C++ list of held formats, from which cpu.cc defines each one's handlers, is
    colibri.formats.FORMATS in its order: the same target suffixes, the symbol names the
    Python side derives from them, buffers of the dtype each format is stored in."""
    cpp = _held_formats_in_cpp()
    assert len(cpp) == len(FORMATS)
    assert [(name, suffix) for name, suffix, _, _ in cpp] == [
        (kernels.symbol_suffix(f.suffix), f.suffix) for f in FORMATS
    ]
    assert [np.dtype(_BUFFER_DTYPES[buffer]) for _, _, buffer, _ in cpp] == [
        f.storage for f in FORMATS
    ]


def test_the_registered_targets_are_those_the_formats_make():
    """An expert, a linear and MLA's two per-head products' targets per held format, attention
    (alone, with the cache write, and MLA's over the latents), the softmax router's choice,
    RMSNorm, the greedy choice and the cut flag: each one a handler the library exports, and
    it exports no handler that is not registered."""
    made = {"colibri_attend", "colibri_attend_write", "colibri_route_softmax"}
    made |= {"colibri_rms_norm", "colibri_greedy", "colibri_cut_requested"}
    made.add("colibri_mla_attend")
    per_format = ("colibri_moe_experts", "colibri_linear", "colibri_linear_heads")
    made |= {k + f.suffix for f in FORMATS for k in (*per_format, "colibri_linear_heads_t")}
    assert set(kernels._TARGETS) == made and len(made) == 4 * len(FORMATS) + 7
    lib = kernels._library()
    assert lib is not None
    assert all(hasattr(lib, symbol) for symbol in kernels._TARGETS.values())
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm to list the library's symbols")
    listed = subprocess.run(
        [nm, "-D", "--defined-only", lib._name], capture_output=True, text=True, check=True
    ).stdout
    exported = {line.split()[-1] for line in listed.splitlines() if line.strip()}
    assert {s for s in exported if s.startswith("Colibri")} == set(kernels._TARGETS.values())


@settings(max_examples=16, deadline=None)
@given(
    rows=st.integers(1, 6),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 10),
    head_dim=st.one_of(st.integers(1, 20), st.sampled_from([64, 72, 100, 128])),
    capacity=st.integers(1, 80),
    seed=st.integers(0, 2**16),
)
def test_attend_matches_masked_softmax(rows, kv_heads, group, head_dim, capacity, seed):
    """Decode attention from the cache in place: positions 0..pos of each row's slot, GQA
    groups (of more than four heads: the paired tiles, in AVX-512 builds; of more than eight:
    two groups of them), padding rows (slot out of range) give zeros; positions over several
    of the values' blocks; each row alone is bitwise the same."""
    rng = np.random.default_rng(seed)
    S, C, H = 4, capacity, kv_heads * group
    k = rng.standard_normal((S, kv_heads, C, head_dim)).astype(np.float32)
    v = rng.standard_normal((S, kv_heads, C, head_dim)).astype(np.float32)
    q = rng.standard_normal((rows, H, head_dim)).astype(np.float32)
    slots = rng.integers(0, S + 1, rows).astype(np.int32)  # S: a padding row
    pos = rng.integers(0, C, rows).astype(np.int32)
    scale = 1 / np.sqrt(head_dim)
    got = np.asarray(jax.jit(kernels.attend, static_argnums=5)(q, k, v, slots, pos, scale))
    for b in range(rows):
        if slots[b] == S:
            assert not got[b].any()
            continue
        for h in range(H):
            keys = k[slots[b], h // group, : pos[b] + 1].astype(np.float64)
            vals = v[slots[b], h // group, : pos[b] + 1].astype(np.float64)
            s = keys @ q[b, h] * scale
            p = np.exp(s - s.max())
            np.testing.assert_allclose(got[b, h], p @ vals / p.sum(), rtol=1e-4, atol=1e-5)
        alone = kernels.attend(q[b : b + 1], k, v, slots[b : b + 1], pos[b : b + 1], scale)
        np.testing.assert_array_equal(np.asarray(alone)[0], got[b])


@settings(max_examples=12, deadline=None)
@given(
    rows=st.integers(1, 6),
    heads=st.sampled_from([1, 3, 8, 12, 16, 24, 32]),
    latent=st.sampled_from([8, 16, 24, 32, 40, 64, 512]),
    rope=st.sampled_from([8, 16, 64]),
    capacity=st.integers(1, 60),
    masked=st.booleans(),
    seed=st.integers(0, 2**16),
)
# DeepSeek-V3's latents and roped keys: a row's 16 heads an item (one row, two threads), and
# 32 heads over more than one block of keys and of the values' strips (several rows).
@example(rows=1, heads=16, latent=512, rope=64, capacity=40, masked=True, seed=1)
@example(rows=3, heads=32, latent=512, rope=64, capacity=130, masked=False, seed=2)
def test_mla_attend_matches_masked_softmax(rows, heads, latent, rope, capacity, masked, seed):
    """Latent attention from the cache in place: each head's scores its latent query against
    the latents plus its roped query against the roped keys, over positions 0..pos of the
    row's slot (those `keep` keeps, where given), weighing the latents; padding rows (slot out
    of range) give zeros; each row alone is bitwise the same (heads in more than one group of
    the paired tiles: two groups a tile, a last odd one alone)."""
    rng = np.random.default_rng(seed)
    S, C = 4, capacity
    lat = rng.standard_normal((S, C, latent)).astype(np.float32)
    kr = rng.standard_normal((S, C, rope)).astype(np.float32)
    q = rng.standard_normal((rows, heads, latent)).astype(np.float32)
    qr = rng.standard_normal((rows, heads, rope)).astype(np.float32)
    slots = rng.integers(0, S + 1, rows).astype(np.int32)  # S: a padding row
    pos = rng.integers(0, C, rows).astype(np.int32)
    keep = rng.random((rows, C)) < 0.5 if masked else None
    if masked:
        keep[np.arange(rows), pos] = True
    scale = 1 / np.sqrt(latent + rope)
    f = jax.jit(kernels.mla_attend, static_argnums=6)
    got = np.asarray(f(q, qr, lat, kr, slots, pos, scale, keep))
    for b in range(rows):
        if slots[b] == S:
            assert not got[b].any()
            continue
        n = pos[b] + 1
        lats, keys = lat[slots[b], :n].astype(np.float64), kr[slots[b], :n].astype(np.float64)
        s = (lats @ q[b].T.astype(np.float64) + keys @ qr[b].T.astype(np.float64)) * scale
        if masked:
            s = np.where(keep[b, :n, None], s, -np.inf)
        p = np.exp(s - s.max(axis=0))
        np.testing.assert_allclose(
            got[b], (p.T @ lats) / p.sum(axis=0)[:, None], rtol=1e-4, atol=1e-5
        )
        one = keep[b : b + 1] if masked else None
        alone = f(
            q[b : b + 1], qr[b : b + 1], lat, kr, slots[b : b + 1], pos[b : b + 1], scale, one
        )
        np.testing.assert_array_equal(np.asarray(alone)[0], got[b])


def test_mla_attend_over_chunks_of_positions():
    """Past one chunk of positions (256), each head's softmax runs chunk by chunk: the sums so
    far rescaled where a later chunk holds a larger score, chunks whose positions DSA's
    selection drops all left out; the result a softmax over every position kept, each row
    bitwise as alone."""
    rng = np.random.default_rng(5)
    S, C, H, r, R = 3, 700, 16, 64, 16
    lat = rng.standard_normal((S, C, r)).astype(np.float32)
    kr = rng.standard_normal((S, C, R)).astype(np.float32)
    lat[1, 600] *= 3  # row 1's largest scores in its third chunk
    q = rng.standard_normal((3, H, r)).astype(np.float32)
    qr = rng.standard_normal((3, H, R)).astype(np.float32)
    slots, pos = np.array([0, 1, 2], np.int32), np.array([699, 650, 300], np.int32)
    keep = rng.random((3, C)) < 0.5
    keep[0, :256] = False  # row 0: its first chunk dropped whole
    keep[1] = True
    keep[np.arange(3), pos] = True
    scale = 0.3
    got = np.asarray(kernels.mla_attend(q, qr, lat, kr, slots, pos, scale, keep))
    for b in range(3):
        n = pos[b] + 1
        lats, keys = lat[slots[b], :n].astype(np.float64), kr[slots[b], :n].astype(np.float64)
        sc = (lats @ q[b].T.astype(np.float64) + keys @ qr[b].T.astype(np.float64)) * scale
        sc = np.where(keep[b, :n, None], sc, -np.inf)
        w = np.exp(sc - sc.max(axis=0))
        want = (w.T @ lats) / w.sum(axis=0)[:, None]
        np.testing.assert_allclose(got[b], want, rtol=1e-4, atol=1e-5)
        alone = kernels.mla_attend(
            q[b : b + 1],
            qr[b : b + 1],
            lat,
            kr,
            slots[b : b + 1],
            pos[b : b + 1],
            scale,
            keep[b : b + 1],
        )
        np.testing.assert_array_equal(np.asarray(alone)[0], got[b])


def test_mla_attend_refuses_widths_off_the_vectors():
    """The latents' and roped keys' widths are multiples of 8 (every MLA model's: 512 and 64);
    others are refused, naming the kernel (mla_attend_latent takes them through XLA)."""
    f32 = np.float32
    for r, R in ((20, 8), (32, 6)):
        q, qr = np.zeros((1, 4, r), f32), np.zeros((1, 4, R), f32)
        lat, kr = np.zeros((1, 8, r), f32), np.zeros((1, 8, R), f32)
        one = np.zeros(1, np.int32)
        with pytest.raises(Exception, match="colibri_mla_attend: the latents' and roped"):
            kernels.mla_attend(q, qr, lat, kr, one, one, 0.1)


@settings(max_examples=10, deadline=None)
@given(
    rows=st.integers(1, 5),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    head_dim=st.sampled_from([3, 8, 64]),
    capacity=st.integers(1, 24),
    seed=st.integers(0, 2**16),
)
def test_attend_write_is_the_scatter_then_attend(rows, kv_heads, group, head_dim, capacity, seed):
    """attend_write: the new keys and values written where a scatter with mode="drop" writes
    them (a row whose slot or position lies outside the cache: nowhere), then `attend`, bitwise;
    in a jitted loop with the caches donated (updated in place) and called eagerly (XLA copies
    the caches first) alike."""
    rng = np.random.default_rng(seed)
    S, C, H = 3, capacity, kv_heads * group
    k = rng.standard_normal((S, kv_heads, C, head_dim)).astype(np.float32)
    v = rng.standard_normal((S, kv_heads, C, head_dim)).astype(np.float32)
    q = rng.standard_normal((rows, H, head_dim)).astype(np.float32)
    k_new = rng.standard_normal((rows, kv_heads, head_dim)).astype(np.float32)
    v_new = rng.standard_normal((rows, kv_heads, head_dim)).astype(np.float32)
    slots = rng.permutation(S + 2)[:rows].astype(np.int32)  # S, S + 1: not in the cache
    pos = rng.integers(0, C + 2, rows).astype(np.int32)  # C, C + 1: past its end
    scale = 1 / np.sqrt(head_dim)

    def scatter(buf, new):
        return jnp.asarray(buf).at[slots[:, None], :, pos[:, None]].set(new[:, None], mode="drop")

    want_k, want_v = scatter(k, k_new), scatter(v, v_new)
    want = kernels.attend(q, want_k, want_v, slots, pos, scale)
    eager = kernels.attend_write(q, k, v, slots, pos, k_new, v_new, scale)

    @partial(jax.jit, donate_argnums=(0, 1))
    def steps(kc, vc):  # twice, in a loop that carries the caches
        def body(i, carry):
            return kernels.attend_write(q, *carry[1:], slots, pos, k_new, v_new, scale)

        return jax.lax.fori_loop(0, 2, body, (jnp.zeros_like(q), kc, vc))

    looped = steps(jnp.asarray(k), jnp.asarray(v))
    for got in (eager, looped):
        got_out, got_k, got_v = (np.asarray(a) for a in got)
        np.testing.assert_array_equal(got_k, np.asarray(want_k))
        np.testing.assert_array_equal(got_v, np.asarray(want_v))
        np.testing.assert_array_equal(got_out, np.asarray(want))


@settings(max_examples=10, deadline=None)
@given(
    rows=st.integers(1, 3),
    tokens=st.integers(2, 9),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 6),
    head_dim=st.sampled_from([8, 64]),
    seed=st.integers(0, 2**16),
)
def test_prefill_attention_is_each_tokens_decode_attention(
    rows, tokens, kv_heads, group, head_dim, seed
):
    """A prefill's attention on the CPU (attention._native_attend, T > 1 tokens a row): each
    token's output bitwise the decode kernel's for that token alone, XLA's masked softmax
    within float32 rounding (rows of a slot outside the cache: zeros), and XLA's gradient."""
    from colibri.model import attention

    rng = np.random.default_rng(seed)
    S, C, H = 3, 24, kv_heads * group
    k = jnp.asarray(rng.standard_normal((S, kv_heads, C, head_dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((S, kv_heads, C, head_dim)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((rows, tokens, H, head_dim)), jnp.float32)
    slots = jnp.asarray(rng.permutation(S + 1)[:rows], jnp.int32)  # S: a padding row
    start = rng.integers(0, C - tokens + 1, rows)
    pos = jnp.asarray(start[:, None] + np.arange(tokens), jnp.int32)
    scale = 1 / np.sqrt(head_dim)
    native = jax.jit(attention._native_attend, static_argnums=5)
    got = np.asarray(native(q, k, v, slots, pos, scale))
    for b in range(rows):
        for t in range(tokens):
            one = kernels.attend(q[b, t][None], k, v, slots[b : b + 1], pos[b, t][None], scale)
            np.testing.assert_array_equal(np.asarray(one)[0], got[b, t])
    want = jax.jit(attention._xla_attend, static_argnums=5)(q, k, v, slots, pos, scale)
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-5)

    def grads(f):  # (jitted: op by op, an example took ~4x as long)
        loss = lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v, slots, pos, scale)))  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    ours, xlas = grads(attention._native_attend), grads(attention._xla_attend)
    for a, b in zip(ours, xlas, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 20), cols=st.integers(1, 80), seed=st.integers(0, 2**16))
def test_rms_norm_is_xlas_within_rounding_and_row_by_row(rows, cols, seed):
    """The native RMSNorm: XLA's formula within float32 rounding (the body of eight lanes and
    the tail alike), and each row bitwise the same alone as among others."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, cols)) * 3, jnp.float32)
    w = jnp.asarray(rng.standard_normal(cols), jnp.float32)
    got = np.asarray(jax.jit(kernels.rms_norm, static_argnums=2)(x, w, 1e-6))
    want = w * (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6))
    np.testing.assert_allclose(got, np.asarray(want), rtol=2e-6, atol=1e-6)
    for n in (0, rows - 1):
        np.testing.assert_array_equal(
            np.asarray(kernels.rms_norm(x[n : n + 1], w, 1e-6))[0], got[n]
        )


def test_the_native_norms_gradient_is_xlas():
    """Training differentiates through the norms: the native one's gradient is XLA's."""
    from colibri.model.layers import _xla_rms_norm, rms_norm

    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((3, 4, 24)), jnp.float32)
    w = jnp.asarray(rng.standard_normal(24), jnp.float32)
    c = jnp.asarray(rng.standard_normal((3, 4, 24)), jnp.float32)
    got = jax.grad(lambda x, w: jnp.sum(c * rms_norm(x, w, 1e-5)), argnums=(0, 1))(x, w)
    want = jax.grad(lambda x, w: jnp.sum(c * _xla_rms_norm(x, w, 1e-5)), argnums=(0, 1))(x, w)
    for g, h in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-5, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 17),
    experts=st.integers(1, 70),
    data=st.data(),
    norm=st.booleans(),
    ties=st.booleans(),
)
def test_route_softmax_is_xlas_softmax_and_top_k(rows, experts, data, norm, ties):
    """The router's choice: the experts jax.lax.top_k picks from jax.nn.softmax, in its order
    (ties, which `ties` makes common: the lower expert first), and their weights within
    float32 rounding, renormalised or not."""
    k = data.draw(st.integers(1, experts))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    if ties:  # a few distinct values, some far below the rest (weights that underflow to 0)
        logits = rng.choice([-120.0, -1.5, 0.0, 0.25, 3.0], (rows, experts))
    else:
        logits = rng.standard_normal((rows, experts)) * 4
    logits = jnp.asarray(logits, jnp.float32)
    ids, wts = jax.jit(kernels.route_softmax, static_argnums=(1, 2))(logits, k, norm)
    want_w, want_i = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    if norm:
        want_w = want_w / jnp.sum(want_w, axis=-1, keepdims=True)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_i))
    np.testing.assert_allclose(np.asarray(wts), np.asarray(want_w), rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("norm", [True, False])
def test_the_native_routers_gradient_is_xlas(norm):
    """Training differentiates the router's weights: through the native choice, the gradient
    of softmax and top_k as XLA computes them."""
    from colibri.config import MoeConfig
    from colibri.model import moe

    m = MoeConfig(num_experts=12, top_k=3, moe_ff=8, router="softmax", norm_topk_prob=norm)
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.standard_normal((5, 12)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((5, 3)), jnp.float32)

    def xla(lg):
        w, _ = jax.lax.top_k(jax.nn.softmax(lg, axis=-1), 3)
        return jnp.sum(c * (w / jnp.sum(w, axis=-1, keepdims=True) if norm else w))

    got = jax.grad(lambda lg: jnp.sum(c * moe._route_softmax(m, lg)[1]))(logits)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.grad(xla)(logits)), atol=1e-6)


def test_route_softmax_rejects_k_above_the_experts():
    with pytest.raises(Exception, match="colibri_route_softmax: shapes disagree"):
        kernels.route_softmax(jnp.zeros((2, 4), jnp.float32), 5, True)


def test_attend_weights_far_below_the_peak_are_zero_not_nan():
    """One key scores thousands above the rest: the others' weights underflow to exactly 0 and
    the output is that position's value row."""
    rng = np.random.default_rng(0)
    Dh, C = 64, 21
    k = rng.standard_normal((1, 1, C, Dh)).astype(np.float32)
    v = rng.standard_normal((1, 1, C, Dh)).astype(np.float32)
    k[0, 0, 13] = 0.0
    k[0, 0, 13, 0] = 100.0
    q = np.zeros((1, 1, Dh), np.float32)
    q[0, 0, 0] = 100.0
    got = np.asarray(
        kernels.attend(q, k, v, np.zeros(1, np.int32), np.full(1, C - 1, np.int32), 1 / 8)
    )
    np.testing.assert_allclose(got[0, 0], v[0, 0, 13], rtol=1e-6)
    assert np.isfinite(got).all()


def _held_rows(f, rng, rows: int, cols: int, block: int = 8) -> np.ndarray:
    """Random [rows, cols] weights held as format f (finite: FP8 bytes below NaN)."""
    if not f.scaled:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        return (
            w
            if f.storage == np.float32
            else (w.view(np.uint32) >> 16).astype(np.uint16).view(f.storage)
        )
    values = rng.integers(0, 256, (rows, cols * f.value_bits // 8), dtype=np.uint8)
    if f.value_bits == 8 and not f.zero_points:  # e4m3: no 0x7f / 0xff
        values &= 0xFE
    scales = rng.uniform(0.01, 0.1, (rows, cols // block)).astype(np.float32)
    offsets = rng.uniform(-0.1, 0.1, scales.shape).astype(np.float32)
    return f.pack(values, scales, offsets if f.zero_points else None).reshape(rows, -1)


@pytest.mark.skipif(
    len(kernels.isa_levels()) < 2, reason="this CPU has one ISA level to build for (no AVX-512)"
)
def test_every_isa_level_the_cpu_has_gives_the_same_bits():
    """The kernels built for each instruction-set level this CPU runs (AVX-512's 32 registers
    and EVEX encodings with the paired tiles of cpu/pairs.h, AVX-512 without VBMI's int4
    multishift, and AVX2 alone) compute the same
    bits, for every held format: the linear kernel on 1 to 5, 16 and 37 rows (each tile of up
    to four inputs; odd counts, more than one group; on rows of over 512 columns, 9, 11, 13, 16
    and 37, two groups a pass) and the expert kernel on 8, 16 and 40 rows of top-4 over 6
    experts (~5 to ~30 rows an expert, as in a prefill; experts small and larger than a work
    item); attention, RMSNorm and the router's choice too.
    Bfloat16 products: AVX-512 BF16's instruction where this CPU has it against the AVX2
    build's emulation of it. Results never depend on the CPU's vector extensions."""
    from colibri.bench.kernel_calls import expert_call, registered

    rng = np.random.default_rng(7)
    for isa in kernels.isa_levels()[1:]:
        lib = kernels.build(isa=isa)
        experts = expert_call(lib, f"colibri_isa_{isa}_experts")
        for f in FORMATS:
            target = f"colibri_isa_{isa}_linear{f.suffix}"
            registered(lib, "ColibriLinear" + kernels.symbol_suffix(f.suffix), target)
            # Scaled rows come in blocks of 8; the others have a scalar tail past the vectors.
            # Rows longer than 512 columns take two groups of inputs a pass (pairs.h).
            # Scaled rows in blocks of 8 and of 32 (int4 rows with AVX-512 VBMI take two
            # steps at a time in blocks of a multiple of 16: tiles.h, nibble_pair_block; in
            # rows of whole 64 columns and blocks of a multiple of 32, int4 values lane by
            # lane: nibble_pair_line, by half groups where a block begins or ends in one).
            D, F = (96, 48) if f.scaled else (99, 45)
            cases = [(D, (1, 2, 3, 4, 5, 16, 37), 8), (D + 520, (9, 11, 13, 16, 37), 8)]
            if f.scaled:
                cases.append((D, (1, 2, 3, 4, 16), 32))
                cases += [(128, (1, 2, 3, 4, 5, 16), 32), (192, (1, 2, 4, 5), 96)]
                # Blocks of whole cache lines of values (row pairs take those a line at a
                # time; int8 and FP8 rows with AVX-512 VBMI by byte permutes, tiles.h), and
                # widened for more than four inputs.
                cases.append((256, (1, 2, 3, 4, 5, 16), 128))
            for cols, counts, block in cases:
                w = jnp.asarray(_held_rows(f, rng, 70, cols, block))
                for rows in counts:
                    x = jnp.asarray(rng.standard_normal((rows, cols)).astype(np.float32))
                    out = jax.ShapeDtypeStruct((rows, 70), jnp.float32)
                    theirs = jax.ffi.ffi_call(target, out, vmap_method="sequential")(x, w)
                    np.testing.assert_array_equal(
                        np.asarray(theirs), np.asarray(kernels.linear(x, w))
                    )
            # Experts of F hidden rows, and of more than a work item's share of them (~680 at
            # this D: items from f0 > 0 on); and of rows over 512 columns (two groups a pass,
            # their results packed for the down projections).
            big = 1400 if f.scaled else 1403
            shapes = [(D, F, 16), (D, big, 8), (D + 520, F, 8)]
            if f.scaled:
                # Int4 values lane by lane in both projections, in whole and in half groups.
                shapes += [(128, 64, 64), (128, 64, 32)]
            for cols, ff, block in shapes:
                gate, up = (
                    jnp.asarray(_held_rows(f, rng, 6 * ff, cols, block).reshape(6, ff, -1))
                    for _ in "gu"
                )
                down = jnp.asarray(_held_rows(f, rng, 6 * cols, ff, block).reshape(6, cols, -1))
                for rows in (8, 16, 40):
                    x = jnp.asarray(rng.standard_normal((rows, cols)).astype(np.float32))
                    ids = jnp.asarray(rng.integers(0, 6, (rows, 4)), jnp.int32)
                    np.testing.assert_array_equal(
                        np.asarray(experts(gate, up, down, x, ids)),
                        np.asarray(kernels.moe_experts(gate, up, down, x, ids)),
                    )
        _the_small_kernels_agree(lib, isa, rng)


# kernels.tuning() on Zen 4: the engine's own build there, one build more elsewhere.
ZEN4_TILES = {
    "COLIBRI_TWO_GROUPS_ALONE_FROM": 384,
    "COLIBRI_ONE_BLOCK_TO": 768,
    "COLIBRI_ONE_INPUT_FETCH": 1024,
    "COLIBRI_HELD_PAIRS": 0,
}


@pytest.mark.skipif(
    len(kernels.isa_levels()) < 2, reason="no AVX-512: no paired tiles, one group of inputs a pass"
)
def test_rows_of_512_columns_two_groups_a_pass_give_the_same_bits():
    """Rows of 512 columns met by 9 to 24 inputs: two groups of inputs a pass, the whole row one
    block (as builds for Intel cores take them: kernels.tuning), two groups a pass only where
    they are all the inputs (as Zen 4 builds take them), and a group at a time (the headers'
    default) give the same bits, float32 and bfloat16 rows, linear and expert kernels; and the
    products they should."""
    from colibri.formats import BF16, FLOAT32

    rng = np.random.default_rng(11)
    D = F = 512
    mats = {f: jnp.asarray(_held_rows(f, rng, 70, D)) for f in (FLOAT32, BF16)}
    xs = {r: jnp.asarray(rng.standard_normal((r, D)).astype(np.float32)) for r in (9, 13, 16, 24)}
    gate, up, down = (
        jnp.asarray(_held_rows(FLOAT32, rng, 6 * F, D).reshape(6, F, D)) for _ in "gud"
    )
    ids = {r: jnp.asarray(rng.integers(0, 6, (r, 4)), jnp.int32) for r in (16, 40)}
    xe = {r: jnp.asarray(rng.standard_normal((r, D)).astype(np.float32)) for r in (16, 40)}
    tiles = [{"COLIBRI_TWO_GROUPS_FROM": n} for n in (512, 513)]
    tiles.append(ZEN4_TILES)
    _builds_agree(tiles, mats, xs, [(gate, up, down, xe[r], ids[r]) for r in ids])


@pytest.mark.skipif(
    len(kernels.isa_levels()) < 2, reason="no AVX-512: no paired tiles, one group of inputs a pass"
)
def test_rows_of_384_columns_two_groups_a_pass_give_the_same_bits():
    """Rows of 384 columns met by 9 to 24 inputs: two groups of inputs a pass, the whole row
    one block (as builds for Intel cores take them: kernels.tuning), two groups a pass only
    where they are all the inputs (as Zen 4 builds take them), and a group at a time (the
    headers' default) give the same bits, float32 and bfloat16 rows, linear and expert kernels
    (qwen3_moe's down projections); and the products they should."""
    from colibri.formats import BF16, FLOAT32

    rng = np.random.default_rng(13)
    D, F = 768, 384
    mats = {f: jnp.asarray(_held_rows(f, rng, 70, F)) for f in (FLOAT32, BF16)}
    xs = {r: jnp.asarray(rng.standard_normal((r, F)).astype(np.float32)) for r in (9, 16, 24)}
    gate, up = (jnp.asarray(_held_rows(FLOAT32, rng, 4 * F, D).reshape(4, F, D)) for _ in "gu")
    down = jnp.asarray(_held_rows(FLOAT32, rng, 4 * D, F).reshape(4, D, F))
    ids = jnp.asarray(rng.integers(0, 4, (16, 4)), jnp.int32)
    xe = jnp.asarray(rng.standard_normal((16, D)).astype(np.float32))
    tiles = [{"COLIBRI_TWO_GROUPS_FROM": n, "COLIBRI_ONE_BLOCK_TO": 768} for n in (384, 513)]
    tiles.append(ZEN4_TILES)
    _builds_agree(tiles, mats, xs, [(gate, up, down, xe, ids)])


@pytest.mark.skipif(len(kernels.isa_levels()) < 2, reason="no AVX-512: no row pairs")
def test_held_rows_in_row_pairs_or_in_8_lanes_give_the_same_bits():
    """Held rows (int4 with and without zero points, int8, FP8) met by one to four inputs:
    the row pairs (two rows a 512-bit vector: the headers' default) and the 8-lane tiles (as
    Zen 4 builds take them: kernels.tuning) give the same bits, in blocks of 8, 32 and 128
    columns, linear and expert kernels (up to four rows an expert); and the products of the
    rows widened to float32."""
    from colibri.bench.kernel_calls import expert_call, registered

    held = [f for f in FORMATS if f.scaled]
    results = []
    for pairs in (1, 0):
        lib = kernels.build(tiles={"COLIBRI_HELD_PAIRS": pairs})
        experts = expert_call(lib, f"colibri_held_pairs_{pairs}_experts")
        rng = np.random.default_rng(17)  # the same weights and inputs for both builds
        got = []
        for f in held:
            target = f"colibri_held_pairs_{pairs}_linear{f.suffix}"
            registered(lib, "ColibriLinear" + kernels.symbol_suffix(f.suffix), target)
            for cols, block in ((96, 8), (96, 32), (128, 32), (256, 128)):
                rows_held = _held_rows(f, rng, 70, cols, block)
                w = jnp.asarray(rows_held)
                for rows in (1, 2, 3, 4):
                    x = rng.standard_normal((rows, cols)).astype(np.float32)
                    out = jax.ShapeDtypeStruct((rows, 70), jnp.float32)
                    mine = np.asarray(
                        jax.ffi.ffi_call(target, out, vmap_method="sequential")(jnp.asarray(x), w)
                    )
                    wide = np.asarray(f.unpack(w, cols), np.float64)
                    np.testing.assert_allclose(mine, x @ wide.T, rtol=1e-4, atol=1e-4)
                    got.append(mine)
            gate, up = (
                jnp.asarray(_held_rows(f, rng, 6 * 48, 96, 32).reshape(6, 48, -1)) for _ in "gu"
            )
            down = jnp.asarray(_held_rows(f, rng, 6 * 96, 48, 16).reshape(6, 96, -1))
            for rows in (1, 2, 4):
                x = jnp.asarray(rng.standard_normal((rows, 96)).astype(np.float32))
                ids = jnp.asarray(rng.integers(0, 6, (rows, 2)), jnp.int32)
                got.append(np.asarray(experts(gate, up, down, x, ids)))
        results.append(got)
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("cpuinfo", "tiles"),
    [
        (  # Zen 4: 9-16 inputs two groups a pass from 384 columns, rows of 768 columns whole,
            # one input's rows 1 KiB ahead, held rows' one to four inputs in 8 lanes
            "vendor_id\t: AuthenticAMD\ncpu family\t: 25\nflags\t\t: fma avx2 avx512f",
            ZEN4_TILES,
        ),
        ("vendor_id\t: AuthenticAMD\ncpu family\t: 25\nflags\t\t: fma avx2", {}),  # Zen 3
        ("vendor_id\t: AuthenticAMD\ncpu family\t: 26\nflags\t\t: avx2 avx512f", {}),  # Zen 5
        (
            "vendor_id\t: GenuineIntel\ncpu family\t: 6\nflags\t\t: avx512f",
            {
                "COLIBRI_TWO_GROUPS_FROM": 384,
                "COLIBRI_ONE_BLOCK_TO": 768,
                "COLIBRI_ONE_INPUT_FETCH": 4096,
                "COLIBRI_LINGER_NS": 200_000,
            },
        ),
        ("x86_64", {}),  # no /proc/cpuinfo: platform.processor()
    ],
)
def test_tile_choices_follow_the_cpu(monkeypatch, cpuinfo, tiles):
    """kernels.tuning() reads the vendor, family and flags of the CPU id the library is keyed
    by: Zen 4 alone among AMD cores takes 9 to 16 inputs two groups a pass from 384 columns,
    rows of 768 columns whole, fetches one input's rows ahead and takes held rows' one to four
    inputs in the 8-lane tiles; an id without fields (no /proc/cpuinfo) takes the headers'
    defaults."""
    monkeypatch.setattr(kernels, "_cpu_id", lambda: cpuinfo)
    assert kernels.tuning() == tiles


def test_rows_of_768_columns_whole_or_block_by_block_give_the_same_bits():
    """Rows of 768 columns met by 9 to 24 inputs two groups a pass: whole, a tile's rows a
    third of the matrix apart (as builds for Intel cores take them: kernels.tuning), and block
    by block of columns (the headers' default) give the same bits, float32 and bfloat16 rows,
    linear and expert kernels; and the products they should."""
    from colibri.formats import BF16, FLOAT32

    rng = np.random.default_rng(12)
    D = F = 768
    mats = {f: jnp.asarray(_held_rows(f, rng, 70, D)) for f in (FLOAT32, BF16)}
    xs = {r: jnp.asarray(rng.standard_normal((r, D)).astype(np.float32)) for r in (9, 16, 24)}
    gate, up, down = (
        jnp.asarray(_held_rows(FLOAT32, rng, 4 * F, D).reshape(4, F, D)) for _ in "gud"
    )
    ids = jnp.asarray(rng.integers(0, 4, (16, 4)), jnp.int32)
    xe = jnp.asarray(rng.standard_normal((16, D)).astype(np.float32))
    tiles = [{"COLIBRI_TWO_GROUPS_FROM": 512, "COLIBRI_ONE_BLOCK_TO": n} for n in (768, 512)]
    _builds_agree(tiles, mats, xs, [(gate, up, down, xe, ids)])


def _builds_agree(tiles: list[dict], mats: dict, xs: dict, expert_calls: list[tuple]) -> None:
    """Builds with each of `tiles`: the linear kernel on every matrix of `mats` (float32 and
    bfloat16 rows) and input of `xs`, and the expert kernel on each of `expert_calls` (gate,
    up, down, x, ids), give the same bits in all; the linear products are those of the
    widened rows."""
    from colibri.bench.kernel_calls import expert_call, linear_call
    from colibri.formats import BF16

    results = []
    for t in tiles:
        lib = kernels.build(tiles=t)
        name = "colibri_tiles_" + "_".join(f"{k}_{v}" for k, v in sorted(t.items()))
        linear = linear_call(lib, f"{name}_linear")
        got = [np.asarray(linear(x, w)) for w in mats.values() for x in xs.values()]
        experts = expert_call(lib, f"{name}_experts")
        got += [np.asarray(experts(*args)) for args in expert_calls]
        results.append(got)
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            np.testing.assert_array_equal(a, b)
    for (f, w), k in zip(mats.items(), (0, len(xs)), strict=True):
        wf = np.asarray(w)
        if f is BF16:
            wf = (wf.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        for x, got in zip(xs.values(), results[0][k : k + len(xs)], strict=True):
            np.testing.assert_allclose(got, np.asarray(x) @ wf.T, rtol=1e-4, atol=1e-4)


def _the_small_kernels_agree(lib, isa: str, rng) -> None:
    """Attention, RMSNorm, the router's choice and the greedy choice of an ISA level's build
    against the loaded library's, bitwise."""
    from colibri.bench.kernel_calls import registered

    def call(symbol: str, out, *args, **attrs):
        target = f"colibri_isa_{isa}_{symbol}"
        registered(lib, symbol, target)
        return jax.ffi.ffi_call(target, out, vmap_method="sequential")(*args, **attrs)

    f32 = jnp.float32
    x = jnp.asarray(rng.standard_normal((16, 99)), f32)
    w = jnp.asarray(rng.standard_normal(99), f32)
    theirs = call("ColibriRmsNorm", jax.ShapeDtypeStruct(x.shape, f32), x, w, eps=np.float32(1e-6))
    np.testing.assert_array_equal(np.asarray(theirs), np.asarray(kernels.rms_norm(x, w, 1e-6)))
    logits = jnp.asarray(rng.standard_normal((16, 61)) * 3, f32)
    out = (jax.ShapeDtypeStruct((16, 8), jnp.int32), jax.ShapeDtypeStruct((16, 8), f32))
    theirs = call("ColibriRouteSoftmax", out, logits, norm=np.int32(1))
    for a, b in zip(theirs, kernels.route_softmax(logits, 8, True), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ties = jnp.asarray(rng.integers(-3, 4, (16, 1001)), f32)  # ties everywhere
    theirs = call("ColibriGreedy", jax.ShapeDtypeStruct((16,), jnp.int32), ties)
    np.testing.assert_array_equal(np.asarray(theirs), np.asarray(jnp.argmax(ties, axis=-1)))
    # Groups of 1 to 4 query heads a KV head (keys in pairs, AVX-512 builds), of 8 and 9 (the
    # paired tiles from 5 on), positions over several blocks of values, an odd number of them,
    # a head dimension with a tail past the tiles.
    for heads, dim in ((2, 64), (4, 64), (6, 72), (8, 128), (6, 20), (16, 128), (18, 72)):
        k, v = (jnp.asarray(rng.standard_normal((3, 2, 90, dim)), f32) for _ in "kv")
        q = jnp.asarray(rng.standard_normal((4, heads, dim)), f32)
        slots, pos = jnp.asarray([0, 2, 1, 3], jnp.int32), jnp.asarray([89, 5, 40, 0], jnp.int32)
        theirs = call(
            "ColibriAttend",
            jax.ShapeDtypeStruct(q.shape, f32),
            q,
            k,
            v,
            slots,
            pos,
            scale=np.float32(0.125),
        )
        want = kernels.attend(q, k, v, slots, pos, 0.125)
        np.testing.assert_array_equal(np.asarray(theirs), np.asarray(want))
    # MLA: one group of heads, a group and a half (two groups a tile), four groups; the
    # latents over several blocks of keys, of the values' strips and chunks of positions.
    for heads, r, R in ((4, 32, 8), (12, 64, 16), (32, 512, 64)):
        lat = jnp.asarray(rng.standard_normal((3, 600, r)), f32)
        kr = jnp.asarray(rng.standard_normal((3, 600, R)), f32)
        q = jnp.asarray(rng.standard_normal((4, heads, r)), f32)
        qr = jnp.asarray(rng.standard_normal((4, heads, R)), f32)
        slots, pos = jnp.asarray([0, 2, 1, 3], jnp.int32), jnp.asarray([599, 5, 300, 0], jnp.int32)
        keep = jnp.asarray(rng.random((4, 600)) < 0.7, jnp.uint8)
        theirs = call(
            "ColibriMlaAttend",
            jax.ShapeDtypeStruct(q.shape, f32),
            q,
            qr,
            lat,
            kr,
            slots,
            pos,
            keep,
            scale=np.float32(0.05),
        )
        want = kernels.mla_attend(q, qr, lat, kr, slots, pos, 0.05, keep)
        np.testing.assert_array_equal(np.asarray(theirs), np.asarray(want))


def test_the_multiply_add_ceiling_is_probed():
    """colibri_fma_peak measures a rate on 256-bit vectors, and on 512-bit ones exactly where
    the build has AVX-512."""
    assert kernels.fma_peak(8, seconds=0.02, threads=1) > 1.0
    wide = kernels.fma_peak(16, seconds=0.02, threads=1)
    assert (wide > 1.0) == ("avx512f" in kernels._cpu_id().split())


def test_the_bf16_dot_product_ceiling_is_probed_where_the_cpu_has_the_instruction():
    """colibri_bf16_dot_peak measures VDPBF16PS where the build has AVX-512 BF16, 0 elsewhere."""
    rate = kernels.bf16_dot_peak(seconds=0.02, threads=1)
    assert (rate > 1.0) == ("avx512_bf16" in kernels._cpu_id().split())


def test_the_read_probe_reads_every_float():
    """colibri_read_sum, the bandwidth probe's plain read, sums every element (its vector body
    and its tail), so the reads it is timed on all happen; other arrays are refused."""
    rng = np.random.default_rng(0)
    for n in (0, 7, 64, 1000, 4096 + 13):
        a = rng.integers(-50, 50, n).astype(np.float32)  # small integers: every order is exact
        assert kernels.read_sum(a) == float(a.sum())
    with pytest.raises(ValueError, match="float32"):
        kernels.read_sum(np.ones(8, np.float64))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.read_sum(np.ones((8, 8), np.float32)[:, 0])


@pytest.mark.parametrize("f", FORMATS, ids=lambda f: f.name)
def test_the_widening_probe_computes_every_pass_at_most_at_the_multiply_add_ceiling(f):
    """kernels.widen_peak (bandwidth.widen_rate) puts rows of each held format through the
    one-row tiles over and over: every weight costs a lane of a multiply-add (bfloat16
    products: half a lane of a dot product), so a rate above that ceiling would mean passes
    left out; rows not of the format's shape give 0."""
    rng = np.random.default_rng(0)
    cols = 1024
    w = _held_rows(f, rng, 64, cols, block=128)
    gb_s = kernels.widen_peak(w, cols, seconds=0.05, threads=1)
    weights_s = gb_s * 1e9 / w[0].nbytes * cols
    ceiling = max(kernels.fma_peak(8, seconds=0.05, threads=1), kernels.fma_peak(16, 0.05, 1))
    if f.bf16_inputs:
        ceiling = max(ceiling, kernels.bf16_dot_peak(seconds=0.05, threads=1))
    assert 0 < 2 * weights_s / 1e9 < 1.2 * ceiling
    assert kernels.widen_peak(w[:, :-1] if f.scaled else w, cols + 8, 0.01, 1) == 0
