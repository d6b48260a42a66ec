"""Host and accelerator snapshots for the HWINFO and GPUS telemetry lines, and peak RSS."""

from __future__ import annotations

import glob
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


@lru_cache(maxsize=1)
def cpu_detail() -> str:
    """`cpu_name` with what the kernels' speed turns on, for benchmark reports: on x86 the
    family and model (and AMD's core generation, as virtual machines name every EPYC alike),
    the widest vector extensions, and a core's L1d and L2, e.g. "AMD EPYC (Zen 5: family 26
    model 2; AVX-512 BF16; 48 KiB L1d, 1 MiB L2 a core)"."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    parts = []
    if "cpu family" in info and "model" in info:
        family, model = int(info["cpu family"]), int(info["model"])
        zen = _zen(family, model) if info.get("vendor_id") == "AuthenticAMD" else ""
        parts.append(f"{zen + ': ' if zen else ''}family {family} model {model}")
    flags = set(info.get("flags", "").split())
    if "avx512f" in flags:
        extras = [n for f, n in (("avx512_bf16", "BF16"), ("amx_tile", "AMX")) if f in flags]
        parts.append(" ".join(["AVX-512", *extras]))
    elif "avx2" in flags:
        parts.append("AVX2")
    caches = []
    for level, kind in ((1, "Data"), (2, "Unified")):
        for index in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*")):
            try:
                with open(f"{index}/level") as f1, open(f"{index}/type") as f2:
                    if (int(f1.read()), f2.read().strip()) != (level, kind):
                        continue
                with open(f"{index}/size") as f3:
                    kib = int(f3.read().strip().rstrip("K"))
            except (OSError, ValueError):
                continue
            size = f"{kib >> 10} MiB" if kib % 1024 == 0 else f"{kib} KiB"
            caches.append(f"{size} L{level}{'d' if level == 1 else ''}")
            break
    if caches:
        parts.append(", ".join(caches) + " a core")
    return f"{cpu_name()} ({'; '.join(parts)})" if parts else cpu_name()


def _zen(family: int, model: int) -> str:
    """AMD's core generation by CPU family and model ("" where unknown)."""
    if family == 0x17:
        return "Zen 2" if model >= 0x30 else "Zen"
    if family == 0x19:
        return "Zen 4" if 0x10 <= model < 0x20 or 0x60 <= model < 0x80 or 0xA0 <= model else "Zen 3"
    return "Zen 5" if family == 0x1A else ""


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
