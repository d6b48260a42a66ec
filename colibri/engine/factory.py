"""The one place an engine's Runner is built, so expert budgets from the environment land here."""

from __future__ import annotations

import math
from pathlib import Path

import jax

from colibri import memlimit
from colibri.config import ModelConfig, load_config
from colibri.engine.model import load_model
from colibri.engine.runner import Runner
from colibri.engine.settings import EngineSettings
from colibri.experts.budget import GiB
from colibri.model import parallel, transformer

DEFAULT_CTX = 2048
USAGE_FILE = ".coli_usage"


def make_runner(model_dir: str | Path, settings: EngineSettings, capacity: int) -> Runner:
    """A runner over the settings' KV slots of `capacity` positions for the checkpoint in
    model_dir, its experts placed by `settings.tiers`; `.coli_usage` is read from the state
    folder at start and rewritten at every turn end. A KV cache larger than the memory
    available is refused (ValueError naming CTX) before the model is loaded."""
    kv = kv_cache_bytes(load_config(model_dir), settings.kv_slots, capacity)
    check_kv_fits(kv, settings.kv_slots, capacity, memlimit.available(), "memory")
    usage = state_dir(model_dir, settings) / USAGE_FILE
    parallel.use_devices(settings.devices)
    model = load_model(
        model_dir, settings.tiers, usage_path=usage, progress=False, holding=settings.holding
    )
    device = jax.devices()[0]
    if device.platform != "cpu":  # the cache lives in the accelerator's memory
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
            check_kv_fits(kv, settings.kv_slots, capacity, free, f"{device.platform} memory")
    return Runner(model, settings.kv_slots, capacity, profile=settings.profile)


def kv_cache_bytes(cfg: ModelConfig, slots: int, capacity: int) -> int:
    """Bytes of the KV cache a Runner allocates for `slots` conversations of `capacity`
    positions: the arrays of `transformer.init_cache`, sized without allocating them."""
    shapes = jax.eval_shape(lambda: transformer.init_cache(cfg, slots, capacity))
    return sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(shapes))


def check_kv_fits(kv: int, slots: int, capacity: int, available: int, where: str) -> None:
    """Refuse (ValueError, one line naming CTX) a KV cache of `kv` bytes larger than the
    `available` bytes of `where`."""
    if kv > available:
        raise ValueError(
            f"CTX={capacity}: a KV cache of {slots} slot{'s' if slots != 1 else ''} x {capacity}"
            f" positions needs {kv / GiB:.1f} GiB ({kv} bytes), more than the"
            f" {available / GiB:.1f} GiB of {where} available ({available} bytes);"
            " lower CTX or KV_SLOTS"
        )


def state_dir(model_dir: str | Path, settings: EngineSettings) -> Path:
    """The engine's state folder (usage counts, KV files): STATE_DIR, else the model folder."""
    folder = Path(settings.state_dir or model_dir)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def default_ctx(max_position_embeddings: int) -> int:
    """CTX when the environment does not set it: the model's maximum, at most DEFAULT_CTX."""
    return min(DEFAULT_CTX, max_position_embeddings)
