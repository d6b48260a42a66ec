"""The engine's settings schema: the one place its environment variables are named, read and
written back exactly."""

from __future__ import annotations

import ast
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from colibri.engine.settings import WIRES, EngineSettings, child_env
from colibri.experts.budget import POLICIES, GiB, TierConfig
from colibri.formats import Holding

PACKAGE = Path(__file__).resolve().parent.parent / "colibri"
SCHEMA = {PACKAGE / "engine" / "settings.py", PACKAGE / "experts" / "budget.py"}
SCHEMA |= {PACKAGE / "formats.py"}

budgets = st.one_of(st.none(), st.integers(0, 64 * GiB))
tiers = st.builds(
    TierConfig,
    device_bytes=budgets,
    ram_bytes=budgets,
    pin_bytes=st.integers(0, 4 * GiB),
    cap=st.integers(0, 64),
    policy=st.sampled_from(POLICIES),
    repin=st.integers(0, 100),
    pilot=st.booleans(),
    direct_io=st.booleans(),
    io_threads=st.integers(1, 16),
    unified=st.one_of(st.none(), st.booleans()),
)
settings = st.builds(
    EngineSettings,
    serve_batch=st.booleans(),
    kv_slots=st.integers(1, 16),
    ctx=st.one_of(st.none(), st.integers(2, 1 << 20)),
    ngen=st.integers(0, 10_000),
    serve_topk=st.booleans(),
    kvsave=st.booleans(),
    seed=st.integers(0, 2**31),
    burst=st.integers(1, 6),
    burst_ms=st.integers(0, 10_000),
    stream_ms=st.integers(0, 10_000),
    wire=st.sampled_from(WIRES),
    profile=st.booleans(),
    warmup=st.booleans(),
    state_dir=st.one_of(st.none(), st.sampled_from(["/tmp/state", "rel/dir"])),
    tiers=tiers,
    holding=st.builds(
        Holding,
        bf16=st.booleans(),
        fp8=st.booleans(),
        int4=st.sampled_from(["all", "experts", "none"]),
        int8=st.sampled_from(["all", "experts", "none"]),
    ),
)


@given(settings)
def test_settings_round_trip_through_the_environment(s):
    env = s.to_env()
    assert set(env) <= set(EngineSettings.VARIABLES)
    assert EngineSettings.from_env(env) == s


def test_a_child_environment_drops_every_inherited_engine_variable():
    base = {name: "junk" for name in EngineSettings.VARIABLES} | {"PATH": "/bin"}
    env = child_env(EngineSettings(kv_slots=3), base)
    assert env["PATH"] == "/bin" and env["KV_SLOTS"] == "3"
    assert "CTX" not in env and "DEVICE_GB" not in env and "SERVE" not in env
    assert EngineSettings.from_env(env) == EngineSettings(kv_slots=3)


def test_defaults_give_way_to_the_environment():
    assert EngineSettings.from_env({}, wire="upstream").wire == "upstream"
    assert EngineSettings.from_env({"WIRE": "full"}, wire="upstream").wire == "full"


def test_no_other_module_names_an_engine_variable():
    names = set(EngineSettings.VARIABLES)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in SCHEMA:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.value}")
    assert found == []
