"""`colibri synth` writes checkpoints transformers loads, and colibri computes the same logits."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tiny
from conftest import FAMILIES

from colibri.checkpoint import Checkpoint
from colibri.config import FAMILIES as FAMILIES_RUN
from colibri.config import ConfigError, config_from_dict
from colibri.engine.model import load_model
from colibri.engine.runner import Runner
from colibri.synth import SynthSpec, size_fields, synthesize, synthesize_config

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


# ---- synth --config: real models' config.json (data/configs/), small sizes given ------------

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "data" / "configs").glob("*.json"))
SIZES = dict(layers=2, hidden=64, heads=4, experts=8, top_k=2, moe_ff=32, vocab=300)
SIZE_FLAGS = [f"--{k.replace('_', '-')}={v}" for k, v in SIZES.items()]
# what the sizes carry along: num_key_value_heads keeps the config's grouping (MHA stays MHA,
# 8 or 4 query heads a KV head leave one for 4 heads), max_window_layers at most the layers
FOLLOW = {
    "OLMoE-1B-7B-0924": dict(num_key_value_heads=4),
    "Qwen3-30B-A3B": dict(num_key_value_heads=1, max_window_layers=2),
    "Mixtral-8x7B-v0.1": dict(num_key_value_heads=1),
    "DeepSeek-V2-Lite": dict(num_key_value_heads=4),
}


def _expected_config(raw: dict, out) -> dict:
    """raw with SIZES and FOLLOW in place, and the special ids past the vocabulary on the
    synthetic tokenizer's eos."""
    from tokenizers import Tokenizer

    keys = size_fields(raw)
    want = {**raw, **{keys[k]: v for k, v in SIZES.items()}}
    eos = Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id("<|endoftext|>")
    for key, value in raw.items():
        if key.endswith("_token_id") and isinstance(value, int) and value >= SIZES["vocab"]:
            want[key] = eos
    return want


def test_data_configs_are_the_public_models():
    assert [p.stem for p in CONFIGS] == sorted(FOLLOW)
    for p in CONFIGS:
        raw = json.loads(p.read_text())
        assert raw["torch_dtype"] == "bfloat16" and raw["architectures"][0].endswith("ForCausalLM")
    readme = (CONFIGS[0].parent / "README.md").read_text()
    assert all(p.name in readme for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_synth_config_keeps_every_field_transformers_reads(path, tmp_path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads(path.read_text())
    d = synthesize_config(path, tmp_path / "out", progress=False, **SIZES)
    written = json.loads((d / "config.json").read_text())
    assert written == {**_expected_config(raw, d), **FOLLOW[path.stem]}
    assert list(written) == list(raw)  # not a field more or less, in the config's order

    # transformers reads every field of the input alike, but the sizes given
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "config.json").write_text(path.read_text())
    ours, real = AutoConfig.from_pretrained(d), AutoConfig.from_pretrained(tmp_path / "in")
    alias = type(real).attribute_map
    changed = {alias.get(k, k) for k in written if written[k] != raw[k]} | {"_name_or_path"}
    ours_d, real_d = ours.to_dict(), real.to_dict()
    assert set(ours_d) == set(real_d)
    assert {k: ours_d[k] for k in real_d if k not in changed} == {
        k: v for k, v in real_d.items() if k not in changed
    }
    # and its model class takes every tensor, of the shapes it expects, and none is left over
    model, info = AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == raw["architectures"][0]
    assert not any(info.values()), info

    # colibri runs every one of them (DeepSeek-V2-Lite too), with transformers' logits
    assert raw["model_type"] in FAMILIES_RUN
    ours_model = load_model(d, progress=False)
    assert ours_model.cfg.num_layers == 2 and ours_model.cfg.moe.num_experts == 8
    ids = ours_model.tokenizer.encode("def forward(x): The router sends")
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(Runner(ours_model, capacity=64).full_logits(ids), ref, atol=1e-4)


def test_deepseek_v2_routing_fields_checked():
    """DeepSeek-V2's topk_method, and n_group and topk_group when it limits groups, are read
    and checked: a value transformers cannot run is one error naming the file and field."""
    raw = json.loads(CONFIGS[[p.stem for p in CONFIGS].index("DeepSeek-V2-Lite")].read_text())
    grouped = dict(topk_method="group_limited_greedy", n_group=8, topk_group=3)
    cfg = config_from_dict({**raw, **grouped}, source="v2.json")
    assert (cfg.moe.router, cfg.moe.n_group, cfg.moe.topk_group) == ("softmax_group", 8, 3)
    assert not cfg.moe.norm_topk_prob and cfg.rope.interleave and cfg.attention == "mla"
    bad = [
        (dict(topk_method="noaux_tc"), "topk_method='noaux_tc' must be one of 'greedy'"),
        (dict(topk_method=None), "topk_method=None must be one of"),
        ({**grouped, "n_group": None}, "n_group=None must be a positive integer"),
        ({**grouped, "n_group": 5}, "n_group=5 does not divide 64"),
        ({**grouped, "topk_group": 9}, "topk_group=9 must be in 1..8"),
    ]
    for change, message in bad:
        with pytest.raises(ConfigError, match=f"^v2.json: {re.escape(message)}"):
            config_from_dict({**raw, **change}, source="v2.json")


def test_synth_config_cli(tmp_path):
    """`colibri synth --config` writes what synthesize_config does, and says on stderr what
    it changed beyond the sizes."""
    path = CONFIGS[[p.stem for p in CONFIGS].index("OLMoE-1B-7B-0924")]
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "colibri.cli", "synth", "--config", str(path), *SIZE_FLAGS]
    r = subprocess.run([*cmd, "--out", str(out)], capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().strip() == str(out)
    assert b"eos_token_id=50279 is outside vocab_size=300" in r.stderr
    ref = synthesize_config(path, tmp_path / "api", progress=False, **SIZES)
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    bad = subprocess.run(
        [*cmd, "--family", "olmoe", "--out", str(tmp_path / "x")], capture_output=True
    )
    assert bad.returncode == 2 and b"--family with --config" in bad.stderr


def test_synth_config_overrides_keep_layer_fields_consistent(tmp_path):
    raw = json.loads(CONFIGS[[p.stem for p in CONFIGS].index("Qwen3-30B-A3B")].read_text())
    raw["mlp_only_layers"] = [1, 30]
    sets = ["intermediate_size=96", "head_dim=16", "num_key_value_heads=2", "rope_theta=5e5"]
    d = synthesize_config(raw, tmp_path / "q", sets=sets, progress=False, **{**SIZES, "layers": 3})
    written = json.loads((d / "config.json").read_text())
    assert written["mlp_only_layers"] == [1] and written["max_window_layers"] == 3
    assert (written["intermediate_size"], written["head_dim"]) == (96, 16)
    assert (written["num_key_value_heads"], written["rope_theta"]) == (2, 5e5)
    model = load_model(d, progress=False)
    assert model.cfg.moe_layers == (True, False, True) and model.cfg.dense_ff == 96
    ids = model.tokenizer.encode("Les experts sont")
    np.testing.assert_allclose(
        Runner(model, capacity=64).full_logits(ids), tiny.hf_logits(d, ids), atol=1e-4
    )


def test_synth_config_quantization_honoured_or_dropped(tmp_path, caplog):
    raw = json.loads(CONFIGS[[p.stem for p in CONFIGS].index("Mixtral-8x7B-v0.1")].read_text())
    fp8 = dict(
        quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[16, 16]
    )
    d = synthesize_config(
        {**raw, "quantization_config": fp8}, tmp_path / "fp8", progress=False, **SIZES
    )
    written = json.loads((d / "config.json").read_text())
    assert written["quantization_config"] == fp8 and written["torch_dtype"] == "bfloat16"
    kinds = {t.dtype for n, t in Checkpoint(d).tensors.items() if n.endswith("w1.weight")}
    assert kinds == {"F8_E4M3"}
    load_model(d, progress=False)

    bnb = dict(quant_method="bitsandbytes", load_in_4bit=True)
    with caplog.at_level("WARNING", logger="colibri.synth"):
        d = synthesize_config(
            {**raw, "quantization_config": bnb}, tmp_path / "bnb", progress=False, **SIZES
        )
    assert "quantization_config" not in json.loads((d / "config.json").read_text())
    assert "not a layout synth writes: dropped" in caplog.text
    assert {t.dtype for t in Checkpoint(d).tensors.values()} == {"BF16"}

    d = synthesize_config(raw, tmp_path / "int4", dtype="int4", group=16, progress=False, **SIZES)
    quant = json.loads((d / "config.json").read_text())["quantization_config"]
    assert quant["config_groups"]["group_0"]["weights"]["group_size"] == 16


def test_synth_config_refusals(tmp_path):
    raw = json.loads(CONFIGS[0].read_text())
    with pytest.raises(ValueError, match="model_type='llama'"):
        synthesize_config({**raw, "model_type": "llama"}, tmp_path / "a", progress=False)
    with pytest.raises(ValueError, match="num_experts_per_tok=6 exceeds n_routed_experts=4"):
        synthesize_config(
            raw, tmp_path / "b", progress=False, **{**SIZES, "experts": 4, "top_k": None}
        )
    with pytest.raises(
        ValueError, match="hidden_size=66 is not a multiple of num_attention_heads=4"
    ):
        synthesize_config(raw, tmp_path / "c", progress=False, **{**SIZES, "hidden": 66})
    with pytest.raises(ValueError, match="--set 'q_lora_rank': expected KEY=VALUE"):
        synthesize_config(raw, tmp_path / "d", sets=["q_lora_rank"], progress=False, **SIZES)
