"""Expert parallel (colibri.model.parallel): the routed experts spread over several devices
(simulated CPU devices here) give the one-device tokens, through the real engine."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from engine_util import Mux, Reference, text

from colibri.protocol.codec import Gpus, Tiers

PROMPTS = ["def add(a, b):", "The quick brown fox", "int main(void) {", "Permission is hereby"]
TOKENS = 12
CTX = 128


def _four_conversations(e: Mux) -> list:
    """The PROMPTS decoded at once in four slots of engine `e`, which is then closed (status
    0): every event."""
    try:
        for rid, prompt in enumerate(PROMPTS, start=1):
            e.submit(rid, rid - 1, prompt, max_tokens=TOKENS)
        evs = e.collect(*range(1, len(PROMPTS) + 1), timeout=300)
    finally:
        status = e.close()
        e.kill()
    assert status == 0, e.stderr()
    return evs


# One slot a layer on each device and no RAM tier: experts staged from disk at every step.
TIERED = {"CAP": "1", "RAM_GB": "0"}


@pytest.mark.parametrize(
    ("family", "devices", "tiers"),
    # three in `make test` (each family once, 2 and 4 devices, resident and tiered); the other
    # three `slow`: every new mesh size and family compiles anew, and the cold suite is near
    # its budget
    [
        pytest.param("qwen3_moe", 2, {}, marks=pytest.mark.slow),
        ("qwen3_moe", 4, TIERED),
        ("deepseek_v3", 4, {}),
        pytest.param("deepseek_v3", 2, TIERED, marks=pytest.mark.slow),
        ("olmoe", 2, {}),
        pytest.param("olmoe", 4, TIERED, marks=pytest.mark.slow),
    ],
    ids=[
        "qwen3_moe-2",
        "qwen3_moe-4-tiered",
        "deepseek_v3-4",
        "deepseek_v3-2-tiered",
        "olmoe-2",
        "olmoe-4-tiered",
    ],
)
def test_experts_over_several_devices_decode_the_one_device_tokens(
    checkpoints, family, devices, tiers
):
    """DEVICES=n (n simulated CPU devices, each owning a share of every layer's experts, all
    resident or staged into each device's own slots): four conversations decoding at once in
    four slots give, token for token, what one device gives each of them alone with every
    expert resident; GPUS lists the n devices, whose experts add up to TIERS' device count."""
    model_dir = checkpoints(family)
    ref = Reference(model_dir, CTX)
    want = [ref.text(p, TOKENS) for p in PROMPTS]
    evs = _four_conversations(
        Mux(model_dir, DEVICES=str(devices), KV_SLOTS="4", CTX=str(CTX), **tiers)
    )
    assert [text(evs, rid) for rid in range(1, len(PROMPTS) + 1)] == want
    gpus = [ev for ev in evs if isinstance(ev, Gpus)][-1]
    tiers = [ev for ev in evs if isinstance(ev, Tiers)][-1]
    assert len(gpus.devices) == devices
    assert sum(d[2] for d in gpus.devices) == tiers.vram > 0
    if not tiers:
        assert all(d[2] > 0 for d in gpus.devices)


def test_more_devices_than_there_are_is_refused_by_name(checkpoints, tmp_path):
    """DEVICES above what the machine has (XLA asked for fewer CPU devices than that before
    the engine started it) stops the engine with one line that names DEVICES."""
    code = (
        "import jax\n"
        "jax.devices()\n"  # the backend started with one CPU device
        "from colibri.model import parallel\n"
        "parallel.simulate_cpu_devices(3)\n"
        "try:\n"
        "    parallel.use_devices(3)\n"
        "except ValueError as err:\n"
        "    print(err)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "DEVICES=3: only 1 local device(s)" in done.stdout
    assert "xla_force_host_platform_device_count=3" in done.stdout


def test_devices_left_unset_mean_every_accelerator_and_one_cpu_device():
    """DEVICES unset (0): every local accelerator, but one device on the CPU even where XLA
    simulates several (they share the same cores), so the engine makes no mesh there."""
    code = (
        "from colibri.model import parallel\n"
        "parallel.simulate_cpu_devices(4)\n"
        "import jax\n"
        "from colibri.engine.settings import EngineSettings\n"
        "n = EngineSettings.from_env({}).devices\n"
        "print(n, len(jax.local_devices()), parallel.use_devices(n), len(parallel.devices()))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "4", "None", "1"]

    class Device:
        def __init__(self, platform: str):
            self.platform = platform

    from colibri.model import parallel

    assert parallel.automatic([Device("gpu")] * 4) == 4
    assert parallel.automatic([Device("cpu")] * 4) == 1


_REPIN = """
import json, sys
import numpy as np
from colibri.model import parallel
parallel.use_devices(2)
from colibri.engine.model import load_model
from colibri.experts.budget import TierConfig
from colibri.experts.usage import write_usage

model_dir, usage = sys.argv[1], sys.argv[2]
probe = load_model(model_dir, progress=False)
rows, E = probe.store.stats.counts.shape
eb = probe.store.expert_bytes
counts = np.zeros((rows, E), np.int64)
counts[:, 1] = 3  # pinned at start: device 0 owns the first half of the experts
write_usage(usage, counts)
tiers = TierConfig(device_bytes=2 * eb * rows, ram_bytes=0, pin_bytes=eb * rows, repin=2)
store = load_model(model_dir, tiers=tiers, usage_path=usage, progress=False).store
pinned = [[int(e) for e in s.expert_in[s.pinned]] for s in store.slots]
store.stats.counts[:, E - 1] = 100  # the last expert, device 1's, now the hottest
events = store.repin()
print(json.dumps({"E": E, "pinned": pinned, "slots": store.slots[0].n,
                  "events": [[ev.layer, ev.expert, ev.gpu] for ev in events],
                  "after": [[int(e) for e in s.expert_in[s.pinned]] for s in store.slots],
                  "where": [int(s.slot_of[E - 1]) for s in store.slots]}))
"""


def test_xla_loops_split_over_devices_give_the_same_tokens(checkpoints):
    """Without the native kernels (as on a GPU: XLA's loops inside `shard_map`, the plan from
    the global expert count), two devices give the one-device tokens of the same loops."""
    model_dir = checkpoints("olmoe")
    one = _four_conversations(Mux(model_dir, COLIBRI_CPU_KERNELS="0", KV_SLOTS="4", CTX=str(CTX)))
    two = _four_conversations(
        Mux(model_dir, COLIBRI_CPU_KERNELS="0", DEVICES="2", KV_SLOTS="4", CTX=str(CTX))
    )
    texts = [[text(evs, rid) for rid in range(1, len(PROMPTS) + 1)] for evs in (one, two)]
    assert texts[0] == texts[1] and all(texts[0])


def test_a_pin_lands_on_the_device_that_owns_the_expert(checkpoints, tmp_path):
    """Two devices, two slots a layer each, one pin a layer: the pin starts on the hot expert
    of the usage history (device 0's); when device 1's last expert becomes the hottest, REPIN
    moves the pin to it, into a slot of device 1, and names device 1."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    done = subprocess.run(
        [sys.executable, "-c", _REPIN, str(checkpoints("qwen3_moe")), str(tmp_path / "usage")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    E, per = got["E"], got["slots"] // 2
    assert all(p == [1] for p in got["pinned"])
    assert got["events"] == [[row, E - 1, 1] for row in range(len(got["pinned"]))]
    assert all(p == [E - 1] for p in got["after"])
    assert all(per <= slot < 2 * per for slot in got["where"])  # device 1's slots


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_serve_one_session_with_the_one_process_tokens(checkpoints):
    """Two engine processes on 127.0.0.1 (`jax.distributed`, two simulated CPU devices each):
    the experts spread over all four devices, process 0 serves a mux session of four
    conversations in four slots whose tokens are the one-process ones; process 1 repeats its
    runner's calls, writes nothing to stdout and exits 0 when process 0 ends."""
    model_dir = checkpoints("qwen3_moe")
    ref = Reference(model_dir, CTX)
    want = [ref.text(p, TOKENS) for p in PROMPTS]
    common = dict(
        DEVICES="2",
        COORDINATOR=f"127.0.0.1:{_free_port()}",
        PROCESSES="2",
        KV_SLOTS="4",
        CTX=str(CTX),
    )
    env = dict(os.environ, SERVE_BATCH="1", PROCESS_ID="1", **common)
    cmd = [sys.executable, "-m", "colibri.cli", "engine", "--model", str(model_dir)]
    follower = subprocess.Popen(
        cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        evs = _four_conversations(Mux(model_dir, PROCESS_ID="0", **common))
        out, err = follower.communicate(timeout=120)
    finally:
        follower.kill()
    assert [text(evs, rid) for rid in range(1, len(PROMPTS) + 1)] == want
    assert follower.returncode == 0, err.decode()[-3000:]
    assert out == b""
    assert "process 1 follows process 0" in err.decode()
    gpus = [ev for ev in evs if isinstance(ev, Gpus)][-1]
    assert len(gpus.devices) == 4


def test_several_processes_need_a_coordinator_and_a_number_each():
    """PROCESSES above 1 without COORDINATOR, or a PROCESS_ID past the last, is refused with a
    message naming the variable."""
    from colibri.engine.settings import EngineSettings, SettingsError

    with pytest.raises(SettingsError, match="COORDINATOR"):
        EngineSettings.from_env({"PROCESSES": "2"})
    with pytest.raises(SettingsError, match="PROCESS_ID"):
        EngineSettings.from_env({"PROCESSES": "2", "COORDINATOR": "h:1", "PROCESS_ID": "2"})
    s = EngineSettings.from_env({"PROCESSES": "2", "COORDINATOR": "h:1", "PROCESS_ID": "1"})
    assert (s.processes, s.process_id, s.coordinator) == (2, 1, "h:1")
    assert EngineSettings.from_env(s.to_env()) == s
