"""Safetensors checkpoints as a tensor index: name -> (file, dtype, shape, bytes), read by pread.

Block-quantized FP8 checkpoints (DeepSeek-V3, Qwen3 "-FP8": `quantization_config` with
quant_method "fp8" and `weight_block_size` [b0, b1]) store a linear layer's weight as
float8_e4m3fn with a float32 `weight_scale_inv` per b0 x b1 block; colibri reads such a weight
as float32, each value its fp8 number times its block's scale rounded once, as transformers
dequantizes them, or keeps it as FP8 rows (values, then their blocks' scales) that the CPU
kernels and `formats.HeldFormat.unpack` widen to exactly those float32s.

Integer weight-only checkpoints in compressed-tensors' "pack-quantized" format (W4A16 and W8A16
releases: `quantization_config` quant_method "compressed-tensors") store a linear layer's
weight as `weight_packed` (int32 words, each holding 8 four-bit or 4 eight-bit values, first
value in the lowest bits, offset by 8 or 128), `weight_scale` (one scale per group of columns
of a row) and `weight_shape`; colibri indexes such a weight under its plain name `X.weight`
(dtype PACK4 or PACK8) and reads it as float32, each value times its group's scale (exact
for bfloat16 and float16 scales): what compressed-tensors decompresses it to in a float32
model.

GPTQ checkpoints (quant_method "gptq": Qwen's "-GPTQ-Int4" releases, AutoGPTQ and GPTQModel
output) store the same integers the other way round: `qweight` int32 [I * bits / 32, O], each
word holding consecutive input columns of one output row (the first in the lowest bits),
`scales` [groups, O], `qzeros` [groups, O * bits / 32] (packed along the rows; the original
"gptq" format stores each zero point less one, "gptq_v2" as it is) and `g_idx` [I] (each
column's group). colibri indexes such a weight as `X.weight` too (dtype GPTQ4 or GPTQ8, shape
[O, I]) and reads it as (q - zero) x scale in float32, exact for float16 and bfloat16 scales;
symmetric weights (every zero point the midpoint, 8 or 128) are the compressed-tensors
integers with their words transposed. AutoAWQ's GEMM checkpoints (quant_method "awq") pack the
other axis: `qweight` int32 [I, O / 8], each word eight outputs of one input in AWQ_ORDER,
`qzeros` [groups, O / 8] likewise, `scales` [groups, O]; indexed as `X.weight` (AWQ4).

Multimodal checkpoints whose language model colibri runs (Kimi K2.5) store it under a prefix
(`TEXT_PREFIXES`): their text tensors are indexed under the names of the text model's own
checkpoint (`model.layers.0...`, `lm_head.weight`), and the vision tower's and projector's are
left out, with one log line saying how many.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import ml_dtypes
import numpy as np

from colibri.config import gptq_format, quantization_config
from colibri.formats import (
    BF16_HELD,
    E4M3,
    FP8,
    FP8_ROWS,
    INT4_ROWS,
    INT4Z_ROWS,
    INT8_ROWS,
    PACKED_ROWS,
    UNPACK4,
    of,
)

# safetensors dtype -> (numpy dtype used to hold the raw bytes, bytes per element)
_RAW_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # bf16 bits, widened to f32 by `to_f32`
    "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
    "F8_E4M3": np.dtype("u1"),  # float8_e4m3fn bits, dequantized with their block scales
}
_MAX_HEADER = 100 * 1024 * 1024
# The dtypes under which pack-quantized weights are indexed (not safetensors dtypes: their
# bytes are the `weight_packed` int32 words, or GPTQ's `qweight` words, which hold columns of
# the matrix rather than rows), and the bits of each value.
GPTQ_BITS = {"GPTQ4": 4, "GPTQ8": 8, "AWQ4": 4}  # GPTQ's and AWQ's: words of columns
PACKED_BITS = {"PACK4": 4, "PACK8": 8, **GPTQ_BITS}
for _kind in PACKED_BITS:
    _RAW_DTYPES[_kind] = np.dtype("u1")
# Packed bytes -> their values as float32: formats.UNPACK4 for 4 bits, q - 128 for 8.
_UNPACK = {4: UNPACK4, 8: np.arange(256, dtype=np.float32)[:, None] - 128}
# AWQ's 4-bit words: bits [4 k, 4 k + 4) of word m hold output 8 m + AWQ_ORDER[k].
AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])

log = logging.getLogger("colibri")

# Per multimodal model_type: where its checkpoints keep the language model's tensors, each
# prefix with the one colibri reads them by (the first that matches a name applies); tensors
# under none of them (the vision tower, the projector) are not indexed.
TEXT_PREFIXES = {
    "kimi_k25": (
        ("language_model.model.layers.", "model.layers."),  # the release
        ("language_model.model.blocks.", "model.layers."),  # transformers' save_pretrained
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.language_model.", "model."),  # save_pretrained(save_original_format=False)
        ("lm_head.", "lm_head."),
    ),
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as asked: the message names the file and the tensor."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: absolute byte offset and size inside `path`."""

    name: str
    path: Path
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def raw_dtype(dtype: str) -> np.dtype:
    """The numpy dtype holding a safetensors dtype's raw bytes (bf16 as uint16)."""
    return _RAW_DTYPES[dtype]


def to_f32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Widen raw tensor bytes (as read) to a new float32 array; bf16 is the top half of an f32,
    shifted in one pass into a fresh array."""
    if dtype == "BF16":
        out = np.empty(raw.shape, np.uint32)
        np.left_shift(raw, 16, out=out, dtype=np.uint32)
        return out.view(np.float32)
    return raw.astype(np.float32)


@dataclass(frozen=True)
class Fp8Scales:
    """The block scales of whole rows of an FP8 weight with `cols` columns: row i of the part
    read uses `blocks[(row0 + i) // b0]`, one scale per b1 columns."""

    blocks: np.ndarray  # float32 [block rows, ceil(cols / b1)]
    row0: int  # the part's first row, counted from the first row of blocks[0]
    b0: int
    b1: int
    cols: int

    def dequantize(self, raw: np.ndarray) -> np.ndarray:
        """float8_e4m3fn bits (whole rows) to a new float32 array of the same shape: each value
        widened exactly, then times its block's scale (rounded once, in float32)."""
        values = E4M3[raw].reshape(-1, self.cols)
        rows, b1 = values.shape[0], self.b1
        scale = self.blocks[(self.row0 + np.arange(rows)) // self.b0]  # [rows, column blocks]
        whole = self.cols // b1
        values[:, : whole * b1].reshape(rows, whole, b1)[...] *= scale[:, :whole, None]
        if whole * b1 < self.cols:
            values[:, whole * b1 :] *= scale[:, whole:]
        return values.reshape(raw.shape)

    def pack(self, raw: np.ndarray) -> np.ndarray:
        """FP8_ROWS of float8_e4m3fn bits (flat, whole rows): each row's values, then the
        float32 scales of its blocks, as bytes in a new flat array. Needs whole column blocks."""
        ncb = self.blocks.shape[1]
        if ncb * self.b1 != self.cols:
            raise CheckpointError(
                f"FP8 rows of {self.cols} values need whole blocks of {self.b1} columns"
            )
        rows = raw.size // self.cols
        scale = self.blocks[(self.row0 + np.arange(rows)) // self.b0]
        return FP8.pack(raw.reshape(rows, self.cols), scale)


@dataclass(frozen=True)
class GroupScales:
    """The scales of whole rows of a pack-quantized weight with `cols` columns: value c of row
    i of the part read is (its integer q - its group's zero point) times `scales[i, group[c]]`,
    the zero point 2^(bits-1) (the midpoint) unless `zeros` says otherwise."""

    scales: np.ndarray  # float32 [rows, groups]
    group: np.ndarray  # int [cols]: each column's group
    bits: int
    cols: int
    size: int  # columns a group when each is consecutive columns, else 0
    zeros: np.ndarray | None = None  # float32 [rows, groups]: zero points less the midpoint
    # How the raw bytes hold the values: "rows" (compressed-tensors: words of a row's values),
    # "gptq" (words [cols * bits / 32, rows], each of one row's columns), "awq" (words
    # [cols, rows / 8], each of 8 rows' values of one column in AWQ_ORDER).
    layout: str = "rows"

    def dequantize(self, raw: np.ndarray) -> np.ndarray:
        """Packed bytes (whole rows; a GPTQ weight's whole matrix) to a new float32 array
        [rows * cols]: each value less its zero point, times its group's scale, in float32
        (exact for bfloat16 and float16 scales)."""
        if self.layout == "awq":
            values = self._awq_values(raw)
        else:
            rows = np.ascontiguousarray(self._row_words(raw)).view(np.uint8)
            values = _UNPACK[self.bits][rows].reshape(-1, self.cols)
        if self.zeros is not None:
            values -= self.zeros[:, self.group]
        values *= self.scales[:, self.group]
        return values.reshape(-1)

    def _row_words(self, raw: np.ndarray) -> np.ndarray:
        """The packed words [rows, cols * bits / 32] of whole rows, a view (GPTQ's words
        transposed: each holds the same values in the same order either way; AWQ's unpacked
        and packed again, row by row)."""
        words = raw.view("<u4")
        rows = self.scales.shape[0]
        if self.layout == "awq":
            return _awq_row_words(words.reshape(self.cols, rows // 8))
        return words.reshape(-1, rows).T if self.layout == "gptq" else words.reshape(rows, -1)

    def _awq_values(self, raw: np.ndarray) -> np.ndarray:
        """AWQ's words [cols, rows / 8] as float32 values less the midpoint [rows, cols]."""
        words = raw.view("<u4").reshape(self.cols, -1)
        codes = np.empty((self.cols, words.shape[1], 8), np.uint8)
        for k, row in enumerate(AWQ_ORDER):
            codes[:, :, row] = (words >> np.uint32(4 * k)) & np.uint32(15)
        return UNPACK4[codes.reshape(self.cols, -1).T, 0]

    def pack(self, raw: np.ndarray, held: np.dtype = INT4_ROWS) -> np.ndarray:
        """Packed four-bit values (flat, whole rows) as INT4_ROWS: each row's values as words,
        then the float32 scales of its groups, in a new flat array (needs `rows_fit`); or as
        INT4Z_ROWS: then the groups' offsets -zero x scale too (needs `zrows_fit`); 8-bit ones
        as INT8_ROWS, with offsets likewise (needs `rows8_fit`)."""
        held = np.dtype(held)
        zero_points = held in (INT4Z_ROWS, INT8_ROWS)
        fit = {INT4_ROWS: self.rows_fit, INT4Z_ROWS: self.zrows_fit, INT8_ROWS: self.rows8_fit}
        if not fit.get(held, False):
            bits = 8 if held == INT8_ROWS else 4
            raise CheckpointError(
                f"int{bits} rows need {bits}-bit values in consecutive groups of a multiple of 8"
                f" columns{', exact offsets' if zero_points else ' and no zero points'} (these:"
                f" {self.bits}-bit, groups of {self.size or 'g_idx'}"
                f"{', with zero points' if self.zeros is not None else ''})"
            )
        words = self._row_words(raw)  # whole words a row: cols % 8 == 0
        return of(held).pack(words, self.scales, self._offsets if zero_points else None)

    @cached_property
    def _offsets(self) -> np.ndarray:
        """Each group's -zero point x scale, float32 [rows, groups] (found once: `zrows_fit`
        checks them, `pack` stores them)."""
        zero = np.float32(2 ** (self.bits - 1))
        return -(self.scales * (zero if self.zeros is None else self.zeros + zero))

    @property
    def rows_fit(self) -> bool:
        """Whether these rows can be held as INT4_ROWS (the kernels widen eight values of one
        group at a time)."""
        return self.bits == 4 and self._fits and self.zeros is None

    @property
    def zrows_fit(self) -> bool:
        """Whether these rows can be held as INT4Z_ROWS: as for `rows_fit`, with any zero
        points whose products with the scales are exact in float32 (always, for float16 and
        bfloat16 scales)."""
        return self.bits == 4 and self._fits and self._exact_offsets

    @property
    def rows8_fit(self) -> bool:
        """Whether these rows can be held as INT8_ROWS: 8-bit values in consecutive groups of
        a multiple of 8 columns, each group's offset exact."""
        return self.bits == 8 and self._fits and self._exact_offsets

    @property
    def held(self) -> np.dtype | None:
        """How these rows can be held: INT4_ROWS, INT4Z_ROWS, INT8_ROWS or None (float32)."""
        if self.rows_fit:
            return INT4_ROWS
        if self.zrows_fit:
            return INT4Z_ROWS
        return INT8_ROWS if self.rows8_fit else None

    @property
    def _fits(self) -> bool:
        return self.size > 0 and self.size % 8 == 0 and self.cols % 8 == 0

    @property
    def _exact_offsets(self) -> bool:
        zero = np.float64(2 ** (self.bits - 1))
        z = zero if self.zeros is None else self.zeros.astype(np.float64) + zero
        return bool(np.all(self._offsets.astype(np.float64) == -(self.scales * z)))


Scales = Fp8Scales | GroupScales


def _awq_row_words(words: np.ndarray) -> np.ndarray:
    """AWQ's words [I, O / 8] (word [i, m]: outputs 8 m + AWQ_ORDER[k] of input i in nibble k)
    as row words [O, I / 8] (word [o, j]: inputs 8 j + t of output o in nibble t), with whole
    words: each 8 x 8 block of nibbles transposed in three rounds of masked swaps (4, 2 and 1
    apart), then the rows put in order."""
    cols, m = words.shape
    # a[t, m, j]: the word of input 8 j + t, nibble k holding output 8 m + AWQ_ORDER[k].
    a = words.reshape(cols // 8, 8, m).transpose(1, 2, 0).copy()  # ours to swap in place
    for d, mask in ((4, 0x0000FFFF), (2, 0x00FF00FF), (1, 0x0F0F0F0F)):
        pairs = a.reshape(8 // (2 * d), 2, d, m, cols // 8)  # [.., t & d == 0 or not, ..]
        x, y = pairs[:, 0], pairs[:, 1]
        keep, shift = np.uint32(mask), np.uint32(4 * d)
        x_new = (x & keep) | ((y << shift) & ~keep)
        y[...] = ((x >> shift) & keep) | (y & ~keep)
        x[...] = x_new
    # a[k, m, j]: the words of output 8 m + AWQ_ORDER[k]; put in order of outputs.
    return a[np.argsort(AWQ_ORDER)].transpose(1, 0, 2).reshape(8 * m, cols // 8)


def to_held(
    raw: np.ndarray, dtype: str, held: np.dtype, scales: Scales | None = None
) -> np.ndarray:
    """Raw tensor bytes as colibri holds them, in a fresh array (no view into the read buffer
    survives): widened to float32, or for bfloat16 tensors held as BF16_BITS, their bits; FP8
    weights dequantized with their `scales` to float32, or held as FP8_ROWS with them;
    pack-quantized weights likewise, to float32 or as their rows (PACKED_ROWS)."""
    if dtype in PACKED_BITS or np.dtype(held) in PACKED_ROWS:
        ok = dtype in PACKED_BITS and isinstance(scales, GroupScales)
        if not ok or np.dtype(held) not in (np.float32, *PACKED_ROWS):
            raise CheckpointError(
                f"a {dtype} tensor cannot be held as {np.dtype(held)} (pack-quantized weights:"
                " float32, int4 or int8 rows, with their group scales)"
            )
        if np.dtype(held) == np.float32:
            return scales.dequantize(raw)
        return scales.pack(raw, held).reshape(-1)
    if np.dtype(held) in BF16_HELD:
        if dtype != "BF16":
            raise CheckpointError(f"a {dtype} tensor cannot be held as bfloat16 bits")
        return raw.view(np.uint16).astype(np.uint16, copy=True).view(held)
    if np.dtype(held) == FP8_ROWS:
        if dtype != "F8_E4M3" or scales is None:
            raise CheckpointError(f"a {dtype} tensor cannot be held as FP8 rows")
        return scales.pack(raw)
    if dtype == "F8_E4M3":
        if scales is None:
            raise CheckpointError("an F8_E4M3 tensor is read with its block scales")
        return scales.dequantize(raw)
    return to_f32(raw, dtype)


class Checkpoint:
    """Index of every tensor in a folder's safetensors files (single file or sharded)."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        self.files = _safetensors_files(self.dir)
        self.tensors: dict[str, TensorInfo] = {}
        for path in self.files:
            for info in _read_header(path):
                self.tensors[info.name] = info
        prefixes = TEXT_PREFIXES.get(_model_type(self.dir))
        if prefixes:
            self.tensors = self._text_tensors(prefixes)
        self._fds: dict[Path, int] = {}
        quant = quantization_config(self.dir)
        self.fp8_block = _fp8_block(quant)
        self._consecutive: dict[str, int] = {}  # g_idx tensors found to be consecutive groups
        # Each packed weight's companions: "scale", "g_idx", and for GPTQ "zeros".
        self._parts: dict[str, dict[str, str]] = {}
        self._index_packed()
        self._index_gptq(quant)
        # The tensors indexed under another name (packed words, scales, zero points, groups).
        self.companions = {n for parts in self._parts.values() for n in parts.values()}

    def _text_tensors(self, prefixes: tuple[tuple[str, str], ...]) -> dict[str, TensorInfo]:
        """The language model's tensors of a multimodal checkpoint, named as colibri reads
        them (`TEXT_PREFIXES`); the rest (vision tower, projector) left out, and logged."""
        text: dict[str, TensorInfo] = {}
        skipped: list[str] = []
        for name, t in self.tensors.items():
            to = next((to + name[len(p) :] for p, to in prefixes if name.startswith(p)), None)
            if to is None:
                skipped.append(name)
            elif to in text:
                raise CheckpointError(
                    f"{t.path}: {name!r} is the language model's {to!r}, and so is a tensor"
                    f" of {text[to].path.name} before it"
                )
            else:
                text[to] = replace(t, name=to)
        if skipped:  # by the modules they belong to: vision_tower, model.mm_projector, ...
            parts = [n.split(".") for n in skipped]
            roots = sorted({".".join(p[: 2 if p[0] == "model" else 1]) for p in parts})
            log.info(
                "%s: skipped %d vision tensors (%s): colibri runs the language model",
                self.dir, len(skipped), ", ".join(roots),
            )  # fmt: skip
        return text

    def _index_packed(self) -> None:
        """Index each pack-quantized weight (`X.weight_packed`, `X.weight_scale`,
        `X.weight_shape`) as `X.weight`: dtype PACK4 or PACK8 (its bits: packed bytes per row
        against the columns `weight_shape` gives), shape as unpacked, bytes those packed."""
        for name in [n for n in self.tensors if n.endswith(".weight_packed")]:
            base = name.removesuffix("_packed")
            t = self.tensors[name]
            for need in (f"{base}_scale", f"{base}_shape"):
                if need not in self.tensors:
                    raise CheckpointError(
                        f"{t.path}: packed weight {name!r} has no {need!r} beside it"
                    )
            shape = tuple(int(v) for v in self.read_raw(f"{base}_shape").reshape(-1))
            cols = shape[-1] if shape else 0
            row_bytes = t.nbytes // max(int(np.prod(shape[:-1], dtype=np.int64)), 1)
            bits = 8 * row_bytes // cols if cols else 0
            if (
                t.dtype != "I32"
                or len(shape) < 2
                or bits not in (4, 8)
                or row_bytes * 8 != bits * cols
                or t.shape[:-1] != shape[:-1]
            ):
                raise CheckpointError(
                    f"{t.path}: packed weight {name!r} is {t.dtype} {list(t.shape)}, which is"
                    f" not {list(shape)} ({base + '_shape'!r}) in 4 or 8 bits a value packed"
                    " into int32 words with no padding"
                )
            self.tensors[base] = TensorInfo(base, t.path, f"PACK{bits}", shape, t.offset, t.nbytes)
            self._parts[base] = {k: f"{base}_{k}" for k in ("packed", "scale", "shape", "g_idx")}

    def _index_gptq(self, quant: dict) -> None:
        """Index each GPTQ weight (`X.qweight`, `X.scales`, `X.qzeros`, `X.g_idx`) as
        `X.weight`: dtype GPTQ4 or GPTQ8 (`bits` of the quantization config), shape [O, I] as
        the matrix it stands for, bytes those of `qweight` [I * bits / 32, O]; and each AWQ
        weight (`qweight` [I, O / 8], `scales`, `qzeros`; no g_idx) likewise as AWQ4."""
        names = [n for n in self.tensors if n.endswith(".qweight")]
        if not names:
            return
        t, method = self.tensors[names[0]], quant.get("quant_method")
        if method not in ("gptq", "awq"):
            raise CheckpointError(
                f"{t.path}: {names[0]!r} is a GPTQ/AWQ-packed weight, but the quantization"
                f" config says quant_method={method!r}, not 'gptq' or 'awq'"
            )
        bits = quant.get("bits", quant.get("w_bit"))
        if bits not in ((4, 8) if method == "gptq" else (4,)):
            raise CheckpointError(f"{t.path}: {method} weights of bits={bits!r} are not read")
        for name in names:
            base = name.removesuffix(".qweight")
            t = self.tensors[name]
            parts = {"packed": name, "scale": f"{base}.scales", "zeros": f"{base}.qzeros"}
            for need in parts.values():
                if need not in self.tensors:
                    raise CheckpointError(
                        f"{t.path}: {method} weight {name!r} has no {need!r} beside it"
                    )
            if t.dtype != "I32" or len(t.shape) != 2:
                raise CheckpointError(
                    f"{t.path}: {method} weight {name!r} is {t.dtype} {list(t.shape)}, not int32"
                    + (" [in * bits / 32, out]" if method == "gptq" else " [in, out / 8]")
                )
            if method == "gptq":
                kind, shape = f"GPTQ{bits}", (t.shape[1], t.shape[0] * 32 // bits)
            else:
                kind, shape = "AWQ4", (t.shape[1] * 8, t.shape[0])
            weight = f"{base}.weight"
            self.tensors[weight] = TensorInfo(weight, t.path, kind, shape, t.offset, t.nbytes)
            self._parts[weight] = {**parts, "g_idx": f"{base}.g_idx"}
        # The original GPTQ format stores each zero point less one; "gptq_v2" and AWQ as is.
        self._zero_offset = 1 if method == "gptq" and gptq_format(quant) == "gptq" else 0

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            files = ", ".join(p.name for p in self.files)
            raise CheckpointError(
                f"{self.dir}: tensor {name!r} is missing (looked in {files})"
            ) from None

    def read_raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored, as a numpy array of its raw dtype (bf16 as uint16;
        a pack-quantized weight's packed bytes, flat)."""
        t = self.info(name)
        raw = np.frombuffer(self.pread(t.path, t.offset, t.nbytes), dtype=_RAW_DTYPES[t.dtype])
        return raw if t.dtype in PACKED_BITS else raw.reshape(t.shape)

    def read(
        self, name: str, shape: tuple[int, ...] | None = None, held: np.dtype = np.float32
    ) -> np.ndarray:
        """The tensor as float32, checked against `shape` when given; with held=FP8_ROWS, an
        FP8 matrix as its rows of values and block scales ([rows, cols + 4 cols / b1]), with
        INT4_ROWS a pack-quantized one as its int4 rows ([rows, cols / 2 + 4 cols / g]), with
        INT4Z_ROWS or INT8_ROWS as those rows (`GroupScales.pack`)."""
        t = self.info(name)
        if shape is not None and tuple(shape) != t.shape:
            raise CheckpointError(
                f"{t.path}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}"
            )
        out = to_held(self.read_raw(name), t.dtype, held, self.scales(t))
        rows = np.dtype(held) in (FP8_ROWS, *PACKED_ROWS)
        return out.reshape(t.shape[0], -1) if rows else out.reshape(t.shape)

    def read_part(
        self, t: TensorInfo, offset: int, nbytes: int, held: np.dtype = np.float32
    ) -> np.ndarray:
        """`nbytes` of tensor `t` starting `offset` bytes into it, flat, held as `held`
        (`to_held`: float32, bfloat16 bits or FP8 rows; FP8 and pack-quantized weights by whole
        rows only)."""
        raw = np.frombuffer(self.pread(t.path, t.offset + offset, nbytes), _RAW_DTYPES[t.dtype])
        return to_held(raw, t.dtype, held, self.scales(t, offset, nbytes))

    def scales(self, t: TensorInfo, offset: int = 0, nbytes: int | None = None) -> Scales | None:
        """The scales of bytes [offset, offset + nbytes) of a quantized weight `t` (whole rows
        of its last two dimensions, within one matrix; a GPTQ weight whole): an F8_E4M3
        weight's blocks from its `weight_scale_inv` companion, a pack-quantized one's groups
        from its `weight_scale` (GPTQ: `scales` and `qzeros`); None for any other dtype."""
        if t.dtype in GPTQ_BITS:
            return self._gptq_scales(t, offset, t.nbytes - offset if nbytes is None else nbytes)
        if t.dtype in PACKED_BITS:
            return self._group_scales(t, t.nbytes - offset if nbytes is None else nbytes, offset)
        if t.dtype != "F8_E4M3":
            return None
        nbytes = t.nbytes - offset if nbytes is None else nbytes
        names = [t.name + "_scale_inv", t.name + "_scales_inv"]  # X.weight_scale_inv
        found = [n for n in names if n in self.tensors]
        if not found or len(t.shape) < 2:
            other = t.name.removesuffix(".weight") + ".weight_scale"
            kind = f" (it has per-tensor {other!r}: not supported)" if other in self.tensors else ""
            raise CheckpointError(
                f"{t.path}: F8_E4M3 tensor {t.name!r} has no block scales "
                f"({names[0]!r} is missing){kind}"
            )
        s = self.tensors[found[0]]
        (b0, b1), (rows, cols) = self.fp8_block, t.shape[-2:]
        grid = (-(-rows // b0), -(-cols // b1))
        if s.shape != (*t.shape[:-2], *grid) or s.dtype not in ("F32", "BF16", "F16"):
            raise CheckpointError(
                f"{s.path}: scales {s.name!r} are {s.dtype} {list(s.shape)}; {t.name!r} "
                f"{list(t.shape)} in blocks of {b0}x{b1} needs float {[*t.shape[:-2], *grid]}"
            )
        if offset % cols or nbytes % cols or nbytes <= 0:
            raise CheckpointError(f"{t.path}: {t.name!r} is read by whole rows of {cols}")
        first, n = offset // cols, nbytes // cols
        matrix, r0 = divmod(first, rows)
        if r0 + n > rows:
            raise CheckpointError(f"{t.path}: a read of {t.name!r} spans two of its matrices")
        lo, hi = matrix * grid[0] + r0 // b0, matrix * grid[0] + (r0 + n - 1) // b0 + 1
        item = _RAW_DTYPES[s.dtype].itemsize
        buf = self.pread(s.path, s.offset + lo * grid[1] * item, (hi - lo) * grid[1] * item)
        blocks = to_f32(np.frombuffer(buf, _RAW_DTYPES[s.dtype]), s.dtype).reshape(-1, grid[1])
        return Fp8Scales(blocks, r0 % b0, b0, b1, cols)

    def _group_scales(self, t: TensorInfo, nbytes: int, offset: int) -> GroupScales:
        """The group scales of whole rows [offset, offset + nbytes) bytes into the packed
        weight `t`: its `weight_scale` [..., rows, groups] (groups of cols / groups columns,
        or as `weight_g_idx` assigns them), only the rows needed read (of one matrix or of
        several, for a fused [E, ...] weight)."""
        s = self.tensors[self._parts[t.name]["scale"]]
        bits, cols = PACKED_BITS[t.dtype], t.shape[-1]
        row_bytes = cols * bits // 8
        groups = s.shape[-1] if s.shape else 0
        if (
            s.shape[:-1] != t.shape[:-1]
            or groups <= 0
            or cols % groups
            or s.dtype not in ("F32", "BF16", "F16")
        ):
            raise CheckpointError(
                f"{s.path}: scales {s.name!r} are {s.dtype} {list(s.shape)}; {t.name!r} "
                f"{list(t.shape)} needs float [{', '.join(map(str, t.shape[:-1]))}, groups] "
                "with groups dividing its columns"
            )
        if offset % row_bytes or nbytes % row_bytes or nbytes <= 0:
            raise CheckpointError(f"{t.path}: {t.name!r} is read by whole rows of {cols}")
        first, n = offset // row_bytes, nbytes // row_bytes  # rows of [..., rows] counted flat
        item = _RAW_DTYPES[s.dtype].itemsize
        buf = self.pread(s.path, s.offset + first * groups * item, n * groups * item)
        scales = to_f32(np.frombuffer(buf, _RAW_DTYPES[s.dtype]), s.dtype).reshape(n, groups)
        group, size = self._column_groups(t, groups)
        return GroupScales(scales, group, bits, cols, size)

    def _gptq_scales(self, t: TensorInfo, offset: int, nbytes: int) -> GroupScales:
        """The scales and zero points of a whole GPTQ weight: `scales` [groups, O] and
        `qzeros` [groups, O * bits / 32] transposed to [O, groups] (a part of its rows would be
        columns of `qweight`, strided on disk: its matrices are read whole)."""
        parts = self._parts[t.name]
        s, z = self.tensors[parts["scale"]], self.tensors[parts["zeros"]]
        bits, (rows, cols) = GPTQ_BITS[t.dtype], t.shape
        groups = s.shape[0] if s.shape else 0
        if len(s.shape) != 2 or s.shape[1] != rows or s.dtype not in ("F32", "BF16", "F16"):
            raise CheckpointError(
                f"{s.path}: scales {s.name!r} are {s.dtype} {list(s.shape)}; {parts['packed']!r}"
                f" for a [{rows}, {cols}] matrix needs float [groups, {rows}]"
            )
        if z.dtype != "I32" or z.shape != (groups, rows * bits // 32):
            raise CheckpointError(
                f"{z.path}: zero points {z.name!r} are {z.dtype} {list(z.shape)}, not int32"
                f" {[groups, rows * bits // 32]} (a {bits}-bit zero point per group and row)"
            )
        if offset or nbytes != t.nbytes:
            raise CheckpointError(
                f"{t.path}: {t.name!r} is read whole (its rows are columns of {parts['packed']!r})"
            )
        scales = np.ascontiguousarray(to_f32(self.read_raw(s.name), s.dtype).T)
        words = self.read_raw(z.name).view("<u4")
        shifts = np.arange(0, 32, bits, dtype=np.uint32)
        zeros = (words[:, :, None] >> shifts) & np.uint32(2**bits - 1)  # [groups, O / per, per]
        layout = "awq" if t.dtype == "AWQ4" else "gptq"
        if layout == "awq":  # bits 4 k hold output 8 m + AWQ_ORDER[k]
            zeros[:, :, AWQ_ORDER] = zeros.copy()
        zeros = zeros.reshape(groups, rows).T.astype(np.float32) + self._zero_offset
        zeros -= 2 ** (bits - 1)
        group, size = self._column_groups(t, groups)
        zeros = None if not zeros.any() else zeros
        return GroupScales(scales, group, bits, cols, size, zeros, layout)

    def packed_fit(self, t: TensorInfo) -> tuple[int, np.dtype | None]:
        """(the columns a scale of weight `t` covers, how it is held: INT4_ROWS, INT4Z_ROWS
        with zero points, INT8_ROWS; `GroupScales.held`) when it can be held as rows of its
        values, else (0, None)."""
        bits = PACKED_BITS.get(t.dtype)
        if bits is None:
            return 0, None
        first_row = t.nbytes if t.dtype in GPTQ_BITS else t.shape[-1] * bits // 8  # GPTQ: whole
        scales = self.scales(t, 0, first_row)  # a compressed-tensors weight's: no zero points
        held = scales.held
        return (scales.size, held) if held is not None else (0, None)

    def _column_groups(self, t: TensorInfo, groups: int) -> tuple[np.ndarray, int]:
        """Each column's group: the weight's g_idx where the checkpoint has one (activation
        order), else consecutive groups of cols / groups columns; and the columns a group
        when they are consecutive (whatever says so), else 0."""
        cols = t.shape[-1]
        size = cols // groups if cols % groups == 0 else 0
        name = self._parts[t.name]["g_idx"]
        if name not in self.tensors:
            if not size:
                raise CheckpointError(
                    f"{t.path}: {t.name!r} has {groups} groups of scales for {cols} columns and"
                    f" no {name!r} to say which columns each covers"
                )
            return np.arange(cols) // size, size
        if self._consecutive.get(name) == size:  # GPTQ stores g_idx even when trivial
            return np.arange(cols) // size, size
        g = self.read_raw(name).astype(np.int64).reshape(-1)
        if g.shape != (cols,) or g.min(initial=0) < 0 or g.max(initial=0) >= groups:
            raise CheckpointError(
                f"{self.tensors[name].path}: {name!r} must give each of the {cols} columns"
                f" a group in [0, {groups})"
            )
        if size and np.array_equal(g, np.arange(cols) // size):
            self._consecutive[name] = size
            return g, size
        return g, 0

    def pread(self, path: Path, offset: int, nbytes: int) -> bytes:
        """Exactly `nbytes` at `offset` of `path`, with os.pread (thread-safe, no seek)."""
        fd = self._fd(path)
        chunks, done = [], 0
        while done < nbytes:
            chunk = os.pread(fd, nbytes - done, offset + done)
            if not chunk:
                raise CheckpointError(f"{path}: file ends at byte {offset + done}, expected more")
            chunks.append(chunk)
            done += len(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise CheckpointError(f"{path}: cannot open ({e.strerror})") from None
            self._fds[path] = fd
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _model_type(model_dir: Path) -> str | None:
    """config.json's model_type, None without one."""
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return raw.get("model_type") if isinstance(raw, dict) else None


def _fp8_block(quant: dict) -> tuple[int, int]:
    """The FP8 weight block size the quantization config names (`weight_block_size`), else
    DeepSeek-V3's 128 x 128."""
    block = quant.get("weight_block_size")
    if isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) for b in block):
        return block[0], block[1]
    return 128, 128


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            raw = json.loads(index.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index}: unreadable shard index ({e})") from None
        if not isinstance(raw, dict):
            raise CheckpointError(
                f"{index}: the shard index must be a JSON object with a weight_map, not"
                f" {_json_kind(raw)}"
            )
        weight_map = raw.get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(
                f"{index}: weight_map={_clip(weight_map)} must be an object of tensor name ->"
                " shard file name"
            )
        for name, f in weight_map.items():
            if not isinstance(f, str) or not f or Path(f).name != f:
                raise CheckpointError(
                    f"{index}: weight_map[{name!r}]={_clip(f)} must be the name of a shard file"
                    " in the model folder"
                )
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index}: shard {missing[0].name} is missing from {model_dir}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no .safetensors files")
    return files


def _read_header(path: Path) -> list[TensorInfo]:
    """Parse a safetensors header: u64 little-endian length, then JSON of name -> dtype, shape."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (only {len(head)} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER):
            raise CheckpointError(f"{path}: not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(
            f"{path}: corrupt safetensors header (a JSON object of tensor name -> entry"
            f" expected, not {_json_kind(header)})"
        )
    base = 8 + n
    out = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(meta, dict):
            raise CheckpointError(
                f"{path}: tensor {name!r} has header entry {_clip(meta)}, expected an object"
                " with dtype, shape and data_offsets"
            )
        dtype = meta.get("dtype")
        if dtype not in _RAW_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
        start, end = _header_ints(path, name, meta, "data_offsets", "[start, end] byte offsets", 2)
        shape = _header_ints(path, name, meta, "shape", "a list of dimensions")
        expected = math.prod(shape) * _RAW_DTYPES[dtype].itemsize  # exact: no int64 overflow
        if end - start != expected or base + end > size:
            raise CheckpointError(
                f"{path}: tensor {name!r} byte range {start}..{end} does not fit its shape "
                f"{list(shape)} or the file ({size} bytes)"
            )
        out.append(TensorInfo(name, path, dtype, shape, base + start, end - start))
    return out


def _header_ints(
    path: Path, name: str, meta: dict, key: str, want: str, length: int | None = None
) -> tuple[int, ...]:
    """Entry `key` of tensor `name` in a safetensors header: a list of integers >= 0 (of
    `length` of them, where given)."""
    v = meta.get(key)
    ok = isinstance(v, list) and (length is None or len(v) == length)
    if not ok or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v):
        raise CheckpointError(f"{path}: tensor {name!r} has {key}={_clip(v)}, expected {want}")
    return tuple(v)


def _json_kind(v: object) -> str:
    """A JSON value's kind as an error names it: "a list", "a string", "null"."""
    if v is None:
        return "null"
    kinds = {list: "a list", dict: "an object", str: "a string", bool: "a boolean"}
    return kinds.get(type(v), "a number")


def _clip(v: object, most: int = 80) -> str:
    """repr(v), shortened for an error line."""
    text = repr(v)
    return text if len(text) <= most else text[: most - 3] + "..."


def write_safetensors(
    path: str | Path,
    tensors: dict[str, np.ndarray],
    dtype: str = "F32",
    dtypes: dict[str, str] | None = None,
) -> None:
    """Write tensors to a safetensors file as F32, F16 or BF16 (round to nearest even), or, for
    the names `dtypes` maps to F8_E4M3, as given: float8_e4m3fn bits (uint8; `quantize_fp8`);
    to I32 or I64, integers (`quantize_packed`, `quantize_gptq`)."""
    header: dict[str, dict] = {}
    blobs, offset = [], 0
    for name, arr in tensors.items():
        kind = (dtypes or {}).get(name, dtype)
        raw = _encode(np.ascontiguousarray(arr), kind)
        header[name] = {
            "dtype": kind,
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + raw.nbytes],
        }
        blobs.append(raw)
        offset += raw.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for raw in blobs:
            f.write(raw.tobytes())
    os.replace(tmp, path)


def quantize_fp8(w: np.ndarray, block: tuple[int, int] = (128, 128)):
    """Block-quantize a float32 matrix as DeepSeek-V3's FP8 checkpoints do: per b0 x b1 block,
    scale_inv = max |w| / 448 (1 for an all-zero block) and the values w / scale_inv rounded to
    float8_e4m3fn. Returns (bits uint8 [R, C], scale_inv float32 [ceil(R/b0), ceil(C/b1)])."""
    (R, C), (b0, b1) = w.shape, block
    grid = (-(-R // b0), -(-C // b1))
    padded = np.zeros((grid[0] * b0, grid[1] * b1), np.float32)
    padded[:R, :C] = w
    amax = np.abs(padded.reshape(grid[0], b0, grid[1], b1)).max(axis=(1, 3))
    scale_inv = np.where(amax > 0, amax / np.float32(448.0), np.float32(1.0)).astype(np.float32)
    full = np.repeat(np.repeat(scale_inv, b0, axis=0), b1, axis=1)[:R, :C]
    q = np.clip(w.astype(np.float32) / full, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
    return q.view(np.uint8), scale_inv


def quantize_packed(w: np.ndarray, bits: int = 4, group: int = 128):
    """Quantize a float32 matrix [R, C] to symmetric `bits`-bit integers per row and group of
    `group` columns (C when 0), packed as compressed-tensors' "pack-quantized" format stores
    them: scale = max |w| / (2^(bits-1) - 1/2) rounded to bfloat16 (1 for an all-zero group),
    q = w / scale rounded and clipped to [-2^(bits-1), 2^(bits-1)), q + 2^(bits-1) packed into
    int32 words from the lowest bits up. Returns (packed int32 [R, C * bits / 32], scales
    float32 [R, C / group], all bfloat16 numbers; shape int64 [2])."""
    (R, C), g = w.shape, group or w.shape[1]
    if bits not in (4, 8) or C % g or (C * bits) % 32:
        raise ValueError(f"{bits}-bit groups of {g} do not pack a row of {C} into int32 words")
    top = 2 ** (bits - 1)
    amax = np.abs(w.reshape(R, C // g, g)).max(axis=2)
    scale = np.where(amax > 0, amax / np.float32(top - 0.5), np.float32(1)).astype(np.float32)
    scale = to_f32(_encode(scale, "BF16"), "BF16")
    q = np.clip(np.rint(w.reshape(R, C // g, g) / scale[..., None]), -top, top - 1)
    u = (q.reshape(R, C) + top).astype(np.uint8)
    packed = u if bits == 8 else u[:, 0::2] | (u[:, 1::2] << 4)
    return np.ascontiguousarray(packed).view("<i4"), scale, np.array([R, C], np.int64)


def quantize_gptq(
    w: np.ndarray,
    bits: int = 4,
    group: int = 128,
    sym: bool = True,
    fmt: str = "gptq",
    order: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Quantize a float32 matrix [R, C] on GPTQ's grid (`integer_grid`: round to nearest, no
    error feedback) and store it as GPTQ checkpoints do. Returns {"qweight": int32
    [C bits / 32, R], "qzeros": int32 [groups, R bits / 32] (the "gptq" format stores each
    zero point less one, "gptq_v2" as it is), "scales": float32 [groups, R], all float16
    numbers, "g_idx": int32 [C]}."""
    (R, C), per = w.shape, 32 // bits
    if bits not in (4, 8) or C % per or R % per or fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{bits}-bit {fmt} words do not pack a [{R}, {C}] matrix")
    q, zero, scale, g_idx = integer_grid(w, bits, group, sym, order)
    if fmt == "gptq" and (zero == 0).any():
        raise ValueError("the gptq format cannot store a zero point of 0 (it stores zero - 1)")
    return {
        "qweight": _pack_words(q.T, bits, axis=0),
        "qzeros": _pack_words(zero.T.astype(np.uint32) - (fmt == "gptq"), bits, axis=1),
        "scales": np.ascontiguousarray(scale.T),
        "g_idx": g_idx.astype("<i4"),
    }


def quantize_awq(w: np.ndarray, group: int = 128) -> dict[str, np.ndarray]:
    """Quantize a float32 matrix [R, C] to 4 bits with zero points on GPTQ's asymmetric grid
    (`integer_grid`) and store it as AutoAWQ's GEMM checkpoints do. Returns {"qweight": int32
    [C, R / 8], "qzeros": int32 [groups, R / 8] (output 8 m + AWQ_ORDER[k] of each in bits
    [4 k, 4 k + 4) of word m), "scales": float32 [groups, R], all float16 numbers}."""
    R, C = w.shape
    if R % 8:
        raise ValueError(f"AWQ words do not pack {R} outputs (not a multiple of 8)")
    q, zero, scale, _ = integer_grid(w, 4, group, sym=False)

    def pack(codes):  # [*, R] -> [*, R / 8], each word's outputs in AWQ's order
        interleaved = codes.reshape(codes.shape[0], R // 8, 8)[:, :, AWQ_ORDER]
        return _pack_words(interleaved.reshape(codes.shape[0], R), 4, axis=1)

    return {
        "qweight": pack(q.T),
        "qzeros": pack(zero.T.astype(np.uint32)),
        "scales": np.ascontiguousarray(scale.T),
    }


def integer_grid(
    w: np.ndarray, bits: int, group: int, sym: bool, order: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """GPTQ's grid of a float32 matrix [R, C], per row and group of `group` columns (C when
    0; with `order`, a permutation of the columns, groups of consecutive columns in that order,
    as desc_act gives): symmetric, scale = 2 max |w| / (2^bits - 1) and zero point 2^(bits-1);
    else scale = (max - min) / (2^bits - 1) over a range holding 0, zero = round(-min / scale);
    scales rounded to float16; q = clip(round(w / scale) + zero, 0, 2^bits - 1). Returns
    (q uint32 [R, C], zero [R, groups], scale float32 [R, groups], each column's group [C])."""
    C, g = w.shape[1], group or w.shape[1]
    top = 2**bits - 1
    if C % g:
        raise ValueError(f"groups of {g} do not divide {C} columns")
    g_idx = np.arange(C) // g
    if order is not None:
        g_idx[np.asarray(order)] = np.arange(C) // g
    groups = C // g
    x = w.astype(np.float32)
    hi = np.stack([np.max(x[:, g_idx == k], axis=1) for k in range(groups)], axis=1)
    lo = np.stack([np.min(x[:, g_idx == k], axis=1) for k in range(groups)], axis=1)
    hi, lo = np.maximum(hi, 0), np.minimum(lo, 0)  # [R, groups]
    if sym:
        hi = np.maximum(hi, -lo)
        lo = -hi
    scale = ((hi - lo) / np.float32(top)).astype(np.float16).astype(np.float32)
    scale[scale == 0] = 1
    zero = np.full_like(scale, (top + 1) // 2) if sym else np.rint(-lo / scale)
    q = np.clip(np.rint(x / scale[:, g_idx]) + zero[:, g_idx], 0, top).astype(np.uint32)
    return q, zero, scale, g_idx


def _pack_words(codes: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Codes [A, B] packed 32 / bits to an int32 word along `axis`, the first in the lowest
    bits."""
    per = 32 // bits
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    u = codes.astype(np.uint32)
    if axis == 0:
        return (u.reshape(-1, per, u.shape[1]) << shifts[:, None]).sum(1, np.uint32).view("<i4")
    return (u.reshape(u.shape[0], -1, per) << shifts).sum(2, np.uint32).view("<i4")


def _encode(arr: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "F8_E4M3":
        if arr.dtype != np.uint8:
            raise ValueError("F8_E4M3 tensors are written as their bits (uint8; quantize_fp8)")
        return arr
    if dtype in ("I32", "I64"):
        if arr.dtype.kind not in "iu":
            raise ValueError(f"{dtype} tensors are written from integer arrays")
        return arr.astype("<i4" if dtype == "I32" else "<i8")
    arr = arr.astype(np.float32, copy=False)
    if dtype == "F32":
        return arr
    if dtype == "F16":
        return arr.astype(np.float16)
    if dtype == "BF16":
        bits = arr.view(np.uint32)
        rounded = bits + 0x7FFF + ((bits >> 16) & 1)
        return (rounded >> 16).astype(np.uint16)
    raise ValueError(f"dtype={dtype!r}: write supports F32, F16, BF16, F8_E4M3, I32 and I64")
