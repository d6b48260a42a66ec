"""The shipped demo model: its shape, its size, and the same logits in transformers and colibri."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tiny

from colibri.config import load_config
from colibri.engine.generate import generate_ids
from colibri.engine.model import load_model
from colibri.engine.runner import Runner

DEMO = Path(__file__).parent.parent / "data" / "models" / "demo"
PROMPTS = {
    "python": "def read_config(path):\n    with open(path) as f:\n",
    "c": "#include <stdint.h>\n\nstruct timespec {\n\tlong tv_sec;\n",
    "german": "Wer nicht arbeitet, soll auch nicht essen. ",
    "french": "Le paquet source contient les fichiers ",
    "shell": "_comp()\n{\n    local cur prev words cword\n    _init_completion || return\n",
}


@pytest.fixture(scope="module")
def models():
    """colibri's runner (one, so prompts of one length bucket share a compile) and transformers."""
    return Runner(load_model(DEMO, progress=False), capacity=64), tiny.hf_model(DEMO)


def test_shape_meets_the_brief():
    cfg = load_config(DEMO)
    assert cfg.family == "qwen3_moe"
    assert len(cfg.moe_layer_ids) >= 6
    assert cfg.moe.num_experts >= 32 and cfg.moe.top_k >= 4
    assert cfg.eos_token_ids and cfg.eos_token_ids[0] == cfg.vocab_size - 1


def test_folder_is_at_most_30_mb_and_complete():
    names = {p.name for p in DEMO.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert {"README.md", "loss.png"} <= names
    assert sum(p.stat().st_size for p in DEMO.iterdir()) <= 30 * 10**6


def test_readme_reports_every_domain():
    domains = json.loads((DEMO.parent.parent / "corpus" / "manifest.json").read_text())["domains"]
    readme = (DEMO / "README.md").read_text()
    for d in domains:
        assert f"| {d} |" in readme and f"### {d}" in readme


def test_tokenizer_round_trips_text_it_never_saw(models):
    tok = models[0].model.tokenizer
    s = "unseen ß → 🐦 text\n\tok Ωmega"
    assert tok.decode(tok.encode(s)) == s
    assert tok.token_id("<|endoftext|>") == tok.vocab_size - 1


@pytest.mark.parametrize("domain", list(PROMPTS))
def test_logits_match_transformers(models, domain):
    import torch

    runner, hf = models
    ids = runner.model.tokenizer.encode(PROMPTS[domain])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    ours = runner.full_logits(ids)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_greedy_generation_matches_transformers(models):
    import torch

    runner, hf = models
    tok = runner.model.tokenizer
    ids = tok.encode(PROMPTS["python"])
    ours = list(generate_ids(runner, ids, 16))
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    theirs = out[0, len(ids) :].tolist()
    assert len(ours) == 16 and ours[: len(theirs)] == theirs
    assert tok.decode(ours).strip()
