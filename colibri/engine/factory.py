"""The one place an engine's Runner is built, so expert budgets from the environment land here."""

from __future__ import annotations

from pathlib import Path

from colibri.engine.model import load_model
from colibri.engine.runner import Runner
from colibri.engine.settings import EngineSettings

DEFAULT_CTX = 2048
USAGE_FILE = ".coli_usage"


def make_runner(model_dir: str | Path, settings: EngineSettings, capacity: int) -> Runner:
    """A runner over the settings' KV slots of `capacity` positions for the checkpoint in
    model_dir, its experts placed by `settings.tiers`; `.coli_usage` is read from the state
    folder at start and rewritten at every turn end."""
    usage = state_dir(model_dir, settings) / USAGE_FILE
    model = load_model(model_dir, settings.tiers, usage_path=usage, progress=False)
    return Runner(model, settings.kv_slots, capacity, profile=settings.profile)


def state_dir(model_dir: str | Path, settings: EngineSettings) -> Path:
    """The engine's state folder (usage counts, KV files): STATE_DIR, else the model folder."""
    folder = Path(settings.state_dir or model_dir)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def default_ctx(max_position_embeddings: int) -> int:
    """CTX when the environment does not set it: the model's maximum, at most DEFAULT_CTX."""
    return min(DEFAULT_CTX, max_position_embeddings)
