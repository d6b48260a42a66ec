"""GGUF export: tensors round-trip exactly, and llama.cpp continues a prompt as colibri does."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from colibri.checkpoint import Checkpoint, write_safetensors
from colibri.engine.generate import generate_ids
from colibri.gguf import export_gguf, llama_generate, llama_generate_parallel, llama_logits
from colibri.synth import SynthSpec, synthesize

gguf = pytest.importorskip("gguf")

FAMILIES = ["qwen3_moe", "olmoe"]
# Q8_0 blocks hold 32 values: every matrix row here (64 or 32 wide) fills whole blocks.
SMALL = dict(layers=2, experts=8, top_k=2, hidden=64, moe_ff=32, vocab=300, heads=2)
KV_HEADS = {"qwen3_moe": 1, "olmoe": 2}  # llama.cpp's olmoe has no grouped-query attention
PROMPT = "def forward(x): The router sends every token"
N_NEW = 16


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """exported(family, dtype) -> (checkpoint folder, GGUF path), built once per module."""
    built: dict[tuple[str, str], tuple] = {}

    def get(family: str, dtype: str = "f32", stored: str = "f32"):
        """`stored`: the checkpoint's own dtype."""
        if (family, dtype, stored) not in built:
            root = tmp_path_factory.mktemp(family)
            spec = SynthSpec(family=family, kv_heads=KV_HEADS[family], dtype=stored, **SMALL)
            d = synthesize(spec, root / "ckpt", progress=False)
            out = export_gguf(d, root / f"model-{dtype}.gguf", dtype)
            built[family, dtype, stored] = d, out
        return built[family, dtype, stored]

    return get


def _hf_source(name: str, E: int) -> list[str]:
    """The Hugging Face tensors a GGUF tensor came from (experts stacked in order)."""
    fixed = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if name in fixed:
        return [fixed[name]]
    _, i, kind, _ = name.split(".")
    p = f"model.layers.{i}"
    per_layer = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate_inp": "mlp.gate",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    }
    if kind in per_layer:
        return [f"{p}.{per_layer[kind]}.weight"]
    proj = kind.removeprefix("ffn_").removesuffix("_exps")
    return [f"{p}.mlp.experts.{e}.{proj}_proj.weight" for e in range(E)]


def _field(reader, key: str):
    return reader.fields[key].contents()


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_export_round_trips_every_tensor(family, exported):
    d, path = exported(family)
    reader = gguf.GGUFReader(path)
    ckpt = Checkpoint(d)
    E = SMALL["experts"]
    assert len(reader.tensors) == 3 + SMALL["layers"] * 12
    used = set()
    for t in reader.tensors:
        sources = _hf_source(t.name, E)
        ref = (
            np.stack([ckpt.read(n) for n in sources]) if len(sources) > 1 else ckpt.read(sources[0])
        )
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
        assert tuple(t.data.shape) == ref.shape, t.name
        assert list(t.shape) == list(reversed(ref.shape)), t.name  # ggml's ne order
        np.testing.assert_array_equal(t.data, ref, err_msg=t.name)
        used.update(sources)
    assert used == set(ckpt.tensors)


@pytest.mark.parametrize("family", FAMILIES)
def test_metadata_has_what_llama_cpp_reads(family, exported):
    d, path = exported(family)
    reader = gguf.GGUFReader(path)
    arch = {"qwen3_moe": "qwen3moe", "olmoe": "olmoe"}[family]
    assert _field(reader, "general.architecture") == arch
    assert _field(reader, "general.file_type") == 0
    expected = {
        "block_count": SMALL["layers"],
        "embedding_length": SMALL["hidden"],
        "expert_count": SMALL["experts"],
        "expert_used_count": SMALL["top_k"],
        "expert_feed_forward_length": SMALL["moe_ff"],
        "attention.head_count": 2,
        "attention.head_count_kv": KV_HEADS[family],
        "attention.key_length": 32,
        "rope.dimension_count": 32,
        "rope.freq_base": 10000.0,
    }
    for key, value in expected.items():
        assert _field(reader, f"{arch}.{key}") == value, key
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == SMALL["vocab"]
    assert tokens[-1] == "<|endoftext|>"
    assert _field(reader, "tokenizer.ggml.token_type")[-1] == 3  # control
    assert _field(reader, "tokenizer.ggml.eos_token_id") == SMALL["vocab"] - 1
    assert _field(reader, "tokenizer.ggml.merges")[0].count(" ") == 1


def test_q8_0_quantises_matrices_and_keeps_norms_and_routers(exported):
    d, path = exported("qwen3_moe", "q8_0")
    reader = gguf.GGUFReader(path)
    ckpt = Checkpoint(d)
    Q = gguf.GGMLQuantizationType
    assert _field(reader, "general.file_type") == 7
    for t in reader.tensors:
        small = len(t.shape) == 1 or "ffn_gate_inp" in t.name
        assert t.tensor_type == (Q.F32 if small else Q.Q8_0), t.name
    q = next(t for t in reader.tensors if t.name == "blk.1.attn_q.weight")
    ref = ckpt.read("model.layers.1.self_attn.q_proj.weight")
    back = gguf.quants.dequantize(q.data, Q.Q8_0)
    assert back.shape == ref.shape
    # One f16 scale per 32 values: half a step of max|block| / 127, plus the scale's rounding.
    step = np.abs(ref.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
    assert np.all(np.abs(back - ref).reshape(-1, 32) <= (0.5 + 127 * 2**-11) * step)


def test_q4_0_quantises_matrices_within_a_step_and_keeps_norms_and_routers(exported):
    d, path = exported("qwen3_moe", "q4_0")
    reader = gguf.GGUFReader(path)
    ckpt = Checkpoint(d)
    Q = gguf.GGMLQuantizationType
    assert _field(reader, "general.file_type") == 2
    for t in reader.tensors:
        small = len(t.shape) == 1 or "ffn_gate_inp" in t.name
        assert t.tensor_type == (Q.F32 if small else Q.Q4_0), t.name
    for name, hf in (
        ("blk.1.attn_q.weight", ["model.layers.1.self_attn.q_proj.weight"]),
        ("blk.0.ffn_down_exps.weight", _hf_source("blk.0.ffn_down_exps.weight", 8)),
    ):
        q = next(t for t in reader.tensors if t.name == name)
        ref = np.stack([ckpt.read(n) for n in hf]) if len(hf) > 1 else ckpt.read(hf[0])
        back = gguf.quants.dequantize(q.data, Q.Q4_0)
        assert back.shape == ref.shape, name
        # A block's step d is its largest-magnitude value over -8 (f16): values round to
        # within d / 2, except at the end opposite that value, where +8 steps clip to +7.
        step = np.abs(ref.reshape(-1, 32)).max(axis=1, keepdims=True) / 8
        err = np.abs(back - ref).reshape(-1, 32)
        assert np.all(err <= (1 + 2**-7) * step), name
        assert np.mean(err <= (0.5 + 2**-7) * step) > 0.95, name


def test_bf16_export_keeps_a_bf16_checkpoints_matrices_bit_for_bit(exported):
    d, path = exported("qwen3_moe", "bf16", stored="bf16")
    reader = gguf.GGUFReader(path)
    ckpt = Checkpoint(d)
    Q = gguf.GGMLQuantizationType
    assert _field(reader, "general.file_type") == 32
    for t in reader.tensors:
        small = len(t.shape) == 1 or "ffn_gate_inp" in t.name
        assert t.tensor_type == (Q.F32 if small else Q.BF16), t.name
    q = next(t for t in reader.tensors if t.name == "blk.1.attn_q.weight")
    stored = ckpt.read_raw("model.layers.1.self_attn.q_proj.weight")
    assert np.array_equal(np.asarray(q.data).view(np.uint16).reshape(stored.shape), stored)


@pytest.mark.parametrize(
    "family, edit, match",
    [
        ("mixtral", {}, "supports qwen3_moe, olmoe"),
        # llama.cpp hard-codes top-k renormalisation (qwen3moe on, olmoe off) and no GQA in olmoe
        ("qwen3_moe", {"norm_topk_prob": False}, "norm_topk_prob=False"),
        ("olmoe", {"num_key_value_heads": 1}, "num_key_value_heads=1"),
        ("olmoe", {"clip_qkv": 8.0}, "clip_qkv=8.0"),
    ],
)
def test_export_refuses_what_llama_cpp_would_run_differently(family, edit, match, tmp_path):
    d = synthesize(SynthSpec(family=family, **SMALL), tmp_path / family, progress=False)
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, **edit}))
    with pytest.raises(ValueError, match=match):
        export_gguf(d, tmp_path / "m.gguf")


def test_export_names_a_missing_tensor_and_leaves_no_file(tmp_path):
    d = synthesize(SynthSpec(**SMALL), tmp_path / "ckpt", progress=False)
    ckpt = Checkpoint(d)
    gone = "model.layers.1.mlp.experts.3.up_proj.weight"
    write_safetensors(d / "model.safetensors", {n: ckpt.read(n) for n in ckpt.tensors if n != gone})
    with pytest.raises(ValueError, match=re.escape(gone)):
        export_gguf(d, tmp_path / "m.gguf")
    assert not list(tmp_path.glob("m.gguf*"))


def test_export_refuses_unknown_dtype(tmp_path):
    with pytest.raises(ValueError, match="dtype='q4'"):
        export_gguf(tmp_path, tmp_path / "m.gguf", dtype="q4")


# --- llama.cpp itself (the `bench` extra) ---------------------------------------------------


def _colibri(d):
    from colibri.engine.model import load_model
    from colibri.engine.runner import Runner

    model = load_model(d, progress=False)
    runner = Runner(model, capacity=64)
    ids = model.tokenizer.encode(PROMPT)
    return model, runner, ids, list(generate_ids(runner, ids, N_NEW))


@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_greedy_and_logits_match_colibri(family, exported):
    llama_cpp = pytest.importorskip("llama_cpp")
    d, path = exported(family)
    _, runner, ids, ours = _colibri(d)
    vocab = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    assert vocab.tokenize(PROMPT.encode(), add_bos=False, special=False) == ids
    vocab.close()
    theirs, timings = llama_generate(path, ids, N_NEW, n_threads=2)  # llama.cpp's f16 KV cache
    assert theirs == ours
    assert timings["n_p_eval"] == len(ids) and timings["n_eval"] == N_NEW - 1
    # Every position's logits, f32 weights and f32 KV cache on both sides.
    seq = ids + ours[:-1]
    ref = llama_logits(path, seq, n_threads=2)
    np.testing.assert_allclose(runner.full_logits(seq), ref, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_decodes_several_conversations_at_once_as_colibri_does_each(family, exported):
    """llama.cpp's batched decode (a sequence each, one llama_decode a step), the peer of
    colibri's several rows: each conversation's greedy tokens are colibri's for it alone."""
    pytest.importorskip("llama_cpp")
    d, path = exported(family)
    _, runner, ids, ours = _colibri(d)
    prompts = [ids, ids[:-3] + [7, 8, 9], ids[:5] + [40, 41], list(range(60, 80))]
    theirs, timings = llama_generate_parallel(path, prompts, N_NEW, n_threads=2)
    assert theirs[0] == ours
    for p, got in zip(prompts[1:], theirs[1:], strict=True):
        assert got == list(generate_ids(runner, p, N_NEW))
    assert len({tuple(t) for t in theirs}) > 1  # the conversations do differ
    assert timings["decode_tok_s"] > 0 and timings["prefill_s"] > 0
    assert timings["decode_tok_s"] == pytest.approx(4 * (N_NEW - 2) / timings["decode_s"])
    with pytest.raises(ValueError, match="n_new >= 3"):
        llama_generate_parallel(path, prompts, 2)
    with pytest.raises(ValueError, match="non-empty prompts"):
        llama_generate_parallel(path, [ids, []], N_NEW)
    with pytest.raises(ValueError, match="kv_type"):
        llama_generate_parallel(path, prompts, N_NEW, kv_type="q8_0")


def test_llama_cpp_runs_the_q8_0_file(exported):
    pytest.importorskip("llama_cpp")
    _, f32 = exported("olmoe")
    _, q8 = exported("olmoe", "q8_0")
    ids = list(range(10, 30))
    tokens, timings = llama_generate(q8, ids, 8, n_threads=2)
    assert len(tokens) == 8 and all(0 <= t < SMALL["vocab"] for t in tokens)
    assert timings["load_s"] > 0 and timings["prefill_tok_s"] > 0 and timings["decode_tok_s"] > 0
    # 8-bit weights move the logits by a few percent of their range, not more.
    ref, got = llama_logits(f32, ids, n_threads=2), llama_logits(q8, ids, n_threads=2)
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


def test_llama_cpp_runs_the_q4_0_file(exported):
    pytest.importorskip("llama_cpp")
    _, f32 = exported("olmoe")
    _, q4 = exported("olmoe", "q4_0")
    ids = list(range(10, 30))
    tokens, timings = llama_generate(q4, ids, 8, n_threads=2)
    assert len(tokens) == 8 and all(0 <= t < SMALL["vocab"] for t in tokens)
    assert timings["decode_tok_s"] > 0
    # 4-bit weights move the logits more than 8-bit ones, yet they follow the f32 ones.
    ref, got = llama_logits(f32, ids, n_threads=2), llama_logits(q4, ids, n_threads=2)
    assert np.isfinite(got).all()
    assert np.corrcoef(got.ravel(), ref.ravel())[0, 1] > 0.8


def test_llama_cpp_runs_the_bf16_file(exported):
    pytest.importorskip("llama_cpp")
    _, f32 = exported("qwen3_moe", "f32", stored="bf16")
    _, bf16 = exported("qwen3_moe", "bf16", stored="bf16")
    ids = list(range(10, 30))
    tokens, timings = llama_generate(bf16, ids, 8, n_threads=2)
    assert len(tokens) == 8 and timings["decode_tok_s"] > 0
    # The same weights; llama.cpp rounds the activations to bf16 for its bf16 products.
    ref, got = llama_logits(f32, ids, n_threads=2), llama_logits(bf16, ids, n_threads=2)
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


def test_the_llama_worker_decodes_the_conversations_together_too(exported):
    """bench_peers' llama.cpp worker: batch 1, then the conversations 4 and 16 at a time, its
    first conversation's tokens kept for the comparison with batch 1."""
    pytest.importorskip("llama_cpp")
    from colibri.bench.conversations import conversation_prompts
    from colibri.bench.workers import work_llama

    _, path = exported("olmoe")
    prompt = list(range(10, 30))
    res = work_llama(path, prompt, 8, conversation_prompts(prompt, 16, SMALL["vocab"]))
    assert res["batch_16_tokens_0"] == res["tokens"] == res["batch_4_tokens_0"]
    assert res["decode_tok_s_16"] > 0 and res["decode_tok_s_4"] > 0
    assert "decode_tok_s_16" not in work_llama(path, prompt, 8)
