"""The one place an engine's Runner is built, so expert budgets from the environment land here."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from colibri.engine.model import load_model
from colibri.engine.runner import Runner

DEFAULT_CTX = 2048


def make_runner(model_dir: str | Path, slots: int, capacity: int, env: Mapping[str, str]) -> Runner:
    """A runner over `slots` KV slots of `capacity` positions for the checkpoint in model_dir.

    `env` carries the expert budgets (DEVICE_GB, RAM_GB, PIN_GB, CAP, REPIN, STATE_DIR); they are
    wired in with tiered expert storage, until then every expert is resident.
    """
    del env
    return Runner(load_model(model_dir, progress=False), slots, capacity)


def default_ctx(max_position_embeddings: int) -> int:
    """CTX when the environment does not set it: the model's maximum, at most DEFAULT_CTX."""
    return min(DEFAULT_CTX, max_position_embeddings)
