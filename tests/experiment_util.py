"""Load a script of experiments/ as a module, for tests of its functions (the scripts import
no one another, so they are no package), or run it as a user would."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

EXPERIMENTS = Path(__file__).parents[1] / "experiments"


def experiment(name: str) -> ModuleType:
    """experiments/<name>.py, loaded afresh."""
    spec = importlib.util.spec_from_file_location(f"{name}_script", EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_experiment(name: str, out: Path, *args: str, timeout: float = 600) -> dict:
    """Run experiments/<name>.py with `args` and --out `out` in a process of its own (without
    the tests' XLA_FLAGS, as a user runs it); its results: out.json."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cmd = [sys.executable, str(EXPERIMENTS / f"{name}.py"), *args, "--out", str(out)]
    subprocess.run(cmd, check=True, env=env, timeout=timeout)
    return json.loads(out.with_suffix(".json").read_text())
