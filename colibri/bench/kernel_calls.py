"""A build of colibri's CPU kernels called under names of its own, so that two builds (two
revisions of colibri/kernels/cpu/, or one build twice) run side by side in one process."""

from __future__ import annotations

import ctypes
from pathlib import Path

import jax
import jax.numpy as jnp


def registered(lib_path: Path, symbol: str, name: str) -> None:
    """Register the library's handler `symbol` with XLA as target `name`."""
    lib = ctypes.cdll.LoadLibrary(str(lib_path))
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")


def expert_call(lib_path: Path, name: str):
    """The library's expert kernel, registered with XLA as `name`: f(gate, up, down, x, ids);
    over bfloat16 bits (uint16 weights) its bfloat16 variant, `name`_bf16, over FP8 rows
    (uint8) its fp8 one, `name`_fp8, over int4 rows (int8) `name`_int4, over int4 rows with
    zero points (uint32) `name`_int4z and over int8 rows (int32) `name`_int8, where it has
    them."""
    registered(lib_path, "ColibriMoeExperts", name)
    lib = ctypes.cdll.LoadLibrary(str(lib_path))
    variants = {jnp.dtype(jnp.float32): name}
    kinds = (
        (jnp.uint16, "Bf16", "bf16"),
        (jnp.uint8, "Fp8", "fp8"),
        (jnp.int8, "Int4", "int4"),
        (jnp.uint32, "Int4z", "int4z"),
        (jnp.int32, "Int8", "int8"),
    )
    for dtype, symbol, suffix in kinds:
        if hasattr(lib, f"ColibriMoeExperts{symbol}"):
            registered(lib_path, f"ColibriMoeExperts{symbol}", f"{name}_{suffix}")
            variants[jnp.dtype(dtype)] = f"{name}_{suffix}"

    def call(gate, up, down, x, ids):
        shape = (*ids.shape, x.shape[1])
        out = jax.ShapeDtypeStruct(shape, jnp.float32)
        target = variants[jnp.dtype(gate.dtype)]
        return jax.ffi.ffi_call(target, out, vmap_method="sequential")(gate, up, down, x, ids)

    return jax.jit(call)
