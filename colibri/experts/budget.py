"""Expert tier budgets and policies, from env/flags, auto-sized from free memory when unset
(the host's, or a memory cgroup's headroom where one caps this process: memlimit.py)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from colibri import memlimit

POLICIES = ("lru", "lfru")
GiB = 2**30
# What automatic budgets leave to the process beyond the experts: compiled programs, the KV
# cache and activations grow after the experts are placed. Under a tight memory cgroup this is
# what keeps the engine from being OOM-killed (tests/test_memlimit.py).
WORKSPACE = 256 * 2**20


@dataclass(frozen=True)
class TierConfig:
    """How routed experts are placed. Sizes in bytes; None means auto-size from free memory."""

    device_bytes: int | None = None  # DEVICE_GB: all per-layer device slot caches together
    ram_bytes: int | None = None  # RAM_GB: host cache of expert bytes (0 = none)
    pin_bytes: int = 0  # PIN_GB: device slots pinned to the hottest experts of .coli_usage
    cap: int = 0  # CAP: most device slots in one layer (0 = no cap)
    policy: str = "lru"  # POLICY: device slot eviction, "lru" or "lfru"
    repin: int = 0  # REPIN: every n decode tokens swap a cold pin for a hot expert (0 = off)
    pilot: bool = False  # PILOT: layer L+1's router on layer L's output prefetches from disk
    direct_io: bool = False  # DIRECT_IO: read experts with O_DIRECT (bypass the page cache)
    io_threads: int = 4  # IO_THREADS: disk reader pool size
    # UNIFIED: the RAM budget as more device slots, no RAM tier (None: on when the device is
    # the CPU, whose "device" memory is host RAM; PILOT then reads a window of experts ahead).
    unified: bool | None = None

    VARIABLES: ClassVar[tuple[str, ...]] = (
        *("DEVICE_GB", "RAM_GB", "PIN_GB", "CAP", "POLICY", "REPIN", "PILOT", "DIRECT_IO"),
        *("IO_THREADS", "UNIFIED"),
    )

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"POLICY={self.policy!r}: one of {', '.join(POLICIES)}")
        for name in ("device_bytes", "ram_bytes", "pin_bytes", "cap", "repin"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"{name}={v} must be >= 0")
        if self.io_threads < 1:
            raise ValueError(f"IO_THREADS={self.io_threads} must be >= 1")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TierConfig:
        """Read DEVICE_GB, RAM_GB, PIN_GB, CAP, POLICY, REPIN, PILOT, DIRECT_IO, IO_THREADS."""
        env = os.environ if env is None else env
        return cls(
            device_bytes=_gb(env, "DEVICE_GB"),
            ram_bytes=_gb(env, "RAM_GB"),
            pin_bytes=_gb(env, "PIN_GB") or 0,
            cap=_int(env, "CAP", 0),
            policy=env.get("POLICY", "lru").lower(),
            repin=_int(env, "REPIN", 0),
            pilot=_int(env, "PILOT", 0) > 0,
            direct_io=_int(env, "DIRECT_IO", 0) > 0,
            io_threads=_int(env, "IO_THREADS", 4),
            unified=None if env.get("UNIFIED", "") == "" else _int(env, "UNIFIED", 0) > 0,
        )

    def to_env(self) -> dict[str, str]:
        """The variables `from_env` reads back as this config (None budgets: left unset)."""
        gb = {"DEVICE_GB": self.device_bytes, "RAM_GB": self.ram_bytes, "PIN_GB": self.pin_bytes}
        env = {k: repr(v / GiB) for k, v in gb.items() if v is not None}  # exact: GiB is 2**30
        return (
            env
            | {
                "CAP": str(self.cap),
                "POLICY": self.policy,
                "REPIN": str(self.repin),
                "PILOT": str(int(self.pilot)),
                "DIRECT_IO": str(int(self.direct_io)),
                "IO_THREADS": str(self.io_threads),
            }
            | ({} if self.unified is None else {"UNIFIED": str(int(self.unified))})
        )

    @classmethod
    def of_gb(cls, device_gb=None, ram_gb=None, pin_gb=None, **rest: Any) -> TierConfig:
        """A config with budgets in GiB, as the command line and the client take them."""
        gb = {"device_bytes": device_gb, "ram_bytes": ram_gb, "pin_bytes": pin_gb}
        sizes = {k: gib_bytes(v) for k, v in gb.items() if v is not None}
        return cls(**sizes, **{k: v for k, v in rest.items() if v is not None})


def gib_bytes(gib: float) -> int:
    """A budget given in GiB, in bytes; ValueError unless finite and >= 0."""
    v = float(gib)
    if not 0 <= v < float("inf"):  # refuses nan as well
        raise ValueError(f"a budget of {gib!r} GiB: expected a finite number >= 0")
    return int(v * GiB)


def _gb(env: Mapping[str, str], key: str) -> int | None:
    raw = env.get(key)
    if raw is None or raw == "":
        return None
    try:
        v = float(raw)
    except ValueError:
        raise ValueError(f"{key}={raw!r}: expected a number of GiB") from None
    if not 0 <= v < float("inf"):  # refuses nan as well
        raise ValueError(f"{key}={raw!r}: must be a finite number >= 0")
    return int(v * GiB)


def _int(env: Mapping[str, str], key: str, default: int) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{key}={raw!r}: expected an integer") from None


@dataclass(frozen=True)
class Plan:
    """Resolved placement: device slots per MoE layer, RAM cache bytes, pinned slots in all."""

    slots_per_layer: int
    ram_bytes: int
    pins: int

    def all_resident(self, num_experts: int) -> bool:
        return self.slots_per_layer >= num_experts


def plan(
    tc: TierConfig,
    n_layers: int,
    num_experts: int,
    expert_bytes: int,
    cpu: bool = False,
    reserve: int = 0,
) -> Plan:
    """Turn budgets into slot counts; unset budgets take a share of the memory available
    beyond `WORKSPACE` and `reserve` (what reading experts from disk holds: the store's read
    window) (half to device slots, a quarter to the RAM cache). Unified memory (the
    device is the `cpu`, unless `tc.unified` says otherwise) gives the RAM budget to device
    slots: an expert in RAM is then computed where it lies, with no copy into a slot."""
    total = n_layers * num_experts * expert_bytes
    avail = max(0, memlimit.available() - WORKSPACE - reserve)
    device = tc.device_bytes if tc.device_bytes is not None else min(total, avail // 2)
    slots = max(1, min(num_experts, device // max(1, n_layers * expert_bytes)))
    if tc.cap:
        slots = min(slots, tc.cap)
    left = max(0, total - n_layers * slots * expert_bytes)
    ram = tc.ram_bytes if tc.ram_bytes is not None else min(left, avail // 4)
    if tc.unified if tc.unified is not None else cpu:
        more = min(ram, left) // max(1, n_layers * expert_bytes)
        slots, ram = min(num_experts, slots + more), 0
        if tc.cap:
            slots = min(slots, tc.cap)
    pins = min(tc.pin_bytes // expert_bytes, n_layers * max(0, slots - 1))
    if slots >= num_experts:
        pins = 0  # everything is on device already: nothing to pin
    return Plan(slots, ram, pins)
