"""How benchmark reports name the CPU: `cpu_detail` against what the kernel itself says."""

from __future__ import annotations

import os
import platform
import re

import pytest

from colibri.engine.hwinfo import _zen, cpu_detail, cpu_name


@pytest.mark.skipif(
    platform.machine() != "x86_64" or not os.path.exists("/proc/cpuinfo"), reason="x86 Linux"
)
def test_cpu_detail_names_family_vectors_and_caches_as_the_kernel_reports_them():
    with open("/proc/cpuinfo") as f:
        first = f.read().split("\n\n")[0]
    field = dict(
        (k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in first.splitlines())
    )
    flags = field["flags"].split()
    detail = cpu_detail()
    assert detail.startswith(cpu_name() + " (")
    assert f"family {int(field['cpu family'])} model {int(field['model'])}" in detail
    vectors = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
    if vectors:
        assert f"; {vectors}" in detail
    assert ("BF16" in detail) == ("avx512_bf16" in flags)
    assert ("AMX" in detail) == ("amx_tile" in flags)
    sizes = re.search(r"(\d+) (KiB|MiB) L1d, (\d+) (KiB|MiB) L2 a core", detail)
    l1 = os.popen("getconf LEVEL1_DCACHE_SIZE").read().strip()
    if sizes and l1.isdigit() and int(l1):
        assert int(sizes[1]) << (10 if sizes[2] == "KiB" else 20) == int(l1)


def test_amd_generations_by_family_and_model():
    assert _zen(0x17, 0x31) == "Zen 2"  # EPYC Rome
    assert _zen(0x19, 0x01) == "Zen 3"  # Milan
    assert _zen(0x19, 0x11) == "Zen 4"  # Genoa
    assert _zen(0x19, 0xA0) == "Zen 4"  # Bergamo
    assert _zen(0x1A, 0x02) == "Zen 5"  # Turin
    assert _zen(0x06, 0x8F) == ""
