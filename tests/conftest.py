"""Shared fixtures: tiny checkpoints built once per session with transformers (no network)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# Tests and the engines they spawn share the user's persistent XLA cache (~/.cache/colibri/jax,
# or COLIBRI_JAX_CACHE): a second run on the same machine skips most compilation.

import tiny  # noqa: E402

FAMILIES = list(tiny.FAMILY_CONFIGS)
VARIANTS = list(tiny.VARIANTS)  # checkpoints(name) of a family built with other settings


def pytest_configure(config):
    """Build the native CPU kernels once, before any engine subprocess would (first build:
    about 25 s here), so that no engine's start-up waits on the compiler; and the narrower
    builds this CPU can run (`kernels.isa_levels`, for test_kernels), at the same time."""
    from concurrent.futures import ThreadPoolExecutor

    from colibri import kernels

    with ThreadPoolExecutor() as pool:  # the compilers run as processes of their own
        list(pool.map(lambda isa: kernels.build(isa=isa), kernels.isa_levels()))


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """checkpoints(family, dtype="float32") -> folder of a tiny random checkpoint (memoised;
    family: one of FAMILIES or VARIANTS);
    dtype "fp8": the float32 one with its linear layers block-quantized (8 x 8 blocks); "int4",
    "int8": pack-quantized (compressed-tensors, a scale per 8 columns); "gptq4", "gptq8": GPTQ
    (symmetric, a scale per 8 columns); "awq4": AWQ (zero points, a scale per 8 columns)."""
    built: dict[tuple[str, str], Path] = {}

    def get(family: str, dtype: str = "float32") -> Path:
        key = (family, dtype)
        if key not in built:
            out = tmp_path_factory.mktemp(f"{family}-{dtype}")
            if dtype == "fp8":
                built[key] = tiny.to_fp8(get(family), out, block=8)
            elif dtype in ("int4", "int8"):
                built[key] = tiny.to_packed(get(family), out, int(dtype[3:]), group=8)
            elif dtype in ("gptq4", "gptq8"):
                built[key] = tiny.to_gptq(get(family), out, int(dtype[4:]), group=8)
            elif dtype == "awq4":
                built[key] = tiny.to_gptq(get(family), out, 4, group=8, fmt="awq")
            else:
                built[key] = tiny.build(family, out, dtype=dtype)
        return built[key]

    return get
