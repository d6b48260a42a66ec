"""GPTQ checkpoints (Qwen's "-GPTQ-Int4" releases, AutoGPTQ and GPTQModel output) and AutoAWQ's:
read as float32 exactly as the layouts GPTQ and AWQ document give them, held as int4 rows
(with zero points where they have them) or int8 rows, against transformers on the same
weights, with clear errors, on every tier."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import tiny
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colibri import formats
from colibri.checkpoint import (
    Checkpoint,
    CheckpointError,
    quantize_awq,
    quantize_gptq,
    write_safetensors,
)
from colibri.config import ConfigError, config_from_dict, load_config
from colibri.engine.model import load_model
from colibri.engine.runner import Runner
from colibri.formats import INT4_ROWS, INT4Z_ROWS, INT8_ROWS
from colibri.synth import SynthSpec, awq_quantization, gptq_quantization, hf_config, synthesize


def _write(tmp_path, weights: dict, quant: dict | None, scale_dtype="F16", where="config.json"):
    """A checkpoint of GPTQ weights (name -> quantize_gptq's parts) and a config naming `quant`
    (in config.json's quantization_config, or as AutoGPTQ's quantize_config.json)."""
    tensors, kinds = {}, {}
    for name, parts in weights.items():
        base = name.removesuffix(".weight")
        for part, arr in parts.items():
            tensors[f"{base}.{part}"] = arr
            kinds[f"{base}.{part}"] = scale_dtype if part == "scales" else "I32"
    write_safetensors(tmp_path / "model.safetensors", tensors, "F32", kinds)
    cfg = hf_config(SynthSpec())
    if quant is not None and where == "config.json":
        cfg["quantization_config"] = quant
    elif quant is not None:
        (tmp_path / where).write_text(json.dumps(quant))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return Checkpoint(tmp_path)


def _in_columns(q: np.ndarray, group: int) -> np.ndarray:
    """Int4 values [rows, cols] as held back in column order: a held value j of 64 columns
    held lane by lane stands for column formats.LANE_COLUMNS[j]."""
    rows, cols = q.shape
    if not formats.lane_major(cols, cols // group):
        return q
    out = np.empty_like(q).reshape(rows, -1, formats.LANE_GROUP)
    out[..., formats.LANE_COLUMNS] = q.reshape(out.shape)
    return out.reshape(rows, cols)


def _rows_widen_to(ck: Checkpoint, name: str, want: np.ndarray) -> tuple[int, np.dtype | None]:
    """Where weight `name` fits rows of its values (`packed_fit`): its rows as held (INT4_ROWS,
    with zero points INT4Z_ROWS, 8-bit INT8_ROWS) decoded here, value by value, are `want`
    bitwise. Returns the fit."""
    group, held = ck.packed_fit(ck.info(name))
    if not group:
        return group, held
    rows, cols = want.shape
    words = ck.read(name, held=held)
    if held == INT4_ROWS:
        nibbles = words[:, : cols // 2].view(np.uint8)
        q = _in_columns(np.stack([nibbles & 15, nibbles >> 4], axis=2).reshape(rows, cols), group)
        q = q - 8.0
        scales = words[:, cols // 2 :].copy().view("<f4")
        np.testing.assert_array_equal(q.astype(np.float32) * np.repeat(scales, group, 1), want)
        return group, held
    bits = 4 if held == INT4Z_ROWS else 8
    n, g = cols * bits // 32, cols // group
    words = words.view(np.uint32)
    q = (words[:, :n, None] >> np.arange(0, 32, bits, dtype=np.uint32)) & (2**bits - 1)
    if bits == 4:
        q = _in_columns(q.reshape(rows, cols), group)
    scales = words[:, n : n + g].copy().view("<f4").astype(np.float64)
    offsets = words[:, n + g :].copy().view("<f4").astype(np.float64)
    # fma(q, s, -z s): the exact q s - z s, rounded once to float32.
    wide = q.reshape(rows, cols) * np.repeat(scales, group, 1) + np.repeat(offsets, group, 1)
    np.testing.assert_array_equal(wide.astype(np.float32), want)
    return group, held


def test_words_hold_input_columns_from_the_lowest_bits(tmp_path):
    """The layout, from words written out by hand: qweight word [k, o] holds input columns
    8k..8k+7 of output o, the first in the lowest four bits; the original format's symmetric
    zero points are 7 (8 less one) in every nibble, 0x77777777 = 2004318071, as every
    symmetric 4-bit GPTQ release stores them. colibri and the tests' reference both read them
    so."""
    qweight = np.zeros((2, 8), np.uint32)  # 16 inputs, 8 outputs (2 written out)
    qweight[:, :2] = [[0x76543210, 0x01234567], [0x89ABCDEF, 0xFEDCBA98]]
    parts = {
        "qweight": qweight.view(np.int32),
        "qzeros": np.array([[2004318071]], np.int32),  # one group; outputs 0..7
        "scales": np.array([[1.0, 0.5, *[1.0] * 6]], np.float32),
        "g_idx": np.zeros(16, np.int32),
    }
    want = np.zeros((8, 16), np.float32) - 8  # q = 0 elsewhere
    want[0] = np.array([*range(8), *range(15, 7, -1)]) - 8
    want[1] = (np.array([*range(7, -1, -1), *range(8, 16)]) - 8) / 2
    ck = _write(tmp_path, {"a.weight": parts}, gptq_quantization(4, 0))
    np.testing.assert_array_equal(ck.read("a.weight", (8, 16)), want)
    np.testing.assert_array_equal(tiny.gptq_weight(*parts.values(), 4), want)
    w = np.tile(np.arange(-8, 8, dtype=np.float32), (8, 2))  # rows of the integers -8..7 twice
    assert (quantize_gptq(w, 4, 16)["qzeros"].view(np.uint32) == 0x77777777).all()


@pytest.mark.parametrize(
    "bits, group, sym, fmt, act_order, scale_dtype",
    [
        (4, 16, True, "gptq", False, "F16"),
        (4, 0, True, "gptq", False, "F16"),
        (4, 16, False, "gptq_v2", False, "F16"),
        (4, 16, False, "gptq", True, "BF16"),
        (8, 32, True, "gptq", False, "F32"),
        (8, 16, False, "gptq_v2", True, "F16"),
    ],
    ids=str,
)
def test_a_weight_reads_as_the_gptq_layout_gives_it(
    tmp_path, bits, group, sym, fmt, act_order, scale_dtype
):
    rng = np.random.default_rng(bits + group)
    w = (rng.standard_normal((40, 96)) * np.logspace(-1, 0, 96)).astype(np.float32)
    w[:, 1] += 0.5  # skews the groups: asymmetric zero points away from the midpoint
    order = rng.permutation(96) if act_order else None
    parts = quantize_gptq(w, bits, group, sym, fmt, order)
    parts["scales"] = parts["scales"].astype(ml_dtypes.bfloat16 if scale_dtype == "BF16" else "f4")
    parts["scales"] = parts["scales"].astype(np.float32)  # as stored
    assert parts["qweight"].shape == (96 * bits // 32, 40)
    quant = gptq_quantization(bits, group, sym, fmt, desc_act=act_order)
    ck = _write(tmp_path, {"a.weight": parts}, quant, scale_dtype)
    t = ck.info("a.weight")
    assert (t.dtype, t.shape, t.nbytes) == (f"GPTQ{bits}", (40, 96), 40 * 96 * bits // 8)
    got = ck.read("a.weight", (40, 96))
    assert got.dtype == np.float32
    want = tiny.gptq_weight(
        *(parts[k] for k in ("qweight", "qzeros", "scales", "g_idx")), bits, fmt
    )
    np.testing.assert_array_equal(got, want)
    err = np.abs(got - w).max(axis=1) / np.abs(w).max(axis=1)
    assert 0 < err.max() < 2.0 / 2**bits  # a step of the row's widest group, or so
    # Weights in consecutive groups of a multiple of 8 are rows of their values: symmetric
    # 4-bit ones the compressed-tensors integers with the words transposed, other 4-bit ones
    # with their zero points, 8-bit ones as int8 rows; activation order stays float32.
    held = INT8_ROWS if bits == 8 else INT4_ROWS if sym else INT4Z_ROWS
    fit = _rows_widen_to(ck, "a.weight", got)
    assert fit == ((group or 96, held) if not act_order else (0, None))
    with pytest.raises(CheckpointError, match=r"'a.weight' is read whole .*'a.qweight'"):
        ck.read_part(t, 0, 48)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    bits=st.sampled_from([4, 8]),
    rows=st.integers(1, 4).map(lambda k: 8 * k),
    groups=st.integers(1, 4),
    size=st.sampled_from([8, 16, 24]),
    sym=st.booleans(),
    v2=st.booleans(),
    act_order=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_any_gptq_weight_reads_as_its_layout_gives_it(
    tmp_path_factory, bits, rows, groups, size, sym, v2, act_order, seed
):
    """Any shape, bits, grouping, zero points and layout: the float32 read is the reference's
    bitwise, and where the weight fits rows of its values (int4, int4 with zero points, int8),
    those rows widen to the same numbers."""
    rng = np.random.default_rng(seed)
    cols = groups * size
    w = (rng.standard_normal((rows, cols)) + rng.uniform(-1, 1, (rows, 1))).astype(np.float32)
    fmt = "gptq_v2" if v2 else "gptq"
    order = rng.permutation(cols) if act_order else None
    try:
        parts = quantize_gptq(w, bits, size, sym, fmt, order)
    except ValueError:  # a zero point of 0, which "gptq" cannot store
        assert not sym and not v2
        return
    d = tmp_path_factory.mktemp("gptq")
    ck = _write(d, {"a.weight": parts}, gptq_quantization(bits, size, sym, fmt, act_order))
    got = ck.read("a.weight", (rows, cols))
    want = tiny.gptq_weight(
        *(parts[k] for k in ("qweight", "qzeros", "scales", "g_idx")), bits, fmt
    )
    np.testing.assert_array_equal(got, want)
    group, held = _rows_widen_to(ck, "a.weight", got)
    midpoints = 0x88888888 if v2 else 0x77777777  # every 4-bit zero point 8 (stored as 7)
    fits = np.array_equal(parts["g_idx"], np.arange(cols) // size)  # consecutive groups
    assert group == (size if fits else 0)
    if not fits:
        assert held is None and act_order
    elif bits == 8:
        assert held == INT8_ROWS
    else:
        symmetric = (parts["qzeros"].view(np.uint32) == midpoints).all()
        assert held == (INT4_ROWS if symmetric else INT4Z_ROWS)


def test_awq_words_hold_outputs_in_its_interleaved_order(tmp_path):
    """AutoAWQ's GEMM layout, from words written out by hand: qweight word [i, m] holds outputs
    8m + 0, 2, 4, 6, 1, 3, 5, 7 of input i from the lowest four bits up; qzeros likewise."""
    qweight = np.zeros((16, 1), np.uint32)  # 16 inputs, 8 outputs
    qweight[0, 0], qweight[1, 0] = 0x76543210, 0xFEDCBA98
    parts = {
        "qweight": qweight.view(np.int32),
        "qzeros": np.array([[0x00000001]], np.uint32).view(np.int32),  # output 0's zero: 1
        "scales": np.full((1, 8), 0.25, np.float32),
    }
    want = np.zeros((8, 16), np.float32)
    want[:, 0] = np.array([0, 4, 1, 5, 2, 6, 3, 7]) * 0.25
    want[:, 1] = np.array([8, 12, 9, 13, 10, 14, 11, 15]) * 0.25
    want[0] -= 0.25  # output 0's zero point
    ck = _write(tmp_path, {"a.weight": parts}, awq_quantization(0))
    t = ck.info("a.weight")
    assert (t.dtype, t.shape) == ("AWQ4", (8, 16))
    np.testing.assert_array_equal(ck.read("a.weight", (8, 16)), want)
    np.testing.assert_array_equal(tiny.awq_weight(*parts.values(), 0), want)


def test_a_single_block_awq_weight_becomes_int4_rows(tmp_path):
    """8 outputs by 8 inputs, one word: its rows are made in a buffer of their own (the read
    buffer is not written)."""
    w = np.random.default_rng(5).standard_normal((8, 8)).astype(np.float32)
    ck = _write(tmp_path, {"a.weight": quantize_awq(w, 8)}, awq_quantization(8))
    assert _rows_widen_to(ck, "a.weight", ck.read("a.weight")) == (8, INT4Z_ROWS)


@pytest.mark.parametrize("group, scale_dtype", [(16, "F16"), (0, "F16"), (32, "BF16")], ids=str)
def test_an_awq_weight_reads_as_its_layout_gives_it(tmp_path, group, scale_dtype):
    rng = np.random.default_rng(group)
    w = (rng.standard_normal((24, 64)) + rng.uniform(-1, 1, (24, 1))).astype(np.float32)
    parts = quantize_awq(w, group)
    assert parts["qweight"].shape == (64, 3) and "g_idx" not in parts
    if scale_dtype == "BF16":
        parts["scales"] = parts["scales"].astype(ml_dtypes.bfloat16).astype(np.float32)
    ck = _write(tmp_path, {"a.weight": parts}, awq_quantization(group), scale_dtype)
    got = ck.read("a.weight", (24, 64))
    want = tiny.awq_weight(parts["qweight"], parts["qzeros"], parts["scales"], group)
    np.testing.assert_array_equal(got, want)
    err = np.abs(got - w).max(axis=1) / np.abs(w).max(axis=1)
    assert 0 < err.max() < 2.0 / 2**4
    assert _rows_widen_to(ck, "a.weight", got) == (group or 64, INT4Z_ROWS)


def test_the_original_format_cannot_hold_a_zero_point_of_zero():
    w = np.abs(np.random.default_rng(0).standard_normal((8, 32))).astype(np.float32)
    with pytest.raises(ValueError, match="zero point of 0"):
        quantize_gptq(w, 4, 16, sym=False, fmt="gptq")
    quantize_gptq(w, 4, 16, sym=False, fmt="gptq_v2")


def test_autogptq_quantize_config_json_is_read_when_config_json_has_none(tmp_path):
    parts = quantize_gptq(np.ones((8, 32), np.float32), 4, 16)
    quant = {"bits": 4, "group_size": 16, "desc_act": False, "sym": True}
    ck = _write(tmp_path, {"a.weight": parts}, quant, where="quantize_config.json")
    scale = np.float32(np.float16(2 / 15))  # 1 is 7.5 steps: rounded to 8, clipped to 7
    np.testing.assert_array_equal(ck.read("a.weight"), np.full((8, 32), 7 * scale))
    assert load_config(tmp_path).family == "qwen3_moe"
    (tmp_path / "quantize_config.json").write_text(json.dumps({**quant, "bits": 3}))
    with pytest.raises(ConfigError, match=r"quantize_config.json: .*\(gptq\) bits=3"):
        load_config(tmp_path)


def test_missing_or_misshapen_parts_name_the_tensors(tmp_path):
    parts = quantize_gptq(np.ones((16, 32), np.float32), 4, 16)
    quant = gptq_quantization(4, 16)
    with pytest.raises(CheckpointError, match=r"'w.qweight' has no 'w.qzeros'"):
        _write(tmp_path, {"w.weight": {k: v for k, v in parts.items() if k != "qzeros"}}, quant)
    with pytest.raises(CheckpointError, match=r"'w.qweight' is a GPTQ/AWQ.*quant_method=None"):
        _write(tmp_path, {"w.weight": parts}, None)
    ck = _write(tmp_path, {"w.weight": {**parts, "scales": parts["scales"][:, :8]}}, quant)
    with pytest.raises(CheckpointError, match=r"'w.scales' are F16 \[2, 8\].*\[groups, 16\]"):
        ck.read("w.weight")
    ck = _write(tmp_path, {"w.weight": {**parts, "qzeros": parts["qzeros"][:, :1]}}, quant)
    with pytest.raises(CheckpointError, match=r"'w.qzeros' are I32 \[2, 1\], not int32 \[2, 2\]"):
        ck.read("w.weight")
    ck = _write(tmp_path, {"w.weight": {**parts, "g_idx": parts["g_idx"][:20]}}, quant)
    with pytest.raises(CheckpointError, match=r"'w.g_idx' must give each of the 32 columns"):
        ck.read("w.weight")
    ck = _write(tmp_path, {"w.weight": parts}, quant)
    with pytest.raises(CheckpointError, match=r"tensor 'w.weight' has shape \[16, 32\]"):
        ck.read("w.weight", (32, 16))


@pytest.mark.parametrize(
    "change, match",
    [
        ({"bits": 3}, "bits=3"),
        ({"bits": 2}, "bits=2"),
        ({"checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
        ({"checkpoint_format": None, "format": "gptq_p"}, "checkpoint_format='gptq_p'"),
        ({"is_marlin_format": True}, "is_marlin_format=True"),
        ({"dynamic": {"-:.*down_proj": {}}}, "dynamic"),
        ({"pack_dtype": "int16"}, "pack_dtype='int16'"),
        ({"group_size": 0}, "group_size=0"),
    ],
    ids=str,
)
def test_other_gptq_settings_are_refused_by_name(change, match):
    raw = hf_config(SynthSpec())
    for ok in (gptq_quantization(4, 128), gptq_quantization(8, 0, False, "gptq_v2", True)):
        config_from_dict({**raw, "quantization_config": ok})
    with pytest.raises(ConfigError, match=match):
        config_from_dict({**raw, "quantization_config": {**gptq_quantization(4, 128), **change}})
    with pytest.raises(ConfigError, match="quant_method='bitsandbytes'"):
        config_from_dict({**raw, "quantization_config": {"quant_method": "bitsandbytes"}})


@pytest.mark.parametrize(
    "change, match",
    [
        ({"version": "gemv"}, "version='gemv'"),
        ({"version": "exllama"}, "version='exllama'"),
        ({"bits": 8}, "bits=8"),
        ({"zero_point": False}, "zero_point=False"),
    ],
    ids=str,
)
def test_other_awq_settings_are_refused_by_name(change, match):
    raw = hf_config(SynthSpec())
    legacy = {"quant_method": "awq", "w_bit": 4, "q_group_size": 128, "version": "GEMM"}
    for ok in (awq_quantization(128), legacy):
        config_from_dict({**raw, "quantization_config": ok})
    with pytest.raises(ConfigError, match=match):
        config_from_dict({**raw, "quantization_config": {**awq_quantization(128), **change}})


def test_synth_gptq4_is_the_gptq_layout_and_matches_transformers(tmp_path):
    spec = SynthSpec(
        family="qwen3_moe", layers=2, experts=8, top_k=2, hidden=64, moe_ff=32, vocab=300,
        dtype="gptq4", group=16,
    )  # fmt: skip
    d = synthesize(spec, tmp_path / "gptq4", progress=False)
    raw = json.loads((d / "config.json").read_text())
    assert raw["quantization_config"]["quant_method"] == "gptq"
    assert raw["torch_dtype"] == "float16"
    ck = Checkpoint(d)
    kinds = {n: (t.dtype, t.shape) for n, t in ck.tensors.items()}
    e = "model.layers.1.mlp.experts.3.down_proj"
    assert kinds[f"{e}.qweight"] == ("I32", (4, 64))  # [F * 4 / 32, D]
    assert kinds[f"{e}.qzeros"] == ("I32", (2, 8))
    assert kinds[f"{e}.scales"] == ("F16", (2, 64))
    assert kinds[f"{e}.weight"] == ("GPTQ4", (64, 32))
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight"):
        assert kinds[name][0] == "F16"
    model = load_model(d, progress=False)
    assert model.store.held == np.int8
    assert model.store.expert_bytes == 2 * 32 * (32 + 16) + 64 * (16 + 8)
    assert model.params["layers"][0]["attn"]["qkv"].dtype == np.int8
    ids = model.tokenizer.encode("def forward(x): The router sends")
    ref = tiny.hf_logits(d, ids)
    np.testing.assert_allclose(Runner(model, capacity=64).full_logits(ids), ref, atol=1e-4)
    model.store.close()


@pytest.mark.parametrize("dtype, held", [("gptq4", np.int8), ("awq4", np.uint32)])
def test_int4_rows_decode_what_dequantized_weights_do(dtype, held, checkpoints):
    """Symmetric GPTQ int4 weights held as int4 rows, AWQ's (zero points) as int4 rows with
    their offsets (routed experts read from disk and staged, the attention's matrices) decode
    bitwise what they give dequantized at load."""
    d = checkpoints("deepseek_v3", dtype)
    got = tiny.held_and_dequantized(d, "COLIBRI_INT4", True)
    (h4, d4, eb4, pre4, dec4), (h32, d32, eb32, pre32, dec32) = got
    assert (h4, h32) == (held, np.float32)
    assert d4 == (held, np.float32, np.float32)
    F, D, g = 32, 64, 8  # groups of 8: a scale (and an offset) per 8 values
    per_value = 0.5 + (8 if held == np.uint32 else 4) / g
    assert (eb4, eb32) == (3 * F * D * per_value, 3 * F * D * 4)
    np.testing.assert_array_equal(pre4[:2], pre32[:2])
    np.testing.assert_array_equal(dec4[:, :2], dec32[:, :2])


@pytest.mark.parametrize("fmt", ["gptq_v2", "awq"])
def test_zero_points_are_held_and_placement_never_changes_them(tmp_path, checkpoints, fmt):
    """Zero points away from the midpoint (GPTQ with sym false in the gptq_v2 layout, AWQ):
    int4 rows with their offsets, and the experts read from disk and staged give bitwise the
    resident model's logits, which match transformers on the same weights."""
    d = tiny.to_gptq(checkpoints("qwen2_moe"), tmp_path / fmt, 4, 8, sym=False, fmt=fmt)
    prompts = [[5, 9, 300, 17], [44, 2, 2, 81, 6, 7, 19, 20, 23]]
    got = []
    for tiered in (False, True):
        model, probe = tiny.load_placed(d, tiered)
        assert model.store.held == np.uint32
        got.append(tiny.prefill_then_decode(model, prompts))
        assert (model.store.disk.bytes_read > 0) == tiered
        if tiered:
            ref = tiny.hf_logits(d, prompts[1])
            np.testing.assert_allclose(got[0][0][1], ref[-1], atol=1e-4)
        model.store.close()
        probe.store.close()
    np.testing.assert_array_equal(got[0][0], got[1][0])
    np.testing.assert_array_equal(got[0][1], got[1][1])
