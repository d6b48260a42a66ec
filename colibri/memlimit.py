"""How much memory this process may still take: the host's available memory, or less when a
memory cgroup (v1 `memory.limit_in_bytes`, v2 `memory.max`) caps this process or an ancestor.

Inside a container or a capped cgroup the host's MemAvailable overstates what can be used; a
budget sized from it gets the process OOM-killed. The headroom of a capped cgroup is its limit
less its usage, with its inactive page cache counted as free (the kernel reclaims it before it
kills): the expert files read through the page cache do not eat the budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psutil

UNLIMITED = 1 << 60  # limits at or above this are "none" (v1 writes 2^63 rounded to a page)


@dataclass(frozen=True)
class CgroupMemory:
    """One capped cgroup on this process's path: where it is and what it allows."""

    path: Path
    limit: int
    usage: int
    reclaimable: int  # inactive file pages

    @property
    def headroom(self) -> int:
        return max(0, self.limit - self.usage + self.reclaimable)


def available(proc: Path = Path("/proc")) -> int:
    """Bytes this process may still take: MemAvailable, or the smallest headroom of a capped
    memory cgroup it is in (itself or an ancestor), whichever is less."""
    host = psutil.virtual_memory().available
    return min([host, *(c.headroom for c in capped_cgroups(proc))])


def limit(proc: Path = Path("/proc")) -> int | None:
    """The tightest memory cgroup limit over this process, None when none caps it."""
    caps = [c.limit for c in capped_cgroups(proc)]
    return min(caps) if caps else None


def capped_cgroups(proc: Path = Path("/proc")) -> list[CgroupMemory]:
    """The memory cgroups with a limit on this process's path, v1 and v2, from its own up to
    the mount's root; [] where /proc or the cgroup files cannot be read."""
    found = []
    for here, mount, v2 in own_cgroups(proc):
        while True:
            cap = _read(here, v2)
            if cap is not None:
                found.append(cap)
            if here == mount or mount not in here.parents:
                break
            here = here.parent
    return found


def own_cgroups(proc: Path = Path("/proc")) -> list[tuple[Path, Path, bool]]:
    """(folder, its mount point, whether v2) of each memory cgroup this process is in."""
    try:
        membership = (proc / "self" / "cgroup").read_text().splitlines()
        mounts = (proc / "self" / "mountinfo").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in membership:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        v2 = hierarchy == "0" and controllers == ""
        if not v2 and "memory" not in controllers.split(","):
            continue
        for root, mount in _mounts(mounts, v2):
            inside = Path(path).is_relative_to(root)
            rel = Path(path).relative_to(root) if inside else Path(path.lstrip("/"))
            out.append((Path(mount) / rel, Path(mount), v2))
    return out


def _mounts(lines: list[str], v2: bool) -> list[tuple[str, str]]:
    """(root inside the hierarchy, mount point) of each cgroup mount of the wanted version."""
    out = []
    for line in lines:
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if len(fields) < sep + 3 or len(fields) < 5:
            continue
        fstype, options = fields[sep + 1], fields[sep + 3].split(",")
        if (v2 and fstype == "cgroup2") or (not v2 and fstype == "cgroup" and "memory" in options):
            out.append((fields[3], fields[4]))
    return out


def _read(folder: Path, v2: bool) -> CgroupMemory | None:
    files = (
        ("memory.max", "memory.current")
        if v2
        else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    )
    try:
        raw_limit, raw_usage = ((folder / f).read_text().strip() for f in files)
        stat = (folder / "memory.stat").read_text()
    except OSError:
        return None
    if raw_limit == "max" or not raw_limit.isdigit() or int(raw_limit) >= UNLIMITED:
        return None
    key = "inactive_file" if v2 else "total_inactive_file"
    values = dict(line.split()[:2] for line in stat.splitlines() if len(line.split()) >= 2)
    inactive = int(values.get(key, 0)) if str(values.get(key, "0")).isdigit() else 0
    usage = int(raw_usage) if raw_usage.isdigit() else 0
    return CgroupMemory(folder, int(raw_limit), usage, inactive)
