"""Engine settings from the environment (docs/protocol.md), validated where they are built."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

MAX_SLOTS = 16
WIRES = ("full", "upstream")  # WIRE profiles: which line kinds the mux engine writes


class SettingsError(ValueError):
    """An environment variable the engine cannot use; the message names it and its value."""


@dataclass(frozen=True)
class EngineSettings:
    """How `colibri engine` runs; every field comes from one environment variable.

    STATE_DIR (where `.coli_usage` and KV files live) is read by `factory.state_dir`.
    """

    serve_batch: bool = False  # SERVE_BATCH=1: mux protocol; otherwise legacy
    kv_slots: int = 1  # KV_SLOTS: conversations held at once, 1..16
    ctx: int | None = None  # CTX: positions per slot; None = min(2048, the model's maximum)
    ngen: int = 0  # NGEN: cap on tokens per answer (0 = only max_tokens caps)
    serve_topk: bool = False  # SERVE_TOPK=1: a TOPK line after every DATA
    kvsave: bool = False  # KVSAVE=1: persist each slot's KV, reload it at start
    seed: int = 0  # SEED: sampling seed, combined with each request id
    burst: int = 6  # BURST: most greedy decode steps per forward, 1..6 (1: one per forward)
    burst_ms: int = 5  # BURST_MS: longest a burst runs uncut, chained (longer: cut by input)
    wire: str = "full"  # WIRE: full (every line kind) or upstream (colibrì's gateway's ten)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> EngineSettings:
        """Parse and validate; unset or empty variables keep their defaults."""
        r = _Reader(env)
        return cls(
            serve_batch=r.flag("SERVE_BATCH"),
            kv_slots=r.int("KV_SLOTS", 1, lo=1, hi=MAX_SLOTS),
            ctx=r.opt_int("CTX", lo=2),
            ngen=r.int("NGEN", 0, lo=0),
            serve_topk=r.flag("SERVE_TOPK"),
            kvsave=r.flag("KVSAVE"),
            seed=r.int("SEED", 0, lo=0),
            burst=r.int("BURST", 6, lo=1, hi=6),
            burst_ms=r.int("BURST_MS", 5, lo=0, hi=10_000),
            wire=r.choice("WIRE", WIRES),
        )


class _Reader:
    """Typed access to environment variables, with errors that name the variable and value."""

    def __init__(self, env: Mapping[str, str]):
        self.env = env

    def _raw(self, name: str) -> str | None:
        value = self.env.get(name, "").strip()
        return value or None

    def _fail(self, name: str, want: str) -> SettingsError:
        return SettingsError(f"{name}={self.env.get(name)!r}: expected {want}")

    def flag(self, name: str) -> bool:
        value = self._raw(name)
        if value not in (None, "0", "1"):
            raise self._fail(name, "0 or 1")
        return value == "1"

    def choice(self, name: str, options: tuple[str, ...]) -> str:
        """One of options; the first when unset."""
        value = self._raw(name)
        if value is None:
            return options[0]
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
