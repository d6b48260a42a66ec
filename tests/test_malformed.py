"""Malformed checkpoints and a KV cache beyond memory, through the real command line: each ends
in exit status 2, nothing on stdout and one `colibri: error:` line naming the file (or CTX) and
the field or tensor, never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from colibri.config import load_config
from colibri.engine.factory import kv_cache_bytes
from colibri.model import transformer
from colibri.synth import SynthSpec, synthesize

SMALL = dict(layers=2, experts=4, top_k=2, hidden=64, moe_ff=16, vocab=300)
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """The tiny checkpoint of test_errors.py, in one file and sharded."""
    root = tmp_path_factory.mktemp("malformed")
    return {
        "single": synthesize(SynthSpec(**SMALL), root / "single", progress=False),
        "sharded": synthesize(SynthSpec(**SMALL, shard_mb=0.05), root / "sharded", progress=False),
    }


def _edit_header(d: Path, change: Callable[[dict], object]) -> None:
    """Rewrite the JSON header of d/model.safetensors as change(header) returns it."""
    path = d / "model.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    text = json.dumps(change(json.loads(data[8 : 8 + n]))).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])


def _entry(header: dict, key: str, value=None, drop: bool = False) -> dict:
    """The header with its first tensor entry's `key` set to value (or dropped)."""
    meta = header[next(k for k in header if k != "__metadata__")]
    if drop:
        del meta[key]
    else:
        meta[key] = value
    return header


def _edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _write(name: str, value) -> Callable[[Path], None]:
    return lambda d: (d / name).write_text(json.dumps(value))


# id: (source, how the copy is broken, the file named, what else the line names)
CASES = {
    "header-is-a-list": (
        "single",
        lambda d: _edit_header(d, lambda h: [h]),
        "model.safetensors",
        ["corrupt safetensors header", "not a list"],
    ),
    "entry-without-data_offsets": (
        "single",
        lambda d: _edit_header(d, lambda h: _entry(h, "data_offsets", drop=True)),
        "model.safetensors",
        ["'model.embed_tokens.weight'", "data_offsets=None"],
    ),
    "entry-shape-null": (
        "single",
        lambda d: _edit_header(d, lambda h: _entry(h, "shape", None)),
        "model.safetensors",
        ["'model.embed_tokens.weight'", "shape=None"],
    ),
    "index-is-a-list": (
        "sharded",
        _write(INDEX, [{"weight_map": {}}]),
        INDEX,
        ["shard index", "weight_map", "not a list"],
    ),
    "weight_map-not-an-object": (
        "sharded",
        _write(INDEX, {"metadata": {}, "weight_map": ["model-00001-of-00002.safetensors"]}),
        INDEX,
        ["weight_map=['model-00001-of-00002.safetensors']", "must be an object"],
    ),
    "config-is-a-list": ("single", _write("config.json", [{}]), "config.json", ["not a list"]),
    "head_dim-string": (
        "single",
        lambda d: _edit_config(d, head_dim="x"),
        "config.json",
        ["head_dim='x'", "positive integer"],
    ),
    "num_key_value_heads-list": (
        "single",
        lambda d: _edit_config(d, num_key_value_heads=[2]),
        "config.json",
        ["num_key_value_heads=[2]", "positive integer"],
    ),
    "rms_norm_eps-null": (
        "single",
        lambda d: _edit_config(d, rms_norm_eps=None),
        "config.json",
        ["rms_norm_eps=None", "positive number"],
    ),
    "decoder_sparse_step-0": (
        "single",
        lambda d: _edit_config(d, decoder_sparse_step=0),
        "config.json",
        ["decoder_sparse_step=0", "positive integer"],
    ),
    "mlp_only_layers-int": (
        "single",
        lambda d: _edit_config(d, mlp_only_layers=5),
        "config.json",
        ["mlp_only_layers=5", "list of layer indices"],
    ),
    "max_position_embeddings-negative": (
        "single",
        lambda d: _edit_config(d, max_position_embeddings=-5),
        "config.json",
        ["max_position_embeddings=-5", "positive integer"],
    ),
    "max_position_embeddings-0": (
        "single",
        lambda d: _edit_config(d, max_position_embeddings=0),
        "config.json",
        ["max_position_embeddings=0", "positive integer"],
    ),
}


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "colibri.cli", *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def _one_error_line(r: subprocess.CompletedProcess) -> str:
    """The run's one `colibri: error:` line, after checking status 2, an empty stdout and no
    traceback."""
    stderr = r.stderr.decode(errors="replace")
    assert r.returncode == 2, stderr
    assert r.stdout == b""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("colibri: error:")]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize("case", CASES)
def test_malformed_checkpoint_is_one_error_line(case, sources, tmp_path):
    source, breaks, file, names = CASES[case]
    d = tmp_path / "bad"
    shutil.copytree(sources[source], d)
    breaks(d)
    r = _run(["generate", "--model", str(d), "--prompt", "x", "--max-tokens", "1"])
    line = _one_error_line(r)
    assert f"{d / file}:" in line
    for name in names:
        assert name in line


def test_ctx_beyond_memory_is_refused_before_loading(sources):
    """CTX x KV_SLOTS far beyond any machine's memory (16 x 10^8 positions: 763 GiB here): one
    line naming CTX, the bytes needed and the memory available, not an out-of-memory trace."""
    d = sources["single"]
    env = {"SERVE_BATCH": "1", "CTX": "100000000", "KV_SLOTS": "16"}
    line = _one_error_line(_run(["engine", "--model", str(d)], env))
    need = kv_cache_bytes(load_config(d), 16, 100_000_000)
    assert "CTX=100000000" in line and "16 slots" in line
    assert f"({need} bytes)" in line and "of memory available" in line


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_kv_cache_bytes_is_what_the_runner_allocates(family, tmp_path):
    """GQA and MLA caches: the bytes counted up front are those `init_cache` allocates."""
    spec = SynthSpec(**SMALL, family=family)
    cfg = load_config(synthesize(spec, tmp_path / family, progress=False))
    cache = transformer.init_cache(cfg, 3, 40)
    assert kv_cache_bytes(cfg, 3, 40) == sum(a.nbytes for layer in cache for a in layer.values())
