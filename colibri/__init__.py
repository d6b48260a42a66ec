"""colibri: a JAX workbench for Mixture-of-Experts models whose routed experts live across device
memory, host RAM and disk, and for seeing what their routers do.

The public API, loaded on first use (``import colibri`` alone loads neither JAX nor numpy):

- ``Engine``, ``default_model``: the stdio engine as a subprocess, typed events, DataFrames
  (`colibri.client`); ``EngineSettings``, ``TierConfig``: its settings and expert tiers.
- ``load_model``, ``Runner``, ``generate_ids``: a model in process (`colibri.engine`).
- ``SynthSpec``, ``synthesize``: random checkpoints in Hugging Face layout (`colibri.synth`).
- ``codec``, ``Session``: the wire format and a server's view of a session
  (`colibri.protocol`).
- ``analysis``, ``atlas``, ``plots``, ``views``: routing statistics, the expert atlas, and the
  notebook widgets.

The map of the packages is docs/architecture.md.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Engine": "colibri.client",
    "default_model": "colibri.client",
    "EngineSettings": "colibri.engine.settings",
    "TierConfig": "colibri.experts.budget",
    "load_model": "colibri.engine.model",
    "Runner": "colibri.engine.runner",
    "generate_ids": "colibri.engine.generate",
    "SynthSpec": "colibri.synth",
    "synthesize": "colibri.synth",
    "Session": "colibri.protocol.session",
}
_MODULES = {
    "codec": "colibri.protocol.codec",
    "analysis": "colibri.analysis",
    "atlas": "colibri.atlas",
    "plots": "colibri.widgets.plots",
    "views": "colibri.widgets.views",
}
__all__ = sorted([*_EXPORTS, *_MODULES])


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    raise AttributeError(f"module 'colibri' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
