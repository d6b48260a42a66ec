"""Load a script of experiments/ as a module, for tests of its functions (the scripts import
no one another, so they are no package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

EXPERIMENTS = Path(__file__).parents[1] / "experiments"


def experiment(name: str) -> ModuleType:
    """experiments/<name>.py, loaded afresh."""
    spec = importlib.util.spec_from_file_location(f"{name}_script", EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
