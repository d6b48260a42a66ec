"""The quantized formats the benchmarks hold experts in (fp8, int4, int4g32, awq4, int8): how random
experts are quantized into each format's rows, and what the engine and the report need of each
format."""

from __future__ import annotations

from functools import partial

import numpy as np

from colibri.checkpoint import Fp8Scales, GroupScales, integer_grid, quantize_fp8, quantize_packed
from colibri.formats import FP8_ROWS, INT4_ROWS, INT4Z_ROWS, INT8_ROWS, Holding

BLOCK = 128  # fp8: the side of a block sharing one scale
GROUP = 128  # int4, int8: the columns sharing one scale
KIMI_GROUP = 32  # int4g32: Kimi K2's int4 experts (compressed-tensors W4A16, groups of 32)


def fp8_pair(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Experts [S, R, C] block-quantized one by one: (FP8 rows, the float32 they stand for)."""
    rows, wide = [], []
    for w in np.asarray(a, np.float32):
        bits, scale_inv = quantize_fp8(w, (BLOCK, BLOCK))
        scales = Fp8Scales(scale_inv, 0, BLOCK, BLOCK, w.shape[1])
        rows.append(scales.pack(bits.reshape(-1)).reshape(w.shape[0], -1))
        wide.append(scales.dequantize(bits))
    return np.stack(rows), np.stack(wide)


def packed_pair(a: np.ndarray, bits: int = 4, group: int = GROUP) -> tuple[np.ndarray, np.ndarray]:
    """Experts [S, R, C] pack-quantized one by one: (int4 rows, or int8 rows for 8 bits, the
    float32 they stand for)."""
    rows, wide = [], []
    for w in np.asarray(a, np.float32):
        packed, scale, _ = quantize_packed(w, bits, group)
        C = w.shape[1]
        scales = GroupScales(scale, np.arange(C) // group, bits, C, group)
        raw = packed.view(np.uint8).reshape(-1)
        rows.append(scales.pack(raw, scales.held).reshape(w.shape[0], -1))
        wide.append(scales.dequantize(raw).reshape(w.shape))
    return np.stack(rows), np.stack(wide)


def awq4_pair(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Experts [S, R, C] quantized one by one with zero points, as AWQ's: (int4 rows with
    zero points, the float32 they stand for)."""
    rows, wide = [], []
    for w in np.asarray(a, np.float32):
        q, zero, scale, _ = integer_grid(w, 4, GROUP, sym=False)
        u, C = q.astype(np.uint8), w.shape[1]
        raw = np.ascontiguousarray(u[:, 0::2] | (u[:, 1::2] << 4)).reshape(-1)
        scales = GroupScales(scale, np.arange(C) // GROUP, 4, C, GROUP, zero - 8)
        rows.append(scales.pack(raw, INT4Z_ROWS).reshape(w.shape[0], -1))
        wide.append(scales.dequantize(raw).reshape(w.shape))
    return np.stack(rows), np.stack(wide)


# Per format: the held rows, the holding that dequantizes at load instead (`off`), how random
# experts are quantized, the synth changes, the scale block widths, and what the report says of it.
FORMATS = {
    "fp8": dict(
        held=FP8_ROWS,
        off=Holding(fp8=False),
        pair=fp8_pair,
        synth=dict(fp8_block=BLOCK),
        blocks=(BLOCK, BLOCK),
        title="FP8 experts held as FP8 rows or dequantized to float32",
        note=f"Blocks of {BLOCK} x {BLOCK}.",
    ),
    "int4": dict(
        held=INT4_ROWS,
        off=Holding(int4="none"),
        pair=packed_pair,
        synth=dict(group=GROUP),
        blocks=(GROUP, GROUP),
        title="int4 experts held as int4 rows or dequantized to float32",
        note=f"Pack-quantized int4 (compressed-tensors W4A16), a scale per {GROUP} columns; "
        "at the engine level also with only the routed experts as int4 rows "
        "(COLIBRI_INT4=experts: attention dequantized at load).",
        modes={"int4, dense float32": Holding(int4="experts")},
        llama="q4_0",  # blocks of 32 with an f16 scale: the nearest GGUF format
    ),
    "int4g32": dict(
        held=INT4_ROWS,
        off=Holding(int4="none"),
        pair=partial(packed_pair, group=KIMI_GROUP),
        synth=dict(dtype="int4", group=KIMI_GROUP),
        blocks=(KIMI_GROUP, KIMI_GROUP),
        title="int4 experts in groups of 32 held as int4 rows or dequantized to float32",
        note=f"Pack-quantized int4 (compressed-tensors W4A16), a scale per {KIMI_GROUP} "
        "columns, as Kimi K2's experts.",
        llama="q4_0",
    ),
    "awq4": dict(
        held=INT4Z_ROWS,
        off=Holding(int4="none"),
        pair=awq4_pair,
        synth=dict(group=GROUP),
        blocks=(GROUP, GROUP),
        title="AWQ int4 experts held as int4 rows with zero points or dequantized to float32",
        note=f"AutoAWQ GEMM int4, a float16 scale and a zero point per {GROUP} columns.",
    ),
    "int8": dict(
        held=INT8_ROWS,
        off=Holding(int8="none"),
        pair=partial(packed_pair, bits=8),
        synth=dict(group=GROUP),
        blocks=(GROUP, GROUP),
        title="int8 experts held as int8 rows or dequantized to float32",
        note=f"Pack-quantized int8 (compressed-tensors W8A16), a scale per {GROUP} columns.",
        llama="q8_0",  # llama.cpp's own format of as many bits, for --level peers
    ),
}
