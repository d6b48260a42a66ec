"""Expert parallel (colibri.model.parallel): the routed experts spread over several devices
(simulated CPU devices here) give the one-device tokens, through the real engine."""

from __future__ import annotations

import subprocess
import sys

import pytest
from engine_util import Mux, Reference, text

from colibri.protocol.codec import Gpus, Tiers

PROMPTS = ["def add(a, b):", "The quick brown fox", "int main(void) {", "Permission is hereby"]
TOKENS = 12
CTX = 128


@pytest.mark.parametrize(
    ("family", "devices"),
    [("qwen3_moe", 2), ("qwen3_moe", 4), ("deepseek_v3", 4), ("olmoe", 2)],
)
def test_experts_over_several_devices_decode_the_one_device_tokens(checkpoints, family, devices):
    """DEVICES=n (n simulated CPU devices, each owning a share of every layer's experts): four
    conversations decoding at once in four slots give, token for token, what one device gives
    each of them alone; GPUS lists the n devices, whose resident experts add up to TIERS'."""
    model_dir = checkpoints(family)
    ref = Reference(model_dir, CTX)
    want = [ref.text(p, TOKENS) for p in PROMPTS]
    e = Mux(model_dir, DEVICES=str(devices), KV_SLOTS="4", CTX=str(CTX))
    try:
        for rid, prompt in enumerate(PROMPTS, start=1):
            e.submit(rid, rid - 1, prompt, max_tokens=TOKENS)
        evs = e.collect(*range(1, len(PROMPTS) + 1), timeout=300)
    finally:
        status = e.close()
        e.kill()
    assert status == 0, e.stderr()
    assert [text(evs, rid) for rid in range(1, len(PROMPTS) + 1)] == want
    gpus = [ev for ev in evs if isinstance(ev, Gpus)][-1]
    tiers = [ev for ev in evs if isinstance(ev, Tiers)][-1]
    assert len(gpus.devices) == devices
    assert sum(d[2] for d in gpus.devices) == tiers.vram > 0
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
