"""Pack-quantized integer checkpoints (compressed-tensors' W4A16 and W8A16 releases): read as
float32 exactly as compressed-tensors decompresses them, in whole tensors and in expert parts,
with clear errors, on every tier."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import tiny

from colibri.checkpoint import Checkpoint, CheckpointError, quantize_packed, write_safetensors
from colibri.config import ConfigError, config_from_dict
from colibri.engine.model import load_model
from colibri.engine.runner import Runner
from colibri.formats import INT4_ROWS, Holding
from colibri.synth import SynthSpec, hf_config, packed_quantization, synthesize

KINDS = {"packed": "I32", "shape": "I64"}


def _write(tmp_path, weights: dict, scale_dtype: str = "BF16", extra=None) -> Checkpoint:
    """A checkpoint of pack-quantized weights: name -> (packed, scale, shape)."""
    tensors, kinds = dict(extra or {}), {}
    for name, (packed, scale, shape) in weights.items():
        for part, arr in (("packed", packed), ("scale", scale), ("shape", shape)):
            tensors[f"{name}_{part}"] = arr
            kinds[f"{name}_{part}"] = KINDS.get(part, scale_dtype)
    write_safetensors(tmp_path / "model.safetensors", tensors, "F32", kinds)
    return Checkpoint(tmp_path)


def _reference(packed, scale, shape, bits, group, g_idx=None) -> np.ndarray:
    """compressed-tensors' own unpacking and dequantization, in float32; with `g_idx`, each
    column times the scale of the group g_idx gives it (activation order: compressed-tensors
    has since dropped it, checkpoints made before still carry it)."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    q = unpack_from_int32(torch.from_numpy(packed.copy()), bits, torch.Size(shape.tolist()))
    s = torch.from_numpy(scale.astype(np.float32))
    if g_idx is not None:
        return (q.float() * s[:, torch.from_numpy(g_idx).long()]).numpy()
    strategy = "group" if group else "channel"
    args = QuantizationArgs(num_bits=bits, symmetric=True, strategy=strategy, group_size=group)
    return dequantize(q, s, None, args, dtype=torch.float32).numpy()


@pytest.mark.parametrize(
    "bits, group, scale_dtype",
    [(4, 16, "BF16"), (4, 0, "F16"), (8, 16, "BF16"), (8, 48, "F32")],
    ids=str,
)
def test_a_weight_reads_as_compressed_tensors_decompresses_it(tmp_path, bits, group, scale_dtype):
    rng = np.random.default_rng(bits + group)
    w = (rng.standard_normal((37, 96)) * np.logspace(-3, 1, 96)).astype(np.float32)
    w[:, :16] = 0  # an all-zero group: scale 1
    packed, scale, shape = quantize_packed(w, bits, group)
    assert packed.dtype == np.int32 and packed.shape == (37, 96 * bits // 32)
    ck = _write(tmp_path, {"a.weight": (packed, scale, shape)}, scale_dtype)
    t = ck.info("a.weight")
    assert (t.dtype, t.shape, t.nbytes) == (f"PACK{bits}", (37, 96), 37 * 96 * bits // 8)
    got = ck.read("a.weight", (37, 96))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, _reference(packed, scale, shape, bits, group or None))
    err = np.abs(got - w).max(axis=1) / np.abs(w).max(axis=1)
    assert 0 < err.max() < 2.0 / 2**bits  # half a step of the row's largest group, or so
    # Whole rows from the middle, as the expert readers ask for them.
    row = 96 * bits // 8
    part = ck.read_part(t, 20 * row, 9 * row)
    np.testing.assert_array_equal(part.reshape(9, 96), got[20:29])
    with pytest.raises(CheckpointError, match="whole rows of 96"):
        ck.read_part(t, row // 2, row)


def test_activation_order_groups_come_from_g_idx(tmp_path):
    """GPTQ's activation order: `weight_g_idx` gives each column its group."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    packed, scale, shape = quantize_packed(w, 4, 16)
    g_idx = rng.permutation(np.arange(64) // 16).astype(np.int32)
    ck = _write(tmp_path, {"a.weight": (packed, scale, shape)}, extra={"a.weight_g_idx": g_idx})
    want = _reference(packed, scale, shape, 4, 16, g_idx)
    np.testing.assert_array_equal(ck.read("a.weight"), want)
    assert not np.array_equal(want, _reference(packed, scale, shape, 4, 16))
    assert ck.packed_fit(ck.info("a.weight")) == (0, None)  # dequantized at load
    ck = _write(tmp_path, {"a.weight": (packed, scale, shape)})
    assert ck.packed_fit(ck.info("a.weight")) == (16, INT4_ROWS)
    bad = np.full(64, 4, np.int32)
    ck = _write(tmp_path, {"a.weight": (packed, scale, shape)}, extra={"a.weight_g_idx": bad})
    with pytest.raises(CheckpointError, match=r"'a.weight_g_idx' must give each of the 64"):
        ck.read("a.weight")


def test_fused_expert_matrices_read_with_their_own_scales(tmp_path):
    """A fused [E, 2F, D] weight packed matrix by matrix: each expert's half reads as the
    whole tensor does, and a read may run from one expert's matrix into the next."""
    rng = np.random.default_rng(1)
    E, F, D = 3, 12, 32
    parts = [quantize_packed(rng.standard_normal((2 * F, D), np.float32), 4, 8) for _ in range(E)]
    packed = np.stack([p[0] for p in parts])
    scale = np.stack([p[1] for p in parts])
    name = "experts.gate_up.weight"
    ck = _write(tmp_path, {name: (packed, scale, np.array([E, 2 * F, D]))})
    whole = ck.read(name, (E, 2 * F, D))
    for e in range(E):
        ref = _reference(parts[e][0], parts[e][1], parts[e][2], 4, 8)
        np.testing.assert_array_equal(whole[e], ref)
        row = D // 2
        for half in range(2):
            at = (e * 2 * F + half * F) * row
            got = ck.read_part(ck.info(name), at, F * row).reshape(F, D)
            np.testing.assert_array_equal(got, ref[half * F : (half + 1) * F])
    across = ck.read_part(ck.info(name), (2 * F - 1) * D // 2, D).reshape(2, D)
    np.testing.assert_array_equal(across, [whole[0, -1], whole[1, 0]])


def test_missing_or_misshapen_parts_name_the_tensors(tmp_path):
    packed, scale, shape = quantize_packed(np.ones((16, 32), np.float32), 4, 8)
    write_safetensors(
        tmp_path / "model.safetensors",
        {"w.weight_packed": packed, "w.weight_shape": shape},
        "F32",
        {"w.weight_packed": "I32", "w.weight_shape": "I64"},
    )
    with pytest.raises(CheckpointError, match=r"'w.weight_packed' has no 'w.weight_scale'"):
        Checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"'w.weight_packed' is I32 \[16, 4\].*\[16, 40\]"):
        _write(tmp_path, {"w.weight": (packed, scale, np.array([16, 40]))})
    ck = _write(tmp_path, {"w.weight": (packed, scale[:, :3], shape)})
    with pytest.raises(
        CheckpointError, match=r"'w.weight_scale' are BF16 \[16, 3\].*\[16, groups\]"
    ):
        ck.read("w.weight")
    with pytest.raises(CheckpointError, match=r"tensor 'w.weight' has shape \[16, 32\]"):
        _write(tmp_path, {"w.weight": (packed, scale, shape)}).read("w.weight", (32, 16))


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric=False), "zero points"),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=2), "num_bits=2"),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(type="float"), "type='float'"),
        (
            lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="tensor"),
            "strategy='tensor'",
        ),
        (
            lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8}),
            "activation quantization",
        ),
        (lambda q: q["config_groups"]["group_0"].update(format="float-quantized"), "format="),
        (lambda q: q.update(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
    ],
)
def test_other_compressed_tensors_schemes_are_refused_by_name(change, match):
    raw = hf_config(SynthSpec())
    quant = packed_quantization(4, 32)
    config_from_dict({**raw, "quantization_config": quant})  # W4A16: fine
    config_from_dict({**raw, "quantization_config": packed_quantization(8, 0)})  # W8A16 too
    bad = copy.deepcopy(quant)
    change(bad)
    with pytest.raises(ConfigError, match=match):
        config_from_dict({**raw, "quantization_config": bad})


def test_synth_int4_is_compressed_tensors_layout_and_matches_transformers(tmp_path):
    spec = SynthSpec(
        family="qwen3_moe", layers=2, experts=8, top_k=2, hidden=64, moe_ff=32, vocab=300,
        dtype="int4", group=16,
    )  # fmt: skip
    d = synthesize(spec, tmp_path / "int4", progress=False)
    raw = json.loads((d / "config.json").read_text())
    assert raw["quantization_config"]["quant_method"] == "compressed-tensors"
    ck = Checkpoint(d)
    kinds = {n: t.dtype for n, t in ck.tensors.items()}
    e = "model.layers.1.mlp.experts.3.down_proj"
    assert (kinds[f"{e}.weight_packed"], kinds[f"{e}.weight_scale"]) == ("I32", "BF16")
    assert kinds[f"{e}.weight"] == "PACK4" and ck.info(f"{e}.weight").shape == (64, 32)
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == "PACK4"
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight"):
        assert kinds[name] == "BF16"
    model = load_model(d, progress=False)
    # Experts held as int4 rows: 64 / 2 + 64 / 16 * 4 bytes per row of gate and up, 16 + 8 of
    # down; the attention's matrices too, the bf16 ones stay bf16.
    assert model.store.held == np.int8
    assert model.store.expert_bytes == 2 * 32 * (32 + 16) + 64 * (16 + 8)
    assert model.params["layers"][0]["attn"]["qkv"].dtype == np.int8
    assert model.params["embed"].dtype == np.uint16
    ids = model.tokenizer.encode("def forward(x): The router sends")
    ref = tiny.hf_logits(d, ids)
    np.testing.assert_allclose(Runner(model, capacity=64).full_logits(ids), ref, atol=1e-4)
    model.store.close()


@pytest.mark.parametrize("dtype, held", [("int4", np.int8), ("int8", np.int32)])
def test_placement_never_changes_packed_logits(checkpoints, dtype, held):
    """Routed experts read from disk (their packed bytes and a few scales) and staged through
    RAM and the device slots, as int4 or int8 rows: prefill and decode logits bitwise those
    of the resident model."""
    d = checkpoints("qwen2_moe", dtype)
    prompts = [[5, 9, 300, 17], [44, 2, 2, 81, 6, 7, 19, 20, 23]]
    got = []
    for tiered in (False, True):
        model, probe = tiny.load_placed(d, tiered)
        assert model.store.held == held
        got.append(tiny.prefill_then_decode(model, prompts))
        assert (model.store.disk.bytes_read > 0) == tiered
        model.store.close()
        probe.store.close()
    np.testing.assert_array_equal(got[0][0], got[1][0])
    np.testing.assert_array_equal(got[0][1], got[1][1])


@pytest.mark.parametrize(
    "dtype, tiered, rows, nbytes",  # bytes a weight held: tests/tiny.py's groups of 8 columns
    [("int4", False, np.int8, 1), ("int4", True, np.int8, 1), ("int8", True, np.int32, 2)],
)
def test_packed_rows_decode_what_dequantized_weights_do(dtype, tiered, rows, nbytes, checkpoints):
    """A pack-quantized checkpoint's int4 (int8) matrices are held as int4 (int8) rows: bytes
    of values and group scales, here under a quarter (a half) of the bytes of float32, about
    an eighth (a quarter) with groups of 128; the routed experts in every tier, and the
    attention's and shared experts' matrices. Wherever the CPU kernels compute (decode,
    prefill of up to 16 tokens) the logits are bitwise those of the matrices dequantized to
    float32 at load (COLIBRI_INT4=0, COLIBRI_INT8=0); a longer prefill, in XLA's products,
    the same to float32 rounding."""
    d = checkpoints("deepseek_v3", dtype)
    got = tiny.held_and_dequantized(d, f"COLIBRI_{dtype.upper()}", tiered)
    (h4, d4, eb4, pre4, dec4), (h32, d32, eb32, pre32, dec32) = got
    assert (h4, h32) == (rows, np.float32)
    assert d4 == (rows, np.float32, np.float32)  # attention's matrices too; norms, lm_head
    assert d32 == (np.float32, np.float32, np.float32)  # not quantized in the checkpoint
    F, D = 32, 64  # tests/tiny.py's deepseek_v3
    # int4: half a byte and half a scale a weight; int8: a byte, an eighth of a scale and of
    # an offset.
    assert (eb4, eb32) == (3 * F * D * nbytes, 3 * F * D * 4)
    np.testing.assert_array_equal(pre4[:2], pre32[:2])
    np.testing.assert_array_equal(dec4[:, :2], dec32[:, :2])  # each row as it is alone
    np.testing.assert_allclose(pre4[2], pre32[2], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dec4[:, 2], dec32[:, 2], rtol=1e-4, atol=1e-4)
    assert np.argmax(pre4[2]) == np.argmax(pre32[2])


def test_groups_the_kernels_cannot_take_are_dequantized_at_load(tmp_path):
    """Groups of 4 columns (not a multiple of 8) or in activation order (g_idx) cannot be held
    as int4 rows: those checkpoints are dequantized to float32 at load and decode bitwise
    what COLIBRI_INT4=0 gives."""
    spec = SynthSpec(
        family="qwen3_moe", layers=2, experts=8, top_k=2, hidden=64, moe_ff=32, vocab=300,
        dtype="int4", group=4,
    )  # fmt: skip
    d = synthesize(spec, tmp_path / "int4", progress=False)
    prompts = [[5, 9, 300, 17], [44, 2, 2, 81, 6, 7]]
    got = []
    for int4 in ("1", "0"):
        model = load_model(d, progress=False, holding=Holding.from_env({"COLIBRI_INT4": int4}))
        assert model.store.held == np.float32
        assert model.params["layers"][0]["attn"]["qkv"].dtype == np.float32
        got.append(tiny.prefill_then_decode(model, prompts))
        model.store.close()
    np.testing.assert_array_equal(got[0][0], got[1][0])
    np.testing.assert_array_equal(got[0][1], got[1][1])


def test_int4_experts_mode_keeps_only_the_routed_experts_as_int4_rows(checkpoints):
    """COLIBRI_INT4=experts: the routed experts stay int4 rows, the attention's and shared
    experts' matrices are dequantized to float32 at load; every computation on the kernels
    still gives bitwise what all of them dequantized give."""
    d = checkpoints("deepseek_v3", "int4")
    prompts = [[5, 9, 300, 17], [44, 2, 2, 81, 6, 7]]
    got = {}
    for mode in ("experts", "0"):
        model = load_model(d, progress=False, holding=Holding.from_env({"COLIBRI_INT4": mode}))
        attn, moe = model.params["layers"][1]["attn"], model.params["layers"][1]["moe"]
        got[mode] = (model.store.held, attn["o"].dtype, moe["shared"]["down"].dtype)
        got[mode] += tiny.prefill_then_decode(model, prompts)
        model.store.close()
    assert got["experts"][:3] == (np.int8, np.float32, np.float32)
    assert got["0"][:3] == (np.float32, np.float32, np.float32)
    np.testing.assert_array_equal(got["experts"][3], got["0"][3])
    np.testing.assert_array_equal(got["experts"][4], got["0"][4])
