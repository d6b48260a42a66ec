"""Engine settings from the environment (docs/protocol.md), validated where they are built."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from colibri.experts.budget import TierConfig
from colibri.formats import Holding, HoldingError

MAX_SLOTS = 16
WIRES = ("full", "upstream")  # WIRE profiles: which line kinds the mux engine writes


class SettingsError(ValueError):
    """An environment variable the engine cannot use; the message names it and its value."""


@dataclass(frozen=True)
class EngineSettings:
    """How `colibri engine` runs: the one place its environment variables are named.

    `from_env` reads them (the engine), `to_env` writes them (whoever starts an engine), and
    `child_env` gives a child process an environment with exactly these settings. The expert
    tiers are `tiers` (their variables are `TierConfig`'s).
    """

    serve_batch: bool = False  # SERVE_BATCH=1: mux protocol; otherwise legacy
    kv_slots: int = 1  # KV_SLOTS: conversations held at once, 1..16
    ctx: int | None = None  # CTX: positions per slot; None = min(2048, the model's maximum)
    ngen: int = 0  # NGEN: cap on tokens per answer (0 = only max_tokens caps)
    serve_topk: bool = False  # SERVE_TOPK=1: a TOPK line after every DATA
    serve_gates: int = 0  # SERVE_GATES: 1 a GATES line after every DATA, 2 also per prompt token
    kvsave: bool = False  # KVSAVE=1: persist each slot's KV, reload it at start
    seed: int = 0  # SEED: sampling seed, combined with each request id
    burst: int = 48  # BURST: most greedy decode steps per forward, 1..64 (1: one per forward)
    burst_ms: int = 5  # BURST_MS: longest a burst runs uncut, chained (longer: cut by input)
    stream_ms: int = 200  # STREAM_MS: longest a burst may hold back tokens (shorter bursts)
    wire: str = "full"  # WIRE: full (every line kind) or upstream (colibrì's gateway's ten)
    profile: bool = False  # PROFILE=1: layer by layer, so PERF phases are timed when resident
    warmup: bool = False  # WARMUP=1: after READY, compile every program traffic can reach
    state_dir: str | None = None  # STATE_DIR: `.coli_usage` and KV files; None = the model's
    tiers: TierConfig = TierConfig()  # DEVICE_GB, RAM_GB, PIN_GB, CAP, POLICY, REPIN, ...
    holding: Holding = Holding()  # COLIBRI_BF16, COLIBRI_FP8, COLIBRI_INT4, COLIBRI_INT8
    # DEVICES: local devices the routed experts are spread over (expert parallel); 0: every
    # local accelerator, one device on the CPU (parallel.automatic)
    devices: int = 0
    # Several hosts (`jax.distributed`, engine/lockstep.py): process 0 of PROCESSES serves
    coordinator: str | None = None  # COORDINATOR: host:port of process 0's coordination service
    processes: int = 1  # PROCESSES: how many engine processes share one mesh
    process_id: int = 0  # PROCESS_ID: this one's number, 0 .. PROCESSES - 1

    # SERVE=1 is set by colibrì's gateway for its C engine; SERVE_BATCH alone selects here.
    VARIABLES: ClassVar[tuple[str, ...]] = (
        *("SERVE", "SERVE_BATCH", "KV_SLOTS", "CTX", "NGEN", "SERVE_TOPK", "SERVE_GATES"),
        *("KVSAVE", "SEED", "BURST", "BURST_MS", "STREAM_MS"),
        *("WIRE", "PROFILE", "WARMUP", "STATE_DIR", *TierConfig.VARIABLES),
        *Holding.VARIABLES,
        *("DEVICES", "COORDINATOR", "PROCESSES", "PROCESS_ID"),
    )

    @classmethod
    def from_env(cls, env: Mapping[str, str], **defaults: Any) -> EngineSettings:
        """Parse and validate; unset or empty variables keep their defaults (`defaults` replaces
        some of them, as `colibri-engine` does for WIRE)."""
        d = replace(cls(), **defaults)
        r = _Reader(env)
        ctx = r.opt_int("CTX", lo=2)
        processes = r.int("PROCESSES", d.processes, lo=1)
        if processes > 1 and not (r.text("COORDINATOR") or d.coordinator):
            raise SettingsError(f"PROCESSES={processes}: COORDINATOR (host:port) is not set")
        return cls(
            serve_batch=r.flag("SERVE_BATCH", d.serve_batch),
            kv_slots=r.int("KV_SLOTS", d.kv_slots, lo=1, hi=MAX_SLOTS),
            ctx=d.ctx if ctx is None else ctx,
            ngen=r.int("NGEN", d.ngen, lo=0),
            serve_topk=r.flag("SERVE_TOPK", d.serve_topk),
            serve_gates=r.int("SERVE_GATES", d.serve_gates, lo=0, hi=2),
            kvsave=r.flag("KVSAVE", d.kvsave),
            seed=r.int("SEED", d.seed, lo=0),
            burst=r.int("BURST", d.burst, lo=1, hi=64),
            burst_ms=r.int("BURST_MS", d.burst_ms, lo=0, hi=10_000),
            stream_ms=r.int("STREAM_MS", d.stream_ms, lo=0, hi=10_000),
            wire=r.choice("WIRE", WIRES, d.wire),
            profile=r.flag("PROFILE", d.profile),
            warmup=r.flag("WARMUP", d.warmup),
            state_dir=r.text("STATE_DIR") or d.state_dir,
            tiers=TierConfig.from_env(env),
            holding=_holding(env),
            devices=r.int("DEVICES", d.devices, lo=0),
            coordinator=r.text("COORDINATOR") or d.coordinator,
            processes=processes,
            process_id=r.int("PROCESS_ID", d.process_id, lo=0, hi=processes - 1),
        )

    def to_env(self) -> dict[str, str]:
        """Every setting as the variable `from_env` reads it back from (None: left unset)."""
        values = {
            "SERVE_BATCH": _bit(self.serve_batch),
            "KV_SLOTS": str(self.kv_slots),
            "CTX": None if self.ctx is None else str(self.ctx),
            "NGEN": str(self.ngen),
            "SERVE_TOPK": _bit(self.serve_topk),
            "SERVE_GATES": str(self.serve_gates),
            "KVSAVE": _bit(self.kvsave),
            "SEED": str(self.seed),
            "BURST": str(self.burst),
            "BURST_MS": str(self.burst_ms),
            "STREAM_MS": str(self.stream_ms),
            "WIRE": self.wire,
            "PROFILE": _bit(self.profile),
            "WARMUP": _bit(self.warmup),
            "STATE_DIR": self.state_dir,
            **self.tiers.to_env(),
            **self.holding.to_env(),
            "DEVICES": str(self.devices),
            "COORDINATOR": self.coordinator,
            "PROCESSES": str(self.processes),
            "PROCESS_ID": str(self.process_id),
        }
        return {k: v for k, v in values.items() if v is not None}


def child_env(settings: EngineSettings, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A child engine's environment: `base` (default os.environ) without any engine variable,
    plus `settings`, so that nothing inherited changes the engine silently."""
    base = os.environ if base is None else base
    env = {k: v for k, v in base.items() if k not in EngineSettings.VARIABLES}
    return env | settings.to_env()


def _holding(env: Mapping[str, str]) -> Holding:
    try:
        return Holding.from_env(env)
    except HoldingError as err:
        raise SettingsError(str(err)) from None


def _bit(flag: bool) -> str:
    return "1" if flag else "0"


class _Reader:
    """Typed access to environment variables, with errors that name the variable and value."""

    def __init__(self, env: Mapping[str, str]):
        self.env = env

    def _raw(self, name: str) -> str | None:
        value = self.env.get(name, "").strip()
        return value or None

    def _fail(self, name: str, want: str) -> SettingsError:
        return SettingsError(f"{name}={self.env.get(name)!r}: expected {want}")

    def flag(self, name: str, default: bool = False) -> bool:
        value = self._raw(name)
        if value not in (None, "0", "1"):
            raise self._fail(name, "0 or 1")
        return default if value is None else value == "1"

    def text(self, name: str) -> str | None:
        return self._raw(name)

    def choice(self, name: str, options: tuple[str, ...], default: str) -> str:
        """One of options; `default` when unset."""
        value = self._raw(name)
        if value is None:
            return default
        if value not in options:
            raise self._fail(name, " or ".join(options))
        return value

    def opt_int(self, name: str, lo: int, hi: int | None = None) -> int | None:
        value = self._raw(name)
        if value is None:
            return None
        span = f"an integer >= {lo}" if hi is None else f"an integer in {lo}..{hi}"
        try:
            n = int(value)
        except ValueError:
            raise self._fail(name, span) from None
        if n < lo or (hi is not None and n > hi):
            raise self._fail(name, span)
        return n

    def int(self, name: str, default: int, lo: int, hi: int | None = None) -> int:
        n = self.opt_int(name, lo, hi)
        return default if n is None else n
