"""Host and accelerator snapshots for the HWINFO and GPUS telemetry lines, and peak RSS."""

from __future__ import annotations

import os
import platform
import resource
import sys
from dataclasses import dataclass
from functools import lru_cache

import jax
import numpy as np
import psutil

from colibri.experts.stats import TIER_DEVICE
from colibri.model import parallel

GIB = float(1 << 30)


@dataclass(frozen=True)
class Host:
    """What HWINFO reports."""

    cores: int
    ram_total_gb: float
    ram_avail_gb: float
    ngpu: int
    vram_total_gb: float
    cpu_name: str
    gpu_name: str


@dataclass(frozen=True)
class Device:
    """One accelerator for GPUS: memory in use, its total, resident experts."""

    used_gb: float
    total_gb: float
    experts: int


def peak_rss_gb() -> float:
    """Peak resident set size of this process, GiB.

    Linux: VmHWM of /proc/self/status, the high-water mark of this program's own memory
    (ru_maxrss also counts what the parent held when it forked us, kept across exec).
    Elsewhere ru_maxrss (KiB on Linux, bytes on macOS).
    """
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) / (1 << 20)  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / GIB if sys.platform == "darwin" else peak / (1 << 20)


def host() -> Host:
    mem = psutil.virtual_memory()
    gpus = _gpus()
    return Host(
        cores=psutil.cpu_count(logical=True) or os.cpu_count() or 1,
        ram_total_gb=mem.total / GIB,
        ram_avail_gb=mem.available / GIB,
        ngpu=len(gpus),
        vram_total_gb=sum(_memory(d)[1] for d in gpus) / GIB,
        cpu_name=cpu_name(),
        gpu_name=" ".join(gpus[0].device_kind.split()) if gpus else "",
    )


def devices(resident_experts: int, emap: bytes = b"", experts: int = 0) -> list[Device]:
    """With the experts spread over several devices (`parallel`): each of them, with the
    device-tier experts it owns (read from the tiers of EMAP's bytes, `experts` to a row).
    Otherwise every GPU, the resident experts counted on the first (a CPU alone: none)."""
    if parallel.mesh() is not None and experts:
        tier = np.frombuffer(emap, np.uint8).reshape(-1, experts) >> 6
        owned = np.sum(tier == TIER_DEVICE, axis=0)  # by expert, over the layers
        owner = np.arange(experts) // parallel.share(experts)  # as `parallel.owner` says
        out = []
        for i, d in enumerate(parallel.devices()):
            used, total = _memory(d)
            out.append(Device(used / GIB, total / GIB, int(owned[owner == i].sum())))
        return out
    out = []
    for i, d in enumerate(_gpus()):
        used, total = _memory(d)
        out.append(Device(used / GIB, total / GIB, resident_experts if i == 0 else 0))
    return out


@lru_cache(maxsize=1)
def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (platform's guess elsewhere), without '|' or newlines."""
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Hardware", "Processor"):
                    name = value.strip()
                    break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine() or "cpu"
    return " ".join(name.replace("|", "/").split())


def _gpus() -> list:
    try:
        return [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        return []


def _memory(device) -> tuple[int, int]:
    """(bytes in use, byte limit) of a device, zeros where the backend does not say."""
    try:
        stats = device.memory_stats() or {}
    except Exception:
        stats = {}
    return int(stats.get("bytes_in_use", 0)), int(stats.get("bytes_limit", 0))
