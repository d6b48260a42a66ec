"""Kimi K2.5 (its language model: DeepSeek-V3 under a multimodal config) against transformers on
tiny checkpoints, as test_oracle.py checks the other families: logits, incremental decode,
greedy tokens, text only; its int4 release layout (compressed-tensors, groups of 32); the
vision tensors skipped; its config read as transformers reads it; `colibri synth --family`."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
import tiny

from colibri.checkpoint import Checkpoint
from colibri.cli import main as cli
from colibri.config import ConfigError, config_from_dict, load_config
from colibri.engine.model import load_model
from colibri.engine.runner import Runner
from colibri.formats import INT4_ROWS
from colibri.weights import row_blocks

PROMPT = "def add(a, b): The quick brown fox, naïve café 🐦"

# int4: the linear layers pack-quantized as the release ships its experts (compressed-tensors
# W4A16, a scale per 32 columns), held as int4 rows, against the weights as it decompresses them
HELD = {"float32": np.float32, "int4": INT4_ROWS}


@pytest.fixture(scope="module")
def kimi(checkpoints, tmp_path_factory):
    """kimi(dtype) -> folder of the tiny Kimi K2.5 checkpoint, float32 or int4 (memoised)."""
    built = {"float32": checkpoints("kimi_k25")}

    def get(dtype: str = "float32"):
        if dtype not in built:
            out = tmp_path_factory.mktemp(f"kimi_k25-{dtype}")
            built[dtype] = tiny.to_packed(built["float32"], out, 4, group=32)
        return built[dtype]

    return get


@pytest.fixture(scope="module", params=list(HELD))
def case(request, kimi):
    d = kimi(request.param)
    model = load_model(d, progress=False)
    assert model.store.held == HELD[request.param]
    return d, model, tiny.hf_model(d)


def test_full_sequence_logits_match_transformers(case):
    _, model, hf = case
    tiny.check_full_logits(model, hf, model.tokenizer.encode(PROMPT))


def test_a_rows_logits_are_the_same_alone_and_among_sixteen(case):
    _, model, _ = case
    tiny.check_rows_alone(model, model.tokenizer.encode(PROMPT))


def test_incremental_decode_matches_full_forward(case):
    _, model, _ = case
    tiny.check_incremental_decode(model, model.tokenizer.encode(PROMPT))


def test_greedy_tokens_identical_to_transformers_generate(case):
    _, model, hf = case
    tiny.check_greedy(model, hf, model.tokenizer.encode(PROMPT))


def test_tiny_config_exercises_what_is_new(kimi):
    """MLA, the top 2 of 4 groups, a shared expert after a dense layer, an untied head; a
    vision tower and projector in the checkpoint; int4 experts in groups of 32."""
    cfg = load_config(kimi())
    assert (cfg.family, cfg.attention, cfg.mla.q_lora_rank) == ("kimi_k25", "mla", 32)
    assert (cfg.moe.router, cfg.moe.n_group, cfg.moe.topk_group) == ("sigmoid_group", 4, 2)
    assert (cfg.moe_layers, cfg.moe.shared_ff) == ((False, True, True), 32)
    assert not cfg.tie_word_embeddings
    roots = {n.split(".")[0] for n in _stored_names(kimi())}
    assert roots == {"language_model", "vision_tower", "mm_projector", "model"}
    packed = Checkpoint(kimi("int4"))
    assert row_blocks(packed, cfg, INT4_ROWS) == (32, 32)
    assert packed.info("model.layers.1.mlp.experts.0.down_proj.weight").dtype == "PACK4"


def _stored_names(d) -> list[str]:
    """The tensor names of a folder's model.safetensors, as stored."""
    from safetensors import safe_open

    with safe_open(d / "model.safetensors", "np") as f:
        return list(f.keys())


def test_vision_tensors_skipped_with_one_log_line(kimi, caplog):
    stored = _stored_names(kimi())
    text = [n for n in stored if n.startswith("language_model.")]
    with caplog.at_level(logging.INFO, logger="colibri"):
        ckpt = Checkpoint(kimi())
    lines = [r.getMessage() for r in caplog.records if "vision tensors" in r.getMessage()]
    n = len(stored) - len(text)
    assert n > 10 and lines == [
        f"{kimi()}: skipped {n} vision tensors (mm_projector, model.mm_projector, vision_tower):"
        " colibri runs the language model"
    ]
    assert len(ckpt.tensors) == len(text)
    assert "lm_head.weight" in ckpt and "model.layers.2.mlp.experts.15.up_proj.weight" in ckpt


def _renamed(src, out, rename):
    """A copy of checkpoint `src` with each tensor name as `rename` gives it."""
    from safetensors.numpy import load_file, save_file

    out.mkdir()
    tensors = load_file(src / "model.safetensors")
    save_file({rename(k): v for k, v in tensors.items()}, out / "model.safetensors")
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        shutil.copy(src / name, out / name)
    return out


def test_every_layout_of_the_language_model_reads_alike(kimi, tmp_path):
    """transformers' save_pretrained names the layers language_model.model.blocks.N (its
    conversion, reverted); the release language_model.model.layers.N; save_pretrained with
    save_original_format=False model.language_model.layers.N, its experts fused. colibri reads
    all three to the same logits, and transformers reads the release's names."""
    import torch
    from transformers import AutoModelForImageTextToText

    src, ids = kimi(), list(range(3, 40))
    want = Runner(load_model(src, progress=False), capacity=64).full_logits(ids)
    release = _renamed(src, tmp_path / "release", lambda n: n.replace("l.blocks.", "l.layers."))
    hf, info = AutoModelForImageTextToText.from_pretrained(
        release, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    with torch.no_grad():
        np.testing.assert_allclose(hf(torch.tensor([ids])).logits[0].numpy(), want, atol=1e-4)
    fused = tmp_path / "fused"
    hf.save_pretrained(fused, save_original_format=False)
    for name in ("generation_config.json", "tokenizer.json"):
        shutil.copy(src / name, fused / name)
    assert "model.language_model.layers.1.mlp.experts.gate_up_proj" in _stored_names(fused)
    for d in (release, fused):
        got = Runner(load_model(d, progress=False), capacity=64).full_logits(ids)
        np.testing.assert_array_equal(got, want)


def test_quantization_config_under_text_config(kimi, tmp_path):
    """The release's quantization_config may sit with the language model's fields, where
    transformers looks for it when the top level has none: held as int4 rows all the same."""
    src = kimi("int4")
    out = tmp_path / "nested"
    shutil.copytree(src, out)
    raw = json.loads((out / "config.json").read_text())
    raw["text_config"]["quantization_config"] = raw.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(raw))
    ids = list(range(5, 30))
    model = load_model(out, progress=False)
    assert model.store.held == INT4_ROWS
    want = Runner(load_model(src, progress=False), capacity=64).full_logits(ids)
    np.testing.assert_array_equal(Runner(model, capacity=64).full_logits(ids), want)


# ---- configs as transformers reads them -----------------------------------------------------

TEXT = dict(
    model_type="kimi_k2",  # the release's name; transformers reads it as deepseek_v3
    vocab_size=300,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    kv_lora_rank=32,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    tie_word_embeddings=False,
    eos_token_id=7,
)


def test_kimi_config_as_transformers_reads_it():
    from transformers import AutoConfig

    raw = dict(model_type="kimi_k25", text_config=TEXT)
    hf = AutoConfig.for_model(**raw)
    cfg = config_from_dict(raw)
    # the wrapper's tie_word_embeddings decides, tied by default whatever text_config says
    assert cfg.tie_word_embeddings is hf.tie_word_embeddings is True
    assert not config_from_dict({**raw, "tie_word_embeddings": False}).tie_word_embeddings
    assert (cfg.family, cfg.attention, cfg.hidden) == ("kimi_k25", "mla", 64)
    assert cfg.eos_token_ids == (7,)
    assert hf.text_config.model_type == "deepseek_v3"
    with pytest.raises(ConfigError, match=r"k25.json text_config: kv_lora_rank=None"):
        config_from_dict({**raw, "text_config": {**TEXT, "kv_lora_rank": None}}, source="k25.json")
    with pytest.raises(ConfigError, match=r"text_config model_type='qwen3_moe' is not supported"):
        config_from_dict({**raw, "text_config": {**TEXT, "model_type": "qwen3_moe"}})
    with pytest.raises(ConfigError, match=r"text_config must be an object .* not null"):
        config_from_dict({"model_type": "kimi_k25", "text_config": None})


def test_tied_head_reads_the_embeddings(tmp_path):
    """With the wrapper's default (tied), transformers saves no lm_head: colibri's head is
    the embedding matrix, to transformers' logits."""
    d = tiny.build("kimi_k25", tmp_path / "tied", tie_word_embeddings=True)
    assert not [n for n in _stored_names(d) if "lm_head" in n]
    model = load_model(d, progress=False)
    assert model.cfg.tie_word_embeddings
    ids = list(range(3, 30))
    got = Runner(model, capacity=64).full_logits(ids)
    np.testing.assert_allclose(got, tiny.hf_logits(d, ids), atol=1e-4)


# ---- colibri synth --family ------------------------------------------------------------------


def test_synth_family_matches_transformers(tmp_path):
    import torch
    from transformers import AutoModelForImageTextToText

    out = tmp_path / "kimi_k25"
    flags = ["--layers", "3", "--experts", "8", "--top-k", "2", "--hidden", "64"]
    flags += ["--moe-ff", "32", "--vocab", "300", "--out", str(out)]
    assert cli(["synth", "--family", "kimi_k25", *flags]) == 0
    hf, info = AutoModelForImageTextToText.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # every tensor, the vision tower's too, and no more
    model = load_model(out, progress=False)
    assert model.cfg.family == "kimi_k25" and model.cfg.num_layers == 3
    ids = model.tokenizer.encode("def forward(x): The router sends")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(Runner(model, capacity=64).full_logits(ids), ref, atol=1e-4)
