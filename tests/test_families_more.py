"""dots1 and MiniMax-M2 against transformers on tiny checkpoints, as test_oracle.py checks the
other families: logits, incremental decode, greedy tokens; their configs read as transformers
reads them; `colibri synth --family` for both."""

from __future__ import annotations

import numpy as np
import pytest
import tiny

from colibri.cli import main as cli
from colibri.config import ConfigError, config_from_dict, load_config
from colibri.engine.model import load_model
from colibri.engine.runner import Runner
from colibri.formats import FP8_ROWS, INT4_ROWS

PROMPT = "def add(a, b): The quick brown fox, naïve café 🐦"

# Held as they are stored (test_oracle's EXTRA cases): MiniMax-M2 ships its linear layers
# block-quantized (fp8: FP8 rows, against transformers' dequantized float32 weights); int4
# (compressed-tensors W4A16: int4 rows, against the weights as it decompresses them).
HELD = {"float32": np.float32, "fp8": FP8_ROWS, "int4": INT4_ROWS}
CASES = [("dots1", "float32"), ("minimax_m2", "float32"), ("minimax_m2", "fp8"), ("dots1", "int4")]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(c))
def case(request, checkpoints):
    family, dtype = request.param
    d = checkpoints(family, dtype)
    model = load_model(d, progress=False)
    assert model.store.held == HELD[dtype]
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


def test_tiny_configs_exercise_what_is_new(checkpoints):
    """The checkpoints above rotate part of each head and route over several groups after a
    dense layer."""
    mm = load_config(checkpoints("minimax_m2"))
    assert (mm.rope.rotary_dim, mm.head_dim, mm.qk_norm) == (12, 16, "full")
    assert (mm.moe.router, mm.moe.n_group, mm.moe.norm_topk_prob) == ("sigmoid_group", 1, True)
    dots = load_config(checkpoints("dots1"))
    assert (dots.moe.n_group, dots.moe.topk_group, dots.moe_layers) == (4, 2, (False, True, True))
    assert (dots.qk_norm, dots.rope.rotary_dim, dots.o_bias) == ("head", 16, True)


# ---- configs as transformers reads them -----------------------------------------------------

MINIMAX = dict(
    model_type="minimax_m2",
    vocab_size=300,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=32,
    num_local_experts=8,
    num_experts_per_tok=2,
)
DOTS1 = dict(
    model_type="dots1",
    vocab_size=300,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
)


def _rope_of(raw: dict):
    """transformers' inverse frequencies and rotated dims for a config dict."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**raw)
    rotary = AutoModelForCausalLM.from_config(cfg).model.rotary_emb
    return rotary.inv_freq.numpy(), cfg


@pytest.mark.parametrize(
    "fields",
    [
        {},  # head_dim 128 and rope_theta 5e6 by default, every dim rotated
        {"head_dim": 16, "rotary_dim": 8},
        {"head_dim": 16, "rotary_dim": 8, "partial_rotary_factor": 0.75},  # the factor wins
        {"head_dim": 32, "rope_theta": 1e4, "rope_parameters": {"partial_rotary_factor": 0.25}},
    ],
    ids=["defaults", "rotary_dim", "factor-over-rotary_dim", "rope_parameters"],
)
def test_minimax_m2_rope_as_transformers_reads_it(fields):
    raw = {**MINIMAX, **fields}
    inv, hf = _rope_of(raw)
    cfg = config_from_dict(raw)
    assert cfg.head_dim == hf.head_dim
    np.testing.assert_allclose(cfg.rope.inv_freq, inv, rtol=1e-6)  # to float32's last bit


def test_dots1_defaults_and_sliding_layers():
    cfg = config_from_dict(DOTS1)
    assert not cfg.moe.norm_topk_prob and cfg.moe.shared_ff == 32 and all(cfg.moe_layers)
    inv, _ = _rope_of(DOTS1)
    np.testing.assert_allclose(cfg.rope.inv_freq, inv, rtol=1e-6)  # to float32's last bit
    # transformers slides a 4096-token window over layers from max_window_layers on
    with pytest.raises(ConfigError, match=r"layers \[2\] attend through a sliding window"):
        config_from_dict({**DOTS1, "max_window_layers": 2})
    config_from_dict({**DOTS1, "max_window_layers": 2, "sliding_window": None})
    types = ["full_attention", "sliding_attention", "full_attention"]
    with pytest.raises(ConfigError, match=r"layers \[1\]"):
        config_from_dict({**DOTS1, "layer_types": types})


# ---- colibri synth --family ------------------------------------------------------------------


@pytest.mark.parametrize("family", ["dots1", "minimax_m2"])
def test_synth_family_matches_transformers(family, tmp_path, capsys):
    out = tmp_path / family
    flags = ["--layers", "3", "--experts", "8", "--top-k", "2", "--hidden", "64"]
    flags += ["--moe-ff", "32", "--vocab", "300", "--out", str(out)]
    assert cli(["synth", "--family", family, *flags]) == 0
    model = load_model(out, progress=False)
    ids = model.tokenizer.encode("def forward(x): The router sends")
    ref = tiny.hf_logits(out, ids)
    np.testing.assert_allclose(Runner(model, capacity=64).full_logits(ids), ref, atol=1e-4)
