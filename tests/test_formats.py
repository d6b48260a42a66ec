"""The held-formats registry: every format packs rows the way its kernels and XLA unpack them,
its row length is what it packs, and the format switches are read once, where a command starts."""

from __future__ import annotations

import ast
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri import formats
from colibri.checkpoint import E4M3 as CHECKPOINT_E4M3
from colibri.checkpoint import Fp8Scales, GroupScales
from colibri.engine.settings import EngineSettings, SettingsError
from colibri.formats import FORMATS, Holding, HoldingError

PACKAGE = Path(__file__).resolve().parent.parent / "colibri"
SWITCHES = Holding.VARIABLES


def test_each_format_has_its_own_storage_name_and_kernel_suffix():
    for field in ("name", "storage", "suffix"):
        values = [getattr(f, field) for f in FORMATS]
        assert len(set(values)) == len(values), field
    for f in FORMATS:
        assert formats.of(f.storage) is f and formats.held(f.storage) is f
    assert formats.held(np.float16) is None
    with pytest.raises(ValueError, match="float16"):
        formats.of(np.float16)
    assert CHECKPOINT_E4M3 is formats.E4M3  # one table, wherever it is read from


def _rows(fmt, rows: int, cols: int, block: int, rng):
    """(held rows, the float32 they stand for, computed here from their parts) for `fmt`."""
    blocks = cols // block
    scales = (2.0 ** rng.integers(-6, 4, (rows, blocks))).astype(np.float32)
    if fmt.name == "fp8":
        bits = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
        bits[(bits & 0x7F) == 0x7F] = 0  # no NaNs
        q = formats.E4M3[bits]
        return fmt.pack(bits, scales), q * np.repeat(scales, block, axis=1)
    vbits = fmt.value_bits
    q = rng.integers(0, 2**vbits, (rows, cols)).astype(np.uint32)
    shifts = np.arange(32 // vbits, dtype=np.uint32) * vbits
    words = (q.reshape(rows, -1, 32 // vbits) << shifts).sum(axis=2, dtype=np.uint32)
    zero = rng.integers(0, 2**vbits, (rows, blocks)).astype(np.float32)
    if not fmt.zero_points:
        zero[:] = 2 ** (vbits - 1)
    offsets = -(zero * scales)
    want = (q.astype(np.float32) - np.repeat(zero, block, axis=1)) * np.repeat(scales, block, 1)
    return fmt.pack(words, scales, offsets), want


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f.scaled], ids=lambda f: f.name)
@given(
    rows=st.integers(1, 4),
    blocks=st.integers(1, 3),
    block=st.sampled_from([8, 16, 32, 64, 96, 128]),
)
@settings(deadline=None, max_examples=12)  # each new shape compiles (~1 s)
def test_packed_rows_unpack_to_their_values_times_their_scales(fmt, rows, blocks, block):
    rng = np.random.default_rng(rows * 100 + blocks * 10 + block)
    cols = blocks * block
    held, want = _rows(fmt, rows, cols, block, rng)
    assert held.dtype == fmt.storage
    assert held.size == rows * fmt.row_elements(cols, block)
    got = np.asarray(fmt.unpack(jnp.asarray(held.reshape(rows, -1)), cols))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("fmt", [formats.INT4, formats.INT4Z], ids=lambda f: f.name)
def test_int4_values_in_blocks_of_32_columns_are_held_lane_by_lane(fmt):
    """In rows of whole 64 columns with blocks of a multiple of 32, byte 4 l + k of each 64
    columns' 32 bytes holds column 8 k + l in its low nibble and 8 (k + 4) + l in its high one
    (the kernels' lanes); other rows keep their columns in order, two a byte, the first in the
    low nibble."""
    rng = np.random.default_rng(5)
    rows = 2
    cases = [(256, 64, True), (256, 128, True), (256, 256, True), (256, 32, True)]
    cases += [(192, 96, True), (256, 16, False), (96, 32, False), (160, 32, False)]
    for cols, block, lanes in cases:
        q = rng.integers(0, 16, (rows, cols)).astype(np.uint8)
        words = np.ascontiguousarray(q[:, 0::2] | (q[:, 1::2] << 4)).view("<u4")
        assert formats.lane_major(cols, cols // block) == lanes
        scales = np.ones((rows, cols // block), np.float32)
        held = fmt.pack(words, scales, -8 * scales if fmt.zero_points else None)
        values = held.reshape(rows, -1).view(np.uint8)[:, : cols // 2]
        nibbles = np.stack([values & 15, values >> 4], axis=-1).reshape(rows, cols)
        col = np.arange(cols)
        g, k, lane = col // 64, col % 64 // 8, col % 8
        at = 64 * g + 2 * (4 * lane + k % 4) + k // 4 if lanes else col
        np.testing.assert_array_equal(nibbles[:, at], q)


def test_int4_rows_are_laid_out_the_same_without_the_kernels(monkeypatch):
    """The kernels' library lays int4 values out lane by lane (fast); without it, numpy does,
    to the same bytes."""
    from colibri import kernels

    if not kernels.available():
        pytest.skip("the kernels are off or failed to build")
    values = np.random.default_rng(3).integers(0, 256, (5, 96), dtype=np.uint8)
    native = formats._lanes(values, 3)
    assert not np.array_equal(native, values)
    monkeypatch.setattr(kernels, "int4_lanes", lambda v: None)
    np.testing.assert_array_equal(formats._lanes(values, 3), native)


def test_checkpoint_packers_lay_rows_out_as_the_registry_does():
    """Fp8Scales.pack and GroupScales.pack are the registry's pack of the same parts."""
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 0x70, 2 * 16, dtype=np.uint8)
    blocks = np.array([[0.5, 2.0]], np.float32)
    fp8 = Fp8Scales(blocks, row0=0, b0=8, b1=8, cols=16)
    assert fp8.pack(raw).tobytes() == formats.FP8.pack(raw.reshape(2, 16), blocks[[0, 0]]).tobytes()
    scales = np.array([[0.25, 1.0], [2.0, 0.5]], np.float32)
    group = GroupScales(scales, np.arange(16) // 8, 4, 16, 8)
    words = rng.integers(0, 2**32, 4, dtype=np.uint64).astype("<u4")
    want = formats.INT4.pack(words.reshape(2, 2), scales)
    assert group.pack(words.view(np.uint8)).tobytes() == want.tobytes()


def test_row_elements_need_blocks_for_scaled_formats():
    assert formats.FLOAT32.row_elements(64) == formats.BF16.row_elements(64) == 64
    scaled = [f.row_elements(64, 16) for f in FORMATS if f.scaled]
    assert scaled == [64 + 16, 32 + 16, 8 + 8, 16 + 8]  # fp8, int4, int4z, int8
    with pytest.raises(ValueError, match="int4 need scale blocks"):
        formats.INT4.row_elements(64)


holdings = st.builds(
    lambda bf16, **kw: Holding(bf16=bf16 != "0", bf16_products=bf16 == "products", **kw),
    bf16=st.sampled_from(["0", "1", "products"]),
    fp8=st.booleans(),
    int4=st.sampled_from(["all", "experts", "none"]),
    int8=st.sampled_from(["all", "experts", "none"]),
)


@given(holdings)
def test_holding_round_trips_through_its_variables(h):
    assert set(h.to_env()) == set(SWITCHES)
    assert Holding.from_env(h.to_env()) == h
    assert EngineSettings.from_env(h.to_env()).holding == h


def test_holding_modes_decide_experts_and_dense_matrices_apart():
    assert Holding.from_env({}) == formats.HOLD_ALL
    h = Holding.from_env({"COLIBRI_INT4": "experts", "COLIBRI_INT8": "0"})
    assert (h.packed(4), h.packed(4, dense=True)) == (True, False)
    assert (h.packed(8), h.packed(8, dense=True)) == (False, False)
    assert formats.HOLD_ALL.packed(8, dense=True)


def test_bf16_products_are_a_way_of_holding_bf16():
    h = Holding.from_env({"COLIBRI_BF16": "products"})
    assert h.bf16 and h.bf16_products and h.bf16_storage == formats.BF16P.storage
    assert formats.HOLD_ALL.bf16_storage == formats.BF16.storage
    assert formats.BF16P.bf16_inputs and not formats.BF16.bf16_inputs
    with pytest.raises(HoldingError, match="held as bf16"):
        Holding(bf16=False, bf16_products=True)


@pytest.mark.parametrize(
    "env", [{"COLIBRI_BF16": "experts"}, {"COLIBRI_FP8": "yes"}, {"COLIBRI_INT4": "2"}]
)
def test_a_bad_switch_is_refused_naming_it(env):
    name, value = next(iter(env.items()))
    with pytest.raises(HoldingError, match=f"{name}='{value}'"):
        Holding.from_env(env)
    with pytest.raises(SettingsError, match=name):
        EngineSettings.from_env(env)


def test_only_the_registry_names_a_format_switch():
    """Switches are read once where a command starts (Holding.from_env), never deep in loading."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "formats.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in SWITCHES:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.value}")
    assert found == []
