"""The formats colibri holds weights in, in one registry (docs/design.md, "Held formats").

A held format is how a matrix sits in memory between the checkpoint and the kernels: its name,
the array dtype that stores it (the dtype names the layout: FP8 rows are uint8, int4 rows
int8), the suffix of the native kernels that read it, how many elements a row of n weights
takes, and how a row is packed from its values and scales and unpacked to float32. The row
formats lay out each row as its values, then one float32 scale per block of columns, then
(with zero points) one float32 offset -zero x scale per block, so that a weight is
fma(q, s, -z s), (q - z) s rounded once.

Which formats loading may use is `Holding`, read once from the environment where a command
starts (`Holding.from_env`) and passed to loading as an argument.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import ml_dtypes
import numpy as np

if TYPE_CHECKING:  # JAX is imported where rows are unpacked: the gateway reads Holding only
    import jax

# float8_e4m3fn bits -> the float32 each stands for (a table: twice as fast as converting).
E4M3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
# Bytes of two four-bit values -> (q - 8, q' - 8), the first value in the low nibble.
UNPACK4 = np.stack([np.arange(256) & 15, np.arange(256) >> 4], axis=1).astype(np.float32) - 8

# Int4 rows of whole groups of LANE_GROUP columns whose scale blocks are a multiple of half a
# group hold each 64 columns lane by lane (the kernels' eight lanes): byte 4 l + k of the
# group's 32 holds column 8 k + l in its low nibble and 8 (k + 4) + l in its high one (l < 8,
# k < 4), so that a 32-byte load has eight steps of eight lanes, each a shift away (a block of
# 32 columns: the low or the high nibbles of its group's bytes; docs/kernels.md, "Int4 values
# lane by lane").
# LANE_COLUMNS[j]: the column of a group's j-th held value (2 b + 1: byte b's high nibble).
LANE_GROUP = 64
LANE_COLUMNS = np.array(
    [8 * (k + 4 * h) + lane for lane in range(8) for k in range(4) for h in range(2)]
)
_IN_ORDER = np.argsort(LANE_COLUMNS)  # the held value that stands for each column of a group


def lane_major(cols: int, blocks: int) -> bool:
    """Whether int4 rows of `cols` values in `blocks` scale blocks hold them lane by lane (as
    cpu/formats.h's lane_major decides)."""
    return blocks > 0 and (cols // blocks) % (LANE_GROUP // 2) == 0 and cols % LANE_GROUP == 0


def _lanes(values: np.ndarray, blocks: int) -> np.ndarray:
    """Int4 rows' value bytes [rows, n] (columns in order, the first of two in the low nibble)
    as held: lane by lane where their blocks call for it (`lane_major`), else as they are."""
    rows, n = values.shape
    if not lane_major(2 * n, blocks):
        return values
    from colibri import kernels  # (JAX with it: the gateway never packs rows)

    native = kernels.int4_lanes(values)
    if native is not None:
        return native
    q = np.stack([values & 15, values >> 4], axis=-1).reshape(rows, -1, LANE_GROUP)
    q = q[..., LANE_COLUMNS]
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8).reshape(rows, n)


@dataclass(frozen=True)
class HeldFormat:
    name: str  # as logs and docs say it: float32, bf16, fp8, int4, int4z, int8
    storage: np.dtype  # the array dtype that holds it
    suffix: str  # of its kernels' targets: colibri_linear{suffix}, colibri_moe_experts{suffix}
    value_bits: int  # bits a weight's stored value takes
    scaled: bool = False  # rows of values then per-block float32 scales
    zero_points: bool = False  # then per-block float32 offsets too
    bf16_inputs: bool = False  # its products take their inputs rounded to bfloat16
    what: str = ""  # how the load log describes matrices held so

    def row_elements(self, n: int, block: int = 0) -> int:
        """Elements of `storage` a matrix row of n weights takes (`block`: columns a scale)."""
        if not self.scaled:
            return n
        if block <= 0:
            raise ValueError(f"rows of {n} weights held as {self.name} need scale blocks")
        blocks = n // block
        nbytes = n * self.value_bits // 8 + 4 * blocks * (2 if self.zero_points else 1)
        return nbytes // self.storage.itemsize

    def pack(
        self, values: np.ndarray, scales: np.ndarray, offsets: np.ndarray | None = None
    ) -> np.ndarray:
        """Rows as held, flat: each row's stored values (any dtype, whole rows [rows, ...]; int4
        values in column order, laid out lane by lane here where `lane_major`), then its
        float32 block scales [rows, blocks], then for zero points its offsets."""
        rows = scales.shape[0]
        parts = [np.ascontiguousarray(values).reshape(rows, -1).view(np.uint8)]
        if self.value_bits == 4:
            parts[0] = _lanes(parts[0], scales.shape[1])
        parts.append(np.ascontiguousarray(scales, "<f4").view(np.uint8))
        if self.zero_points:
            if offsets is None:
                raise ValueError(f"{self.name} rows need their offsets")
            parts.append(np.ascontiguousarray(offsets, "<f4").view(np.uint8))
        return np.concatenate(parts, axis=1).reshape(-1).view(self.storage)

    def unpack(self, w: jax.Array, cols: int) -> jax.Array:
        """Held rows w [..., row_elements(cols)] as the float32 [..., cols] they stand for:
        each value times its block's scale rounded once, as the checkpoint dequantizes them
        (XLA's path; the kernels widen the same way as they load)."""
        return _UNPACK[self.name](w, cols)


# bf16: a bfloat16 weight's bit pattern, the top half of the float32 it stands for. bf16p: the
# same bits, in products whose inputs are rounded to bfloat16 (`round_inputs`). fp8: each
# row's float8_e4m3fn values, then its scales. int4: each row's four-bit values two a byte (the
# first in the low nibble, each offset by 8; lane by lane where `lane_major`), then its scales.
# int4z: the same values as words (eight a word, the first in the lowest bits, or lane by lane),
# then scales and offsets (GPTQ's asymmetric and AWQ's weights). int8: each row's values as
# stored (unsigned bytes, four a word), then scales and offsets (the zero point 128 when
# symmetric).
FLOAT32 = HeldFormat("float32", np.dtype("<f4"), "", 32)
BF16 = HeldFormat("bf16", np.dtype("<u2"), "_bf16", 16, what="bfloat16 bits")
BF16P = HeldFormat(
    "bf16p", np.dtype("<i2"), "_bf16p", 16, bf16_inputs=True, what="bfloat16 bits (bf16 products)"
)
FP8 = HeldFormat("fp8", np.dtype("u1"), "_fp8", 8, scaled=True, what="fp8 rows")
INT4 = HeldFormat("int4", np.dtype("i1"), "_int4", 4, scaled=True, what="int4 rows")
INT4Z = HeldFormat(
    "int4z", np.dtype("<u4"), "_int4z", 4, True, True, what="int4 rows with zero points"
)
INT8 = HeldFormat("int8", np.dtype("<i4"), "_int8", 8, True, True, what="int8 rows")
FORMATS: tuple[HeldFormat, ...] = (FLOAT32, BF16, BF16P, FP8, INT4, INT4Z, INT8)
_BY_STORAGE = {f.storage: f for f in FORMATS}

# The dtypes by which arrays say how they are held.
BF16_BITS, BF16_PRODUCTS, FP8_ROWS = BF16.storage, BF16P.storage, FP8.storage
BF16_HELD = (BF16_BITS, BF16_PRODUCTS)  # bfloat16 weights, either way
INT4_ROWS, INT4Z_ROWS, INT8_ROWS = INT4.storage, INT4Z.storage, INT8.storage
PACKED_ROWS = (INT4_ROWS, INT4Z_ROWS, INT8_ROWS)  # pack-quantized rows, by preference


def held(dtype) -> HeldFormat | None:
    """The format arrays of this dtype are held in; None for any other dtype."""
    return _BY_STORAGE.get(np.dtype(dtype))


def of(dtype) -> HeldFormat:
    """The format arrays of this dtype are held in; ValueError for any other dtype."""
    fmt = held(dtype)
    if fmt is None:
        raise ValueError(f"no held format is stored as {np.dtype(dtype)}")
    return fmt


def _widen_bf16(w: jax.Array, cols: int) -> jax.Array:
    import jax
    import jax.numpy as jnp

    return jax.lax.bitcast_convert_type(w.astype(jnp.uint32) << 16, jnp.float32)


def bf16_inputs(w_dtype) -> bool:
    """Whether the products with weights held as `w_dtype` take their inputs rounded to
    bfloat16 (BF16P)."""
    fmt = held(w_dtype)
    return fmt is not None and fmt.bf16_inputs


def round_inputs(x: jax.Array, w_dtype) -> jax.Array:
    """x as the products with weights held as `w_dtype` take it: for bfloat16 products (BF16P),
    each value rounded to the nearest bfloat16 (ties to even, subnormals to a zero of their
    sign, as the CPU kernels round them), still float32; for every other format, x."""
    if not bf16_inputs(w_dtype):
        return x
    import jax
    import jax.numpy as jnp

    # In bits, so that no compiler pass may drop the rounding as a round trip of converts.
    u = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)

    def k(n: int) -> jax.Array:
        return jnp.uint32(n)

    even = (u + k(0x7FFF) + ((u >> 16) & k(1))) & k(0xFFFF0000)
    nan = (u & k(0x7FFFFFFF)) > k(0x7F800000)
    r = jnp.where(nan, (u & k(0xFFFF0000)) | k(0x400000), even)
    r = jnp.where((u & k(0x7F800000)) == 0, u & k(0x80000000), r)
    return jax.lax.bitcast_convert_type(r, jnp.float32)


def _table_rows(
    w: jax.Array, cols: int, n: int, table: np.ndarray, nibbles: bool = False
) -> jax.Array:
    import jax
    import jax.numpy as jnp

    lead, blocks = w.shape[:-1], (w.shape[-1] - n) // 4
    values = jnp.asarray(table)[w[..., :n]]
    if nibbles:  # int4 values, lane by lane where `lane_major`
        values = in_column_order(values.reshape(*lead, cols), cols, blocks)
    values = values.reshape(*lead, blocks, cols // blocks)
    scales = jax.lax.bitcast_convert_type(w[..., n:].reshape(*lead, blocks, 4), jnp.float32)
    return (values * scales[..., None]).reshape(*lead, cols)


def _zero_point_rows(w: jax.Array, cols: int, bits: int) -> jax.Array:
    import jax
    import jax.numpy as jnp

    n = cols * bits // 32
    lead, blocks = w.shape[:-1], (w.shape[-1] - n) // 2
    shifts = jnp.arange(0, 32, bits, dtype=jnp.uint32)
    q = ((w[..., :n, None] >> shifts) & (2**bits - 1)).astype(jnp.float32)  # [..., n, 32 / bits]
    if bits == 4:
        q = in_column_order(q.reshape(*lead, cols), cols, blocks)
    q = q.reshape(*lead, blocks, cols // blocks)
    scales = jax.lax.bitcast_convert_type(w[..., n : n + blocks], jnp.float32)[..., None]
    offsets = jax.lax.bitcast_convert_type(w[..., n + blocks :], jnp.float32)[..., None]
    zeros = jnp.where(scales != 0, offsets / scales, 0.0)  # -z exactly (the offset is exact)
    return ((q + zeros) * scales).reshape(*lead, cols)


def in_column_order(values, cols: int, blocks: int):
    """Int4 values [..., cols] (a JAX or numpy array, one value an element) as held, back in
    column order (`_lanes` undone)."""
    if not lane_major(cols, blocks):
        return values
    lead = values.shape[:-1]
    grouped = values.reshape(*lead, cols // LANE_GROUP, LANE_GROUP)
    return grouped[..., _IN_ORDER].reshape(*lead, cols)


def _bitcast(w: jax.Array, dtype) -> jax.Array:
    import jax

    return jax.lax.bitcast_convert_type(w, dtype)


_UNPACK = {
    "float32": lambda w, cols: w,
    "bf16": _widen_bf16,
    "bf16p": lambda w, cols: _widen_bf16(_bitcast(w, np.uint16), cols),
    "fp8": lambda w, cols: _table_rows(w, cols, cols, E4M3),
    "int4": lambda w, cols: _table_rows(_bitcast(w, np.uint8), cols, cols // 2, UNPACK4, True),
    "int4z": lambda w, cols: _zero_point_rows(w, cols, 4),
    "int8": lambda w, cols: _zero_point_rows(_bitcast(w, np.uint32), cols, 8),
}
assert set(_UNPACK) == {f.name for f in FORMATS}


class HoldingError(ValueError):
    """A format switch the loader cannot use; the message names the variable and its value."""


@dataclass(frozen=True)
class Holding:
    """Which held formats loading may keep a checkpoint's matrices in, rather than widening
    them to float32 at load. Read once where a command starts (`from_env`) and passed to
    loading; results are the same either way, memory and speed are not (docs/design.md), but
    for bf16 products, which ask for other results by name."""

    bf16: bool = True  # COLIBRI_BF16: bfloat16 matrices as bf16 bits
    bf16_products: bool = False  # COLIBRI_BF16=products: and their products in bfloat16
    fp8: bool = True  # COLIBRI_FP8: block-quantized FP8 matrices as FP8 rows
    int4: str = "all"  # COLIBRI_INT4: 4-bit pack-quantized ones as rows: all, experts or none
    int8: str = "all"  # COLIBRI_INT8: the same for 8-bit ones

    VARIABLES: ClassVar[tuple[str, ...]] = (
        "COLIBRI_BF16",
        "COLIBRI_FP8",
        "COLIBRI_INT4",
        "COLIBRI_INT8",
    )
    _MODES: ClassVar[dict[str, str]] = {"1": "all", "experts": "experts", "0": "none"}

    def __post_init__(self):
        if self.bf16_products and not self.bf16:
            raise HoldingError("bf16 products need the bfloat16 matrices held as bf16")
        for bits in (4, 8):
            if getattr(self, f"int{bits}") not in self._MODES.values():
                raise HoldingError(f"int{bits}={getattr(self, f'int{bits}')!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Holding:
        """From the variables (`1`: hold, `0`: widen at load; COLIBRI_INT4 and COLIBRI_INT8
        also `experts`: only the routed experts as rows; COLIBRI_BF16 also `products`: hold,
        and round the inputs of their products to bfloat16, BF16P); unset or empty: hold."""

        def read(name: str, options: tuple[str, ...]) -> str:
            value = env.get(name, "").strip() or "1"
            if value not in options:
                raise HoldingError(f"{name}={env.get(name)!r}: expected {' or '.join(options)}")
            return value

        modes = tuple(cls._MODES)
        return cls(
            bf16=read("COLIBRI_BF16", ("0", "1", "products")) != "0",
            bf16_products=read("COLIBRI_BF16", ("0", "1", "products")) == "products",
            fp8=read("COLIBRI_FP8", ("0", "1")) == "1",
            int4=cls._MODES[read("COLIBRI_INT4", modes)],
            int8=cls._MODES[read("COLIBRI_INT8", modes)],
        )

    def to_env(self) -> dict[str, str]:
        """The variables `from_env` reads this back from."""
        code = {v: k for k, v in self._MODES.items()}
        return {
            "COLIBRI_BF16": "products" if self.bf16_products else "1" if self.bf16 else "0",
            "COLIBRI_FP8": "1" if self.fp8 else "0",
            "COLIBRI_INT4": code[self.int4],
            "COLIBRI_INT8": code[self.int8],
        }

    @property
    def bf16_storage(self) -> np.dtype:
        """The dtype bfloat16 matrices are held as: BF16P's with bf16 products, else BF16's."""
        return BF16P.storage if self.bf16_products else BF16.storage

    def packed(self, bits: int, dense: bool = False) -> bool:
        """Whether `bits`-bit pack-quantized matrices are held as rows: the routed experts
        unless the mode is none, the other matrices (`dense`) only when it is all (experts
        trades their memory for the widening they cost steps of many rows)."""
        mode = getattr(self, f"int{bits}")
        return mode == "all" or (mode == "experts" and not dense)


HOLD_ALL = Holding()  # every format where it fits: the default
