"""The persistent XLA compilation cache, on by default under the user's cache folder."""

from __future__ import annotations

import os
from pathlib import Path

import jax

_enabled = False


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(os.environ.get("COLIBRI_JAX_CACHE") or Path(base) / "colibri" / "jax")


def enable_compilation_cache() -> None:
    """Point JAX's persistent cache at `cache_dir()` unless COLIBRI_JAX_CACHE=0."""
    global _enabled
    if _enabled or os.environ.get("COLIBRI_JAX_CACHE") == "0":
        return
    path = cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _enabled = True
