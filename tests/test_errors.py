"""Loading failures raise one clear error naming what and where; the CLI exits non-zero with it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from colibri.checkpoint import Checkpoint, CheckpointError, write_safetensors
from colibri.config import ConfigError, load_config
from colibri.engine.model import load_model
from colibri.synth import SynthSpec, synthesize

SMALL = dict(layers=2, experts=4, top_k=2, hidden=64, moe_ff=16, vocab=300)


@pytest.fixture
def ckpt(tmp_path):
    return synthesize(SynthSpec(**SMALL), tmp_path / "m", progress=False)


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def test_unknown_model_type(ckpt):
    _edit_config(ckpt, model_type="llama")
    with pytest.raises(ConfigError, match=r"config.json: model_type='llama' is not supported"):
        load_config(ckpt)


def test_bad_field_names_field_and_value(ckpt):
    _edit_config(ckpt, num_experts_per_tok=0)
    with pytest.raises(ConfigError, match="num_experts_per_tok=0"):
        load_config(ckpt)


def test_missing_tensor_names_tensor_and_file(ckpt):
    st = Checkpoint(ckpt)
    tensors = {
        n: st.read(n) for n in st.tensors if n != "model.layers.1.mlp.experts.3.up_proj.weight"
    }
    st.close()
    write_safetensors(ckpt / "model.safetensors", tensors)
    with pytest.raises(CheckpointError) as e:
        load_model(ckpt, progress=False)
    msg = str(e.value)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in msg and "model.safetensors" in msg


def test_wrong_shape_names_tensor_shapes_and_file(ckpt):
    st = Checkpoint(ckpt)
    tensors = {n: st.read(n) for n in st.tensors}
    st.close()
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:10]
    write_safetensors(ckpt / "model.safetensors", tensors)
    with pytest.raises(
        CheckpointError,
        match=r"model.safetensors: tensor 'model.norm.weight' has shape \[10\], expected \[64\]",
    ):
        load_model(ckpt, progress=False)


def test_truncated_file(ckpt):
    path = ckpt / "model.safetensors"
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(CheckpointError, match="model.safetensors: tensor .* does not fit"):
        Checkpoint(ckpt)


def test_not_a_safetensors_file(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="model.safetensors: not a safetensors file"):
        Checkpoint(ckpt)


def test_missing_shard(tmp_path):
    d = synthesize(SynthSpec(**SMALL, shard_mb=0.05), tmp_path / "s", progress=False)
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"shard {shard.name} is missing"):
        Checkpoint(d)


def test_cli_reports_error_and_exits_nonzero(ckpt, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    _edit_config(bad, model_type="gpt2")
    r = subprocess.run(
        [sys.executable, "-m", "colibri.cli", "generate", "--model", str(bad), "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert r.stdout == ""
    assert "colibri: error:" in r.stderr and "model_type='gpt2' is not supported" in r.stderr
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "colibri.cli",
            "generate",
            "--model",
            str(tmp_path / "nowhere"),
            "--prompt",
            "hi",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "no config.json" in r.stderr
