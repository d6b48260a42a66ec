"""Budgets that fit the box: the memory a process may take is the tightest memory cgroup's
headroom when one caps it (v1 and v2, itself or an ancestor), else the host's; an engine with no
tier settings runs inside a cap it would overrun otherwise, and decodes the same tokens."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from colibri import memlimit
from colibri.synth import SynthSpec, synthesize

MiB = 2**20


def fake_proc(tmp: Path, cgroup: str, mount_line: str) -> Path:
    proc = tmp / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "mountinfo").write_text(
        "22 1 0:21 / /proc rw,nosuid - proc proc rw\n" + mount_line + "\n"
    )
    return proc


def cgroup_dir(folder: Path, v2: bool, limit: str, usage: int, inactive: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    names = (
        ("memory.max", "memory.current")
        if v2
        else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    )
    (folder / names[0]).write_text(f"{limit}\n")
    (folder / names[1]).write_text(f"{usage}\n")
    key = "inactive_file" if v2 else "total_inactive_file"
    (folder / "memory.stat").write_text(f"cache 5\n{key} {inactive}\nrss 7\n")


def test_v1_the_tightest_headroom_on_the_path_wins(tmp_path):
    mount = tmp_path / "sys" / "memory"
    proc = fake_proc(
        tmp_path,
        "5:cpu:/x\n4:memory:/a/b\n0::/\n",
        f"30 25 0:26 / {mount} rw,nosuid - cgroup cgroup rw,memory",
    )
    cgroup_dir(mount, False, str(2**63 - 4096), 9000, 0)  # the root: no limit
    cgroup_dir(mount / "a", False, str(800 * MiB), 700 * MiB, 0)  # 100 MiB left
    cgroup_dir(mount / "a" / "b", False, str(1000 * MiB), 600 * MiB, 100 * MiB)  # 500 left
    caps = memlimit.capped_cgroups(proc)
    assert [c.path for c in caps] == [mount / "a" / "b", mount / "a"]
    assert [c.headroom for c in caps] == [500 * MiB, 100 * MiB]
    assert memlimit.limit(proc) == 800 * MiB
    assert memlimit.available(proc) == 100 * MiB


def test_v2_reads_memory_max_and_skips_max(tmp_path):
    mount = tmp_path / "unified"
    proc = fake_proc(tmp_path, "0::/svc/job\n", f"31 25 0:27 / {mount} rw - cgroup2 cgroup2 rw")
    cgroup_dir(mount / "svc", True, "max", 10, 0)
    cgroup_dir(mount / "svc" / "job", True, str(300 * MiB), 250 * MiB, 20 * MiB)
    [cap] = memlimit.capped_cgroups(proc)
    assert (cap.limit, cap.headroom) == (300 * MiB, 70 * MiB)
    assert memlimit.available(proc) == 70 * MiB


def test_a_namespaced_mount_whose_root_is_the_cgroup_itself(tmp_path):
    """In a container the mount's root is the process's own cgroup: its folder is the mount."""
    mount = tmp_path / "memory"
    proc = fake_proc(
        tmp_path,
        "4:memory:/docker/abc\n",
        f"40 30 0:28 /docker/abc {mount} ro - cgroup cgroup rw,memory",
    )
    cgroup_dir(mount, False, str(512 * MiB), 100 * MiB, 0)
    assert memlimit.limit(proc) == 512 * MiB


def test_no_cgroup_files_means_the_host_figure(tmp_path):
    assert memlimit.capped_cgroups(tmp_path / "nothing") == []
    assert memlimit.limit(tmp_path / "nothing") is None
    assert memlimit.available(tmp_path / "nothing") > 0


def _child_cgroup(name: str, limit: int) -> Path:
    """A new memory cgroup (v1) under this process's own, capped at `limit`; skips the test
    with the reason when this machine does not allow one."""
    for folder, _, v2 in memlimit.own_cgroups():
        if v2:
            continue  # v2 needs the memory controller delegated to the subtree; v1 is enough
        child = folder / name
        try:
            child.mkdir(exist_ok=True)
            (child / "memory.limit_in_bytes").write_text(str(limit))
        except OSError as err:
            pytest.skip(f"cannot create a memory cgroup under {folder}: {err}")
        return child
    pytest.skip("no cgroup v1 memory controller mounted for this process")


def on_disk(log: bytes) -> list[int]:
    """The experts on disk in each store summary the log holds (at load, at the end)."""
    return [int(n) for n in re.findall(rb"in RAM, (\d+) on disk", log)]


def _generate(model: Path, cgroup: Path | None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "colibri.cli", "generate", "--model", str(model)]
    cmd += ["--prompt", "the experts of this model", "--max-tokens", "12"]
    env = {k: v for k, v in os.environ.items() if k not in ("DEVICE_GB", "RAM_GB", "PIN_GB")}
    if cgroup is not None:  # move the shell into the cgroup, then become the engine
        script = f'echo $$ > {cgroup}/cgroup.procs && exec "$@"'
        cmd = ["sh", "-c", script, "sh", *cmd]
    return subprocess.run(cmd, capture_output=True, env=env, timeout=300)


def test_automatic_budgets_fit_a_cgroup_cap_and_decode_the_same_tokens(tmp_path):
    """192 MiB of float32 experts: uncapped, every expert is placed on device and the process
    peaks well above 400 MiB. Capped at 400 MiB with no tier settings, the budgets come from the
    cgroup's headroom: experts are tiered, nothing is killed, and the greedy tokens are those
    of the uncapped run."""
    cap = 400 * MiB
    group = _child_cgroup(f"colibri-test-{os.getpid()}", cap)
    try:
        spec = SynthSpec(
            family="qwen3_moe", layers=4, experts=32, top_k=4, hidden=256, moe_ff=512, vocab=300
        )
        model = synthesize(spec, tmp_path / "m", progress=False)
        free = _generate(model, None)
        assert free.returncode == 0, free.stderr.decode()[-2000:]
        assert on_disk(free.stderr) == [0, 0]  # uncapped: all of them resident, at load and end
        capped = _generate(model, group)
        assert capped.returncode == 0, capped.stderr.decode()[-2000:]
        assert capped.stdout == free.stdout and capped.stdout.strip()
        assert min(on_disk(capped.stderr)) > 0  # tiered: some experts stay on disk
        peak = int((group / "memory.max_usage_in_bytes").read_text())
        assert peak <= cap
        assert "oom_kill 0" in (group / "memory.oom_control").read_text()
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            subprocess.run(["kill", "-9", pid], check=False)
        group.rmdir()
