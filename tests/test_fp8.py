"""Block-quantized FP8 checkpoints (DeepSeek-V3's layout): read as float32 exactly as torch
dequantizes them, in whole tensors and in expert parts, with clear errors, on every tier."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tiny

from colibri.checkpoint import Checkpoint, CheckpointError, quantize_fp8, write_safetensors
from colibri.config import ConfigError, config_from_dict
from colibri.engine.model import load_model
from colibri.engine.runner import Runner
from colibri.formats import Holding
from colibri.synth import SynthSpec, hf_config, synthesize

# A small DeepSeek-V3-style FP8 checkpoint (`colibri synth --dtype fp8`), hidden size 64.
DEEPSEEK_FP8 = dict(
    family="deepseek_v3", layers=3, experts=8, top_k=2, hidden=64, vocab=300, dtype="fp8"
)


def _torch_dequant(bits: np.ndarray, scale_inv: np.ndarray, b0: int, b1: int) -> np.ndarray:
    """torch's float8_e4m3fn widening times each value's block scale, in float32."""
    import torch

    values = torch.from_numpy(bits.copy()).view(torch.float8_e4m3fn).to(torch.float32)
    scale = torch.from_numpy(scale_inv).repeat_interleave(b0, -2).repeat_interleave(b1, -1)
    return (values * scale[..., : bits.shape[-2], : bits.shape[-1]]).numpy()


def _write(tmp_path, tensors, kinds, block=(16, 16)) -> Checkpoint:
    write_safetensors(tmp_path / "model.safetensors", tensors, "F32", kinds)
    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quant}))
    return Checkpoint(tmp_path)


def test_a_weight_reads_as_torch_dequantizes_it_partial_blocks_included(tmp_path):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((37, 50)) * np.logspace(-3, 1, 50)).astype(np.float32)
    w[:16, :16] = 0  # an all-zero block: scale 1
    bits, scale_inv = quantize_fp8(w, (16, 16))
    assert bits.dtype == np.uint8 and scale_inv.shape == (3, 4)
    ck = _write(
        tmp_path, {"a.weight": bits, "a.weight_scale_inv": scale_inv}, {"a.weight": "F8_E4M3"}
    )
    got = ck.read("a.weight", (37, 50))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, _torch_dequant(bits, scale_inv, 16, 16))
    rel = np.abs(got - w) / np.maximum(np.abs(w), 1e-30)
    assert 0 < np.median(rel) < 2**-4  # e4m3 keeps 3 mantissa bits: lossy, but close
    # Whole rows from the middle of the matrix, as the expert readers ask for them.
    part = ck.read_part(ck.info("a.weight"), 20 * 50, 9 * 50)
    np.testing.assert_array_equal(part.reshape(9, 50), got[20:29])


def test_fused_expert_halves_read_with_their_own_blocks(tmp_path):
    """A fused [E, 2F, D] tensor (gate rows then up rows per expert) with F not a multiple of
    the block: each half of each expert reads as torch dequantizes the whole tensor."""
    rng = np.random.default_rng(1)
    E, F, D, b = 3, 12, 20, 8
    w = rng.standard_normal((E, 2 * F, D)).astype(np.float32)
    pairs = [quantize_fp8(w[e], (b, b)) for e in range(E)]
    bits, scales = np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])
    name = "model.layers.0.mlp.experts.gate_up_proj"
    ck = _write(tmp_path, {name: bits, f"{name}_scale_inv": scales}, {name: "F8_E4M3"}, (b, b))
    whole = _torch_dequant(bits, scales, b, b)
    t = ck.info(name)
    for e in range(E):
        for half in range(2):
            at = (e * 2 * F + half * F) * D
            got = ck.read_part(t, at, F * D).reshape(F, D)
            np.testing.assert_array_equal(got, whole[e, half * F : (half + 1) * F])
    with pytest.raises(CheckpointError, match="spans two of its matrices"):
        ck.read_part(t, (2 * F - 1) * D, 2 * D)


def test_missing_or_misshapen_scales_name_the_tensors(tmp_path):
    bits, scale_inv = quantize_fp8(np.ones((32, 32), np.float32), (16, 16))
    ck = _write(tmp_path, {"w.weight": bits}, {"w.weight": "F8_E4M3"})
    with pytest.raises(CheckpointError, match=r"'w.weight' has no block scales.*weight_scale_inv"):
        ck.read("w.weight")
    per_tensor = {"w.weight": bits, "w.weight_scale": np.ones((), np.float32)}
    ck = _write(tmp_path, per_tensor, {"w.weight": "F8_E4M3"})
    with pytest.raises(CheckpointError, match=r"per-tensor 'w.weight_scale': not supported"):
        ck.read("w.weight")
    ck = _write(
        tmp_path,
        {"w.weight": bits, "w.weight_scale_inv": scale_inv[:1]},
        {"w.weight": "F8_E4M3"},
    )
    with pytest.raises(CheckpointError, match=r"'w.weight_scale_inv' are F32 \[1, 2\].*\[2, 2\]"):
        ck.read("w.weight")


@pytest.mark.parametrize(
    "quant, match",
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method='bitsandbytes'"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt='e5m2'"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ],
)
def test_other_quantizations_are_refused_by_name(quant, match):
    raw = hf_config(SynthSpec())
    config_from_dict(raw)  # unquantized: fine
    config_from_dict({**raw, "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ConfigError, match=match):
        config_from_dict({**raw, "quantization_config": quant})


def test_synth_fp8_is_deepseek_layout_and_matches_transformers(tmp_path):
    spec = SynthSpec(**DEEPSEEK_FP8, moe_ff=32, fp8_block=16)
    d = synthesize(spec, tmp_path / "fp8", progress=False)
    ck = Checkpoint(d)
    kinds = {n: t.dtype for n, t in ck.tensors.items()}
    assert kinds["model.layers.1.mlp.experts.3.down_proj.weight"] == "F8_E4M3"
    assert kinds["model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"] == "F32"
    assert kinds["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == "F8_E4M3"
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight"):
        assert kinds[name] == "BF16"
    model = load_model(d, progress=False)
    # Experts held as FP8 rows: 32 + 64 / 16 * 4 bytes per row of gate and up, 64 + 8 of down.
    assert model.store.held == np.uint8
    assert model.store.expert_bytes == 2 * 32 * (64 + 16) + 64 * (32 + 8)
    assert model.params["embed"].dtype == np.uint16  # the bf16 ones stay bf16
    ids = model.tokenizer.encode("def forward(x): The router sends")
    ref = tiny.hf_logits(d, ids)
    np.testing.assert_allclose(Runner(model, capacity=64).full_logits(ids), ref, atol=1e-4)
    model.store.close()


def test_placement_never_changes_fp8_logits(checkpoints):
    """Routed experts read from disk and staged through RAM and the device slots, dequantized
    on the way: prefill and decode logits bitwise those of the resident model."""
    d = checkpoints("deepseek_v3", "fp8")
    prompts = [[5, 9, 300, 17], [44, 2, 2, 81, 6, 7, 19, 20, 23]]
    got = []
    for tiered in (False, True):
        model, probe = tiny.load_placed(d, tiered)
        got.append(tiny.prefill_then_decode(model, prompts))
        assert (model.store.disk.bytes_read > 0) == tiered
        model.store.close()
        probe.store.close()
    np.testing.assert_array_equal(got[0][0], got[1][0])
    np.testing.assert_array_equal(got[0][1], got[1][1])


@pytest.mark.parametrize("tiered", [False, True])
def test_fp8_experts_held_as_fp8_decode_what_dequantized_ones_do(tiered, checkpoints):
    """A block-quantized checkpoint's FP8 matrices are held as FP8 rows (values and block
    scales: under a third of the bytes of float32 here, a quarter with 128-wide blocks): the
    routed experts in every tier, and the attention's and shared experts' matrices. Wherever
    the CPU kernels compute (decode, prefill of up to 16 tokens) the logits are bitwise those
    of the matrices dequantized to float32 at load (COLIBRI_FP8=0); a longer prefill, in XLA's
    products, the same to float32 rounding."""
    d = checkpoints("deepseek_v3", "fp8")
    got = tiny.held_and_dequantized(d, "COLIBRI_FP8", tiered)
    (h8, d8, eb8, pre8, dec8), (h32, d32, eb32, pre32, dec32) = got
    assert (h8, h32) == (np.uint8, np.float32)
    assert d8 == (np.uint8, np.float32, np.float32)  # attention's matrices too; norms, lm_head
    assert d32 == (np.float32, np.float32, np.float32)  # not quantized in the checkpoint
    F, D = 32, 64  # tests/tiny.py's deepseek_v3: blocks of 8 columns, a scale per 8 values
    assert (eb8, eb32) == (3 * F * D * 3 // 2, 3 * F * D * 4)
    np.testing.assert_array_equal(pre8[:2], pre32[:2])
    np.testing.assert_array_equal(dec8[:, :2], dec32[:, :2])  # each row as it is alone
    np.testing.assert_allclose(pre8[2], pre32[2], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dec8[:, 2], dec32[:, 2], rtol=1e-4, atol=1e-4)
    assert np.argmax(pre8[2]) == np.argmax(pre32[2])


def test_matrices_whose_columns_split_a_block_are_dequantized_at_load(tmp_path):
    """Blocks of 32 columns: rows of 64 are whole blocks (held as FP8 rows), rows of 48 are
    not (those matrices, and so the routed experts, are dequantized to float32 at load). The
    mixture decodes bitwise what COLIBRI_FP8=0 gives, resident and tiered alike."""
    spec = SynthSpec(**DEEPSEEK_FP8, moe_ff=48, fp8_block=32)
    d = synthesize(spec, tmp_path / "fp8", progress=False)
    prompts = [[5, 9, 300, 17], [44, 2, 2, 81, 6, 7]]
    got = []
    for fp8, tiered in (("1", False), ("1", True), ("0", False)):
        model, probe = tiny.load_placed(d, tiered, Holding.from_env({"COLIBRI_FP8": fp8}))
        assert model.store.held == np.float32
        attn, shared = model.params["layers"][1]["attn"], model.params["layers"][1]["moe"]
        kinds = (attn["q_a"].dtype, shared["shared"]["down"].dtype)  # 64 and 48 columns
        assert kinds == ((np.uint8 if fp8 == "1" else np.float32), np.float32)
        got.append(tiny.prefill_then_decode(model, prompts))
        model.store.close()
        probe.store.close()
    for other in got[1:]:
        np.testing.assert_array_equal(got[0][0], other[0])
        np.testing.assert_array_equal(got[0][1], other[1])
