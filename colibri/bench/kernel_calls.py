"""A build of colibri's CPU kernels called under names of its own, so that two builds (two
revisions of colibri/kernels/cpu/, or one build twice) run side by side in one process."""

from __future__ import annotations

import ctypes
from pathlib import Path

import jax
import jax.numpy as jnp

from colibri import formats, kernels


def registered(lib_path: Path, symbol: str, name: str) -> None:
    """Register the library's handler `symbol` with XLA as target `name`."""
    lib = ctypes.cdll.LoadLibrary(str(lib_path))
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")


def held_variants(lib_path: Path, symbol: str, name: str) -> dict:
    """Register the library's handlers `symbol` + suffix, one for every held format the build
    has a kernel for (`formats.FORMATS`), as `name` + the format's suffix: {weight dtype:
    target}."""
    lib = ctypes.cdll.LoadLibrary(str(lib_path))
    variants = {}
    for f in formats.FORMATS:
        handler = symbol + kernels.symbol_suffix(f.suffix)
        if hasattr(lib, handler):
            registered(lib_path, handler, name + f.suffix)
            variants[jnp.dtype(f.storage)] = name + f.suffix
    return variants


def expert_call(lib_path: Path, name: str):
    """The library's expert kernel, registered with XLA as `name`: f(gate, up, down, x, ids),
    over weights of every held format the build has a kernel for (held_variants: the target
    chosen by the weights' dtype)."""
    variants = held_variants(lib_path, "ColibriMoeExperts", name)

    def call(gate, up, down, x, ids):
        shape = (*ids.shape, x.shape[1])
        out = jax.ShapeDtypeStruct(shape, jnp.float32)
        target = variants[jnp.dtype(gate.dtype)]
        return jax.ffi.ffi_call(target, out, vmap_method="sequential")(gate, up, down, x, ids)

    return jax.jit(call)


def linear_call(lib_path: Path, name: str):
    """The library's linear kernel, registered with XLA as `name` (+ the held format's suffix,
    chosen by the weights' dtype: held_variants): f(x, w) = x @ w.T (not jitted: called inside
    a jitted step)."""
    variants = held_variants(lib_path, "ColibriLinear", name)

    def call(x, w):
        out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
        return jax.ffi.ffi_call(variants[jnp.dtype(w.dtype)], out, vmap_method="sequential")(x, w)

    return call
