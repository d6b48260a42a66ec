"""The routed-expert loop: each (row, k) output is that expert's SwiGLU of that row, exactly.

Both implementations run: XLA's loops (`native=False`, every plan) and the native CPU kernel
(`native=True`, colibri.kernels), which must give the same numbers and be bitwise independent
of which other rows share the call.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri import kernels
from colibri.checkpoint import (
    Checkpoint,
    Fp8Scales,
    quantize_awq,
    quantize_fp8,
    quantize_packed,
    to_f32,
    write_safetensors,
)
from colibri.formats import INT4_ROWS, INT4Z_ROWS, INT8_ROWS
from colibri.model.layers import widen_rows
from colibri.model.moe import expert_outputs, expert_plan
from colibri.synth import awq_quantization

D, F = 8, 4
PLANS = [(False, None), (False, (1, 1)), (False, (2, 1)), (False, (3, 2)), (False, (8, 4))]
PLANS += [(False, (4, 9)), (True, None)]


def reference(experts: dict, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    y = np.zeros((*ids.shape, x.shape[1]), np.float32)
    for (n, k), e in np.ndenumerate(ids):
        if 0 <= e < len(experts["gate"]):
            g, u, d = (np.asarray(experts[t][e], np.float64) for t in ("gate", "up", "down"))
            a, b = g @ x[n], u @ x[n]
            with np.errstate(over="ignore"):  # silu of a far negative: -0
                y[n, k] = d @ (a / (1 + np.exp(-a)) * b)
    return y


_jitted = jax.jit(expert_outputs, static_argnums=(3, 4, 5))


def test_native_kernel_builds_here():
    """The CPU kernel compiles on this machine (a compiler is part of the test setup)."""
    assert kernels.available()


@settings(max_examples=8, deadline=None)
@given(
    rows=st.integers(1, 9),
    top_k=st.integers(1, 4),
    slots=st.integers(4, 12),
    how=st.sampled_from(PLANS),
    unstaged=st.floats(0, 1),
    seed=st.integers(0, 2**16),
)
def test_loop_matches_row_by_row(rows, top_k, slots, how, unstaged, seed):
    native, plan = how
    rng = np.random.default_rng(seed)
    experts = {
        k: rng.standard_normal(s).astype(np.float32)
        for k, s in (("gate", (slots, F, D)), ("up", (slots, F, D)), ("down", (slots, D, F)))
    }
    x = rng.standard_normal((rows, D)).astype(np.float32)
    ids = np.stack([rng.choice(slots, top_k, replace=False) for _ in range(rows)]).astype(np.int32)
    ids[rng.random(ids.shape) < unstaged] = -1  # not staged in this chunk
    y = _jitted({k: jnp.asarray(v) for k, v in experts.items()}, x, ids, slots, plan, native)
    np.testing.assert_allclose(np.asarray(y), reference(experts, x, ids), rtol=2e-5, atol=2e-5)


def test_chunks_assemble_bitwise():
    """Outputs computed over disjoint chunks of staged experts sum to the one-pass output."""
    rng = np.random.default_rng(0)
    E, N, K = 16, 16, 4
    experts = {
        k: jnp.asarray(rng.standard_normal(s).astype(np.float32))
        for k, s in (("gate", (E, F, D)), ("up", (E, F, D)), ("down", (E, D, F)))
    }
    x = jnp.asarray(rng.standard_normal((N, D)).astype(np.float32))
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(N)]).astype(np.int32)
    # XLA: rows by blocks, by rows, and both; then the native kernel.
    for native, plan in ((False, None), (False, (2, 1)), (False, (4, 2)), (True, None)):
        whole = np.asarray(_jitted(experts, x, ids, E, plan, native))
        parts = [np.where(ids % 3 == c, ids, -1).astype(np.int32) for c in range(3)]
        assembled = sum(np.asarray(_jitted(experts, x, p, E, plan, native)) for p in parts)
        np.testing.assert_array_equal(assembled, whole)


def test_plan_rows_one_by_one_at_batch_one_and_in_blocks_for_prefill(monkeypatch):
    assert expert_plan(1, 8, 64) == (1, 1)  # decode: row by row
    assert expert_plan(16, 8, 64) == (1, 1)
    assert expert_plan(256, 8, 64) == (32, 8)  # prefill: blocks
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert expert_plan(1, 8, 64) == (1, 1)
    assert expert_plan(16, 8, 64) == (2, 1)


@settings(max_examples=10, deadline=None)
@given(
    dim=st.integers(1, 40),
    ff=st.integers(1, 40),
    rows=st.integers(1, 24),
    seed=st.integers(0, 2**16),
)
def test_native_rows_are_batch_invariant_bitwise(dim, ff, rows, seed):
    """Any width (vector tails included); each row alone gives bitwise its batched output,
    whatever tile of 1-4 rows it fell in; ids outside [0, S) give zeros."""
    rng = np.random.default_rng(seed)
    S, K = 6, 3
    experts = {
        k: rng.standard_normal(s).astype(np.float32)
        for k, s in (("gate", (S, ff, dim)), ("up", (S, ff, dim)), ("down", (S, dim, ff)))
    }
    x = rng.standard_normal((rows, dim)).astype(np.float32)
    ids = rng.integers(-2, S + 2, (rows, K)).astype(np.int32)  # repeats and out-of-range
    dev = {k: jnp.asarray(v) for k, v in experts.items()}
    y = np.asarray(_jitted(dev, x, ids, S, None, True))
    np.testing.assert_allclose(y, reference(experts, x, ids), rtol=1e-4, atol=1e-4)
    for n in rng.choice(rows, min(rows, 3), replace=False):
        alone = np.asarray(_jitted(dev, x[n : n + 1], ids[n : n + 1], S, None, True))
        np.testing.assert_array_equal(alone[0], y[n])


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    """a rounded to bfloat16 (to nearest even), as the bit patterns colibri holds."""
    bits = a.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


@settings(max_examples=6, deadline=None)
@given(
    dim=st.integers(1, 40),
    ff=st.integers(1, 40),
    rows=st.integers(1, 12),
    how=st.sampled_from(PLANS),
    seed=st.integers(0, 2**16),
)
def test_bfloat16_bits_compute_bitwise_what_the_widened_weights_do(dim, ff, rows, how, seed):
    """Experts held as bfloat16 bits (uint16) give in the native kernel bitwise the outputs of
    the same weights widened to float32 beforehand (vector tails and out-of-range ids
    included); in XLA's loops, which fuse the widening into the products, the same to float32
    rounding."""
    native, plan = how
    rng = np.random.default_rng(seed)
    S, K = 5, 2
    shapes = (("gate", (S, ff, dim)), ("up", (S, ff, dim)), ("down", (S, dim, ff)))
    bits = {k: _bf16_bits(rng.standard_normal(s)) for k, s in shapes}
    wide = {k: to_f32(b, "BF16") for k, b in bits.items()}
    x = rng.standard_normal((rows, dim)).astype(np.float32)
    ids = rng.integers(-1, S + 1, (rows, K)).astype(np.int32)
    held = {k: jnp.asarray(v) for k, v in bits.items()}
    assert held["gate"].dtype == jnp.uint16
    y = np.asarray(_jitted(held, x, ids, S, plan, native))
    widened = {k: jnp.asarray(v) for k, v in wide.items()}
    want = np.asarray(_jitted(widened, x, ids, S, plan, native))
    scale = float(np.abs(want).max()) or 1.0  # sums of many terms: errors follow the largest
    if native:
        np.testing.assert_array_equal(y, want)
    else:
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * scale)
    np.testing.assert_allclose(y, reference(wide, x, ids), rtol=1e-4, atol=1e-5 * scale)


def test_the_native_kernel_takes_bfloat16_bits_and_not_other_dtypes():
    x = jnp.zeros((2, 8), jnp.float32)
    w = {t: jnp.zeros((3, 4, 8), jnp.uint16) for t in ("gate", "up")}
    down = jnp.zeros((3, 8, 4), jnp.uint16)
    assert kernels.usable_weights(x, w["gate"], w["up"], down)
    assert not kernels.usable_weights(x, w["gate"], w["up"], down.astype(jnp.float32))  # mixed
    assert not kernels.usable_weights(x, *(a.astype(jnp.bfloat16) for a in (*w.values(), down)))


def _fp8_rows(rng, shape: tuple[int, int, int], b0: int, b1: int, huge: bool = False):
    """Random experts block-quantized to float8_e4m3fn: (FP8 rows [S, R, C + 4 C / b1] as the
    engine holds them, the float32 [S, R, C] they dequantize to). A fifth of the values sit far
    below their block's largest, so fp8 subnormals and zeros occur; `huge`: the first expert's
    weights around 2^20, scales from 2^8 up."""
    S, R, C = shape
    rows, wide = [], []
    for e in range(S):
        w = rng.standard_normal((R, C)).astype(np.float32)
        w[rng.random((R, C)) < 0.2] *= 1e-4
        if huge and e == 0:
            w *= 2.0**20
        bits, scale_inv = quantize_fp8(w, (b0, b1))
        scales = Fp8Scales(scale_inv, 0, b0, b1, C)
        rows.append(scales.pack(bits.reshape(-1)).reshape(R, -1))
        wide.append(scales.dequantize(bits))
    return np.stack(rows), np.stack(wide)


@settings(max_examples=6, deadline=None)
@given(
    b1=st.sampled_from([8, 16, 32]),
    b0=st.sampled_from([3, 8, 16]),
    kd=st.integers(1, 4),
    kf=st.integers(1, 3),
    rows=st.integers(1, 16),
    plan=st.sampled_from([p for native, p in PLANS if not native]),
    huge=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fp8_rows_compute_bitwise_what_the_dequantized_weights_do(
    b1, b0, kd, kf, rows, plan, huge, seed
):
    """Experts held as FP8 rows (each row's e4m3 values, then its block scales) give in the
    native kernel bitwise the outputs of the dequantized float32 weights (partial row blocks,
    fp8 subnormals, zeros, scales from 2^8 up and out-of-range ids included); in XLA's loops
    (`plan`) the same to float32 rounding, and the widened rows are exactly the dequantized
    weights."""
    rng = np.random.default_rng(seed)
    S, K, dim, ff = 5, 3, b1 * kd, b1 * kf
    shapes = {"gate": (S, ff, dim), "up": (S, ff, dim), "down": (S, dim, ff)}
    packed, wide = {}, {}
    for k, shape in shapes.items():
        packed[k], wide[k] = _fp8_rows(rng, shape, b0, b1, huge)
    assert packed["gate"].shape == (S, ff, dim + 4 * kd) and packed["gate"].dtype == np.uint8
    np.testing.assert_array_equal(
        np.asarray(widen_rows(jnp.asarray(packed["down"]), ff)), wide["down"]
    )
    x = rng.standard_normal((rows, dim)).astype(np.float32)
    ids = rng.integers(-1, S + 1, (rows, K)).astype(np.int32)
    compare_held(packed, wide, x, ids, S, plan)


def compare_held(packed: dict, wide: dict, x, ids, S: int, plan) -> None:
    """Experts held as quantized rows against the float32 they dequantize to: the native
    kernel bitwise, XLA's loops (`plan`) to float32 rounding, both near the reference."""
    rows_held = {k: jnp.asarray(v) for k, v in packed.items()}
    widened = {k: jnp.asarray(v) for k, v in wide.items()}
    for native, how in ((True, None), (False, plan)):
        y = np.asarray(_jitted(rows_held, x, ids, S, how, native))
        want = np.asarray(_jitted(widened, x, ids, S, how, native))
        scale = float(np.abs(want).max()) or 1.0
        if native:
            np.testing.assert_array_equal(y, want)
        else:
            np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * scale)
        np.testing.assert_allclose(y, reference(wide, x, ids), rtol=1e-4, atol=1e-5 * scale)


def test_the_native_kernel_refuses_rows_that_are_not_fp8_rows():
    """uint8 experts go to the FP8 target, which checks that each row is L values and L / b
    float32 scales with b a multiple of 8 dividing L."""
    x = jnp.ones((2, 16), jnp.float32)
    gate = jnp.zeros((3, 8, 16 + 8), jnp.uint8)  # 16 values, two scales: blocks of 8
    down = jnp.zeros((3, 16, 8 + 4), jnp.uint8)
    assert kernels.usable_weights(x, gate, gate, down)
    ids = jnp.zeros((2, 1), jnp.int32)
    np.testing.assert_array_equal(kernels.moe_experts(gate, gate, down, x, ids), 0)
    bad = jnp.zeros((3, 8, 16 + 16), jnp.uint8)  # four scales: blocks of 4
    with pytest.raises(Exception, match="not L values and L / b scales"):
        kernels.moe_experts(bad, bad, down, x, ids).block_until_ready()


def packed_rows(rng, shape: tuple[int, int, int], group: int, tmp_path, kind: str = "int4"):
    """Random experts pack-quantized (`kind` "int4", "int8": a bfloat16 scale per `group`
    columns; "awq": AWQ's int4, with zero points and float16 scales) and read back through a
    checkpoint: (their rows as the engine holds them: int4 rows [S, R, C / 2 + 4 C / group],
    INT4Z_ROWS [S, R, C / 8 + 2 C / group] for AWQ, INT8_ROWS [S, R, C / 4 + 2 C / group]; the
    float32 [S, R, C] they dequantize to)."""
    awq = kind == "awq"
    S, R, C = shape
    tensors, kinds = {}, {}
    for e in range(S):
        w = rng.standard_normal((R, C)).astype(np.float32) * np.float32(2.0 ** rng.integers(-9, 9))
        if awq:
            for part, arr in quantize_awq(w + w.std() * rng.uniform(-2, 2, (R, 1)), group).items():
                tensors[f"e{e}.{part}"] = arr
                kinds[f"e{e}.{part}"] = "F16" if part == "scales" else "I32"
            continue
        packed, scale, dims = quantize_packed(w, 8 if kind == "int8" else 4, group)
        for part, arr, dtype in (("packed", packed, "I32"), ("scale", scale, "BF16")):
            tensors[f"e{e}.weight_{part}"], kinds[f"e{e}.weight_{part}"] = arr, dtype
        tensors[f"e{e}.weight_shape"], kinds[f"e{e}.weight_shape"] = dims, "I64"
    write_safetensors(tmp_path / "model.safetensors", tensors, "F32", kinds)
    if awq:
        config = {"quantization_config": awq_quantization(group)}
        (tmp_path / "config.json").write_text(json.dumps(config))
    ck = Checkpoint(tmp_path)
    held = {"int4": INT4_ROWS, "awq": INT4Z_ROWS, "int8": INT8_ROWS}[kind]
    rows = [ck.read(f"e{e}.weight", (R, C), held) for e in range(S)]
    wide = [ck.read(f"e{e}.weight", (R, C)) for e in range(S)]
    return np.stack(rows), np.stack(wide)


@settings(max_examples=6, deadline=None)
@given(
    group=st.sampled_from([8, 16, 32]),
    kd=st.integers(1, 4),
    kf=st.integers(1, 3),
    rows=st.integers(1, 16),
    plan=st.sampled_from([p for native, p in PLANS if not native]),
    kind=st.sampled_from(["int4", "awq", "int8"]),
    seed=st.integers(0, 2**16),
)
def test_packed_rows_compute_bitwise_what_the_dequantized_weights_do(
    tmp_path_factory, group, kd, kf, rows, plan, kind, seed
):
    """Experts held as int4 rows (each row's four-bit values two a byte, then its group
    scales; AWQ's with zero points: words of values, scales, offsets) or int8 rows (words of
    byte values, scales, offsets) give in the native kernel bitwise the outputs of the
    dequantized float32 weights (out-of-range ids included); in XLA's loops (`plan`) the same
    to float32 rounding, and the widened rows are exactly the dequantized weights."""
    rng = np.random.default_rng(seed)
    S, K, dim, ff = 5, 3, group * kd, group * kf
    shapes = {"gate": (S, ff, dim), "up": (S, ff, dim), "down": (S, dim, ff)}
    packed, wide = {}, {}
    for k, shape in shapes.items():
        packed[k], wide[k] = packed_rows(rng, shape, group, tmp_path_factory.mktemp(k), kind)
    if kind == "awq":
        assert packed["gate"].shape == (S, ff, dim // 8 + 2 * kd)
        assert packed["gate"].dtype == np.uint32
    elif kind == "int8":
        assert packed["gate"].shape == (S, ff, dim // 4 + 2 * kd)
        assert packed["gate"].dtype == np.int32
    else:
        assert packed["gate"].shape == (S, ff, dim // 2 + 4 * kd)
        assert packed["gate"].dtype == np.int8
    np.testing.assert_array_equal(
        np.asarray(widen_rows(jnp.asarray(packed["down"]), ff)), wide["down"]
    )
    x = rng.standard_normal((rows, dim)).astype(np.float32)
    ids = rng.integers(-1, S + 1, (rows, K)).astype(np.int32)
    compare_held(packed, wide, x, ids, S, plan)


def test_the_native_kernel_refuses_rows_that_are_not_int4_rows():
    """int8 experts go to the int4 target, which checks that each row is L / 2 bytes of values
    and L / g float32 scales with g a multiple of 8 dividing L."""
    x = jnp.ones((2, 16), jnp.float32)
    gate = jnp.zeros((3, 8, 8 + 8), jnp.int8)  # 16 values, two scales: groups of 8
    down = jnp.zeros((3, 16, 4 + 4), jnp.int8)
    assert kernels.usable_weights(x, gate, gate, down)
    ids = jnp.zeros((2, 1), jnp.int32)
    np.testing.assert_array_equal(kernels.moe_experts(gate, gate, down, x, ids), 0)
    bad = jnp.zeros((3, 8, 8 + 16), jnp.int8)  # four scales: groups of 4
    with pytest.raises(Exception, match="not L values and L / b scales"):
        kernels.moe_experts(bad, bad, down, x, ids).block_until_ready()


def test_the_native_kernel_refuses_rows_that_are_not_int8_rows():
    """int32 experts go to the int8 target, which checks that each row is L bytes of values
    and L / g float32 scales and offsets with g a multiple of 8 dividing L."""
    x = jnp.ones((2, 16), jnp.float32)
    gate = jnp.zeros((3, 8, 4 + 2 * 2), jnp.int32)  # 16 values in 4 words, 2 groups of 8
    down = jnp.zeros((3, 16, 2 + 2 * 1), jnp.int32)
    assert kernels.usable_weights(x, gate, gate, down)
    ids = jnp.zeros((2, 1), jnp.int32)
    np.testing.assert_array_equal(kernels.moe_experts(gate, gate, down, x, ids), 0)
    bad = jnp.zeros((3, 8, 4 + 2 * 4), jnp.int32)  # four groups: of 4
    with pytest.raises(Exception, match="not L values and L / b scales"):
        kernels.moe_experts(bad, bad, down, x, ids).block_until_ready()
