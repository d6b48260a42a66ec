"""The one place an engine's Runner is built, so expert budgets from the environment land here."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from colibri.engine.model import load_model
from colibri.engine.runner import Runner
from colibri.experts.budget import TierConfig

DEFAULT_CTX = 2048
USAGE_FILE = ".coli_usage"


def make_runner(model_dir: str | Path, slots: int, capacity: int, env: Mapping[str, str]) -> Runner:
    """A runner over `slots` KV slots of `capacity` positions for the checkpoint in model_dir.

    `env` carries the expert tiers (DEVICE_GB, RAM_GB, PIN_GB, CAP, POLICY, REPIN, PILOT,
    DIRECT_IO, IO_THREADS; see `TierConfig.from_env`), PROFILE=1 (run layer by layer so PERF
    phases are measured even when every expert is resident), and STATE_DIR, where
    `.coli_usage` is read at start and rewritten at every turn end.
    """
    usage = state_dir(model_dir, env) / USAGE_FILE
    model = load_model(model_dir, TierConfig.from_env(env), usage_path=usage, progress=False)
    return Runner(model, slots, capacity, profile=env.get("PROFILE", "0") == "1")


def state_dir(model_dir: str | Path, env: Mapping[str, str]) -> Path:
    """The engine's state folder (usage counts, KV files): STATE_DIR, else the model folder."""
    folder = Path(env.get("STATE_DIR") or model_dir)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def default_ctx(max_position_embeddings: int) -> int:
    """CTX when the environment does not set it: the model's maximum, at most DEFAULT_CTX."""
    return min(DEFAULT_CTX, max_position_embeddings)
