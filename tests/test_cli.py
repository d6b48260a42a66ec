"""`colibri generate` prints exactly the generated text on stdout, and logs only on stderr."""

from __future__ import annotations

import subprocess
import sys

import pytest

from colibri.engine.generate import generate_ids
from colibri.engine.model import load_model
from colibri.engine.runner import Runner


def _generate(model_dir, *extra):
    cmd = [sys.executable, "-m", "colibri.cli", "generate", "--model", str(model_dir), *extra]
    return subprocess.run(cmd, capture_output=True, timeout=300)


def test_generate_prints_only_greedy_text(checkpoints):
    d = checkpoints("qwen3_moe")
    r = _generate(d, "--prompt", "The quick brown", "--max-tokens", "12")
    assert r.returncode == 0, r.stderr.decode()
    model = load_model(d, progress=False)
    ids = model.tokenizer.encode("The quick brown")
    toks = generate_ids(Runner(model, capacity=64), ids, 12, stop_ids=model.cfg.eos_token_ids)
    expected = b"".join(model.tokenizer.token_bytes(t) for t in toks) + b"\n"
    assert r.stdout == expected


def test_sampling_is_seeded(checkpoints):
    d = checkpoints("olmoe")
    args = ("--prompt", "Der schnelle", "--max-tokens", "16", "--temperature", "1.0")
    a = _generate(d, *args, "--top-p", "0.9", "--seed", "1")
    b = _generate(d, *args, "--top-p", "0.9", "--seed", "1")
    c = _generate(d, *args, "--seed", "2")
    assert a.returncode == b.returncode == c.returncode == 0
    assert a.stdout == b.stdout
    assert a.stdout != c.stdout


def test_synth_fp8_then_generate_with_experts_on_disk(tmp_path):
    """`colibri synth --dtype fp8` writes a block-quantized checkpoint that `colibri generate`
    decodes with its experts streamed from disk through a small device cache: the same text
    as the resident model."""
    out = tmp_path / "fp8"
    synth = [sys.executable, "-m", "colibri.cli", "synth", "--family", "deepseek_v3"]
    synth += ["--layers", "3", "--experts", "8", "--top-k", "2", "--hidden", "64"]
    synth += ["--moe-ff", "32", "--vocab", "300", "--dtype", "fp8", "--fp8-block", "16"]
    r = subprocess.run([*synth, "--out", str(out)], capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    config = (out / "config.json").read_text()
    assert '"quant_method": "fp8"' in config and '"weight_block_size": [\n      16' in config
    args = ("--prompt", "def add", "--max-tokens", "10")
    resident = _generate(out, *args)
    tiered = _generate(out, *args, "--device-gb", "0.00004", "--ram-gb", "0.00002")  # 2 slots
    assert resident.returncode == tiered.returncode == 0, tiered.stderr.decode()
    assert resident.stdout == tiered.stdout and len(resident.stdout) > 1
    assert b"fp8 rows" in resident.stderr  # the load summary says how the experts are held
    assert b"disk" in tiered.stderr


@pytest.mark.parametrize(
    "dtype, method, held",
    [
        ("int4", "compressed-tensors", b"routed experts as int4 rows"),
        ("gptq4", "gptq", b"routed experts as int4 rows"),
        ("awq4", "awq", b"routed experts as int4 rows with zero points"),
        ("gptq8", "gptq", b"routed experts as int8 rows"),
    ],
)
def test_synth_int4_then_generate_with_experts_on_disk(tmp_path, dtype, method, held):
    """`colibri synth --dtype int4` writes a compressed-tensors W4A16 checkpoint (`gptq4` a
    GPTQ one, `awq4` an AWQ one, `gptq8` an 8-bit GPTQ one) that `colibri generate` decodes
    resident and with its experts read from disk (packed, a quarter of the bytes of bf16 or
    half): the same text."""
    out = tmp_path / dtype
    synth = [sys.executable, "-m", "colibri.cli", "synth", "--family", "qwen2_moe"]
    synth += ["--layers", "2", "--experts", "8", "--top-k", "2", "--hidden", "64"]
    synth += ["--moe-ff", "32", "--vocab", "300", "--dtype", dtype, "--group", "16"]
    r = subprocess.run([*synth, "--out", str(out)], capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    config = (out / "config.json").read_text()
    assert f'"quant_method": "{method}"' in config and '"group_size": 16' in config
    args = ("--prompt", "def add", "--max-tokens", "10")
    resident = _generate(out, *args)
    tiered = _generate(out, *args, "--device-gb", "0.00005", "--ram-gb", "0")  # 7 slots of 8
    assert resident.returncode == tiered.returncode == 0, tiered.stderr.decode()
    assert resident.stdout == tiered.stdout and len(resident.stdout) > 1
    assert held in resident.stderr
    assert b", 0 on disk" in resident.stderr and b"16 on disk" in tiered.stderr
