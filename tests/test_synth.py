"""`colibri synth` writes checkpoints transformers loads, and colibri computes the same logits."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tiny
from conftest import FAMILIES

from colibri.checkpoint import Checkpoint
from colibri.engine.model import load_model
from colibri.engine.runner import Runner
from colibri.synth import SynthSpec, synthesize

SMALL = dict(layers=3, experts=8, top_k=2, hidden=64, moe_ff=32, vocab=300)


@pytest.mark.parametrize("family", FAMILIES)
def test_synth_checkpoint_matches_transformers(family, tmp_path):
    d = synthesize(SynthSpec(family=family, **SMALL), tmp_path / family, progress=False)
    model = load_model(d, progress=False)
    ids = model.tokenizer.encode("def forward(x): The router sends")
    ref = tiny.hf_logits(d, ids)
    np.testing.assert_allclose(Runner(model, capacity=64).full_logits(ids), ref, atol=1e-4)


def test_synth_shards_and_bf16(tmp_path):
    spec = SynthSpec(family="olmoe", dtype="bf16", shard_mb=0.1, seed=3, **SMALL)
    d = synthesize(spec, tmp_path / "bf16", progress=False)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    ckpt = Checkpoint(d)
    assert {t.dtype for t in ckpt.tensors.values()} == {"BF16"}
    assert set(index["weight_map"]) == set(ckpt.tensors)
    model = load_model(d, progress=False)
    ids = model.tokenizer.encode("Les experts sont")
    np.testing.assert_allclose(
        Runner(model, capacity=64).full_logits(ids), tiny.hf_logits(d, ids), atol=1e-4
    )


def test_synth_is_deterministic(tmp_path):
    a = synthesize(SynthSpec(**SMALL, seed=7), tmp_path / "a", progress=False)
    b = synthesize(SynthSpec(**SMALL, seed=7), tmp_path / "b", progress=False)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_synth_rejects_bad_spec(tmp_path):
    with pytest.raises(ValueError, match="top_k=9 exceeds experts=8"):
        synthesize(SynthSpec(experts=8, top_k=9), tmp_path, progress=False)
    with pytest.raises(ValueError, match="family='llama'"):
        synthesize(SynthSpec(family="llama"), tmp_path, progress=False)
