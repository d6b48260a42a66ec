"""Tiny random checkpoints of every family, built with transformers, and a trained BPE tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

VOCAB = 320
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. ",
    "Der schnelle braune Fuchs springt über den faulen Hund. ",
    "Le renard brun rapide saute par-dessus le chien paresseux. ",
    'int main(void) { printf("hello\\n"); return 0; }\n',
    "Permission is hereby granted, free of charge, to any person obtaining a copy ",
    "emoji 🐦 colibrì — naïve café ",
]

# Small but not degenerate: several experts per token, GQA groups, >1 MoE layer.
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    initializer_range=0.2,
    bos_token_id=None,
    eos_token_id=VOCAB - 1,
)
FAMILY_CONFIGS = {
    "qwen3_moe": dict(
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
    ),
    "qwen2_moe": dict(
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
        qkv_bias=True,
    ),
    "olmoe": dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2, clip_qkv=4.0),
    "mixtral": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    "deepseek_v3": dict(
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=16,
        num_experts_per_tok=3,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        kv_lora_rank=32,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        num_key_value_heads=4,
        rope_interleave=True,
    ),
    # DeepSeek-V2-Lite's way: greedy top-k of the softmax, weights scaled and not renormalised,
    # one query projection, YaRN (mscale and mscale_all_dim apart: both corrections show)
    "deepseek_v2": dict(
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=16,
        num_experts_per_tok=3,
        n_shared_experts=2,
        topk_method="greedy",
        norm_topk_prob=False,
        first_k_dense_replace=1,
        routed_scaling_factor=1.5,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        num_key_value_heads=4,
        rope_scaling=dict(
            type="yarn",
            factor=8.0,
            original_max_position_embeddings=64,
            mscale=1.0,
            mscale_all_dim=0.5,
            beta_fast=32,
            beta_slow=1,
        ),
    ),
    "glm4_moe": dict(
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=1.5,
        use_qk_norm=True,
        partial_rotary_factor=0.5,
        attention_bias=True,
    ),
}


# DeepSeek sparse attention's tiny shape: MLA as deepseek_v3's, one shared expert after a dense
# layer, and an indexer with heads and dims enough that no two scores tie at the top-k cut
_DSA_SHAPE = dict(
    intermediate_size=96,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    kv_lora_rank=32,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    num_key_value_heads=4,
    index_topk=8,
    index_head_dim=32,
    index_n_heads=16,
)

# Families checked in test_families_more.py (the oracle's checks, synth), built as the others
# are but outside FAMILIES, so the sweeps over every family do not grow with them.
MORE_FAMILY_CONFIGS = {
    # dots.llm1: Qwen3's attention (with every bias), DeepSeek-V3's routing (the top 2 of 4
    # groups), two shared experts (one MLP twice as wide), a dense first layer
    "dots1": dict(
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=16,
        num_experts_per_tok=3,
        n_shared_experts=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        attention_bias=True,
    ),
    # MiniMax-M2: q/k norms over all heads, 12 of each head's 16 dims rotated
    "minimax_m2": dict(
        head_dim=16,
        rotary_dim=12,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
    # DeepSeek-V3.2 (test_families_dsa.py): DeepSeek-V3's MLA and routing, a lightning indexer
    # of 16 heads of 32 dims (the first 8 rotated by halves) keeping 8 positions a query
    "deepseek_v32": dict(
        **_DSA_SHAPE,
        n_routed_experts=16,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    ),
    # GLM-5: the same, the indexer's rotated dims in pairs; layers 1 and 2 reuse layer 0's choice
    "glm_moe_dsa": dict(
        **_DSA_SHAPE,
        num_hidden_layers=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.5,
        indexer_types=["full", "shared", "shared", "full"],
    ),
}


# Variants of a family: (family, overrides of its FAMILY_CONFIGS), built as checkpoints(name).
VARIANTS = {
    # DeepSeek-V2's way: the top 2 of 4 groups by their best expert, a query LoRA; with
    # norm_topk_prob true, which transformers reads and leaves unused (never renormalised)
    "deepseek_v2-grouped": (
        "deepseek_v2",
        dict(
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            q_lora_rank=24,
            routed_scaling_factor=2.5,
            rope_scaling=None,
        ),
    ),
}


# Multimodal families (test_families_kimi.py): (their language model's fields, under
# text_config with COMMON's, and the wrapper's own), built with AutoModelForImageTextToText: a
# small vision tower's and projector's tensors beside the language model's.
MULTIMODAL_CONFIGS = {
    # Kimi K2.5: DeepSeek-V3 (MLA, the top 2 of 4 groups, a shared expert after a dense layer;
    # every projection's columns whole groups of 32, as the release's int4 has them) under a
    # one-block vision tower
    "kimi_k25": (
        dict(
            model_type="deepseek_v3",
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=16,
            num_experts_per_tok=3,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            routed_scaling_factor=2.827,
            kv_lora_rank=32,
            q_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            num_key_value_heads=4,
        ),
        dict(
            vision_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                patch_size=4,
                pos_emb_height=4,
                pos_emb_width=4,
                pos_emb_time=2,
            ),
            projection_hidden_size=32,
        ),
    ),
}


def train_tokenizer(out_dir: Path, vocab: int = VOCAB) -> None:
    """Byte-level BPE over a few languages and code."""
    from colibri.synth import write_tokenizer

    assert write_tokenizer(out_dir / "tokenizer.json", vocab, CORPUS * 20) < vocab


def build(family: str, out_dir: Path, dtype: str = "float32", seed: int = 0, **overrides) -> Path:
    """Save a random `family` checkpoint (or one of VARIANTS) with transformers into out_dir;
    returns out_dir."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    out_dir.mkdir(parents=True, exist_ok=True)
    if family in VARIANTS:
        family, changed = VARIANTS[family]
        overrides = {**changed, **overrides}
    auto = AutoModelForCausalLM
    if family in MULTIMODAL_CONFIGS:  # the language model's fields under text_config
        text, wrapper = MULTIMODAL_CONFIGS[family]
        kw = {**COMMON, **text, **overrides}
        tie = kw["tie_word_embeddings"]  # the wrapper's decides (Kimi_K25Config's default: tied)
        cfg = AutoConfig.for_model(family, text_config=kw, tie_word_embeddings=tie, **wrapper)
        auto = AutoModelForImageTextToText
    else:
        kw = {**COMMON, **{**FAMILY_CONFIGS, **MORE_FAMILY_CONFIGS}[family], **overrides}
        cfg = AutoConfig.for_model(family, **kw)
    torch.manual_seed(seed)
    model = auto.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))  # norms away from 1 catch mix-ups
            elif name.endswith("indexer.k_norm.bias"):  # DSA's LayerNorm has a bias
                p.copy_(0.1 * torch.randn_like(p))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn_like(buf))  # a bias large enough to change choices
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    model.save_pretrained(out_dir)
    train_tokenizer(out_dir)
    return out_dir


def add_mtp(model_dir: Path) -> Path:
    """Append a multi-token prediction layer to a DeepSeek-style checkpoint, as DeepSeek-V3,
    -V3.2 and GLM-5 ship one: model.layers.{num_hidden_layers}.*, the last layer's tensors
    under the next index and the MTP's own (eh_proj, enorm, hnorm, shared_head.norm), which
    transformers ignores."""
    from safetensors.numpy import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    L = saved_config(model_dir)["num_hidden_layers"]
    last, mtp = f"model.layers.{L - 1}.", f"model.layers.{L}."
    for name, w in list(tensors.items()):
        if name.startswith(last):
            tensors[mtp + name.removeprefix(last)] = w.copy()
    D = tensors["model.norm.weight"].shape[0]
    rng = np.random.default_rng(L)
    tensors[f"{mtp}eh_proj.weight"] = rng.standard_normal((D, 2 * D), np.float32)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{mtp}{norm}.weight"] = np.ones(D, np.float32)
    save_file(tensors, path, {"format": "pt"})
    return model_dir


def to_fp8(src: Path, out: Path, block: int) -> Path:
    """A copy of checkpoint `src` as DeepSeek-V3 ships its weights: every linear layer's weight
    block-quantized to float8_e4m3fn (block x block, float32 scales), the rest as it was."""
    import shutil

    from safetensors.numpy import load_file

    from colibri.checkpoint import quantize_fp8, write_safetensors
    from colibri.synth import fp8_linear

    out.mkdir(parents=True, exist_ok=True)
    tensors, kinds = {}, {}
    for name, w in load_file(src / "model.safetensors").items():
        if fp8_linear(name):
            tensors[name], tensors[f"{name}_scale_inv"] = quantize_fp8(w, (block, block))
            kinds[name] = "F8_E4M3"
        else:
            tensors[name] = w
    write_safetensors(out / "model.safetensors", tensors, "F32", kinds)
    cfg = saved_config(src)
    cfg["quantization_config"] = dict(
        quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[block] * 2
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("generation_config.json", "tokenizer.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out


def to_packed(src: Path, out: Path, bits: int, group: int) -> Path:
    """A copy of checkpoint `src` as compressed-tensors' W4A16 / W8A16 releases store it: every
    linear layer's weight pack-quantized (`bits`, a bfloat16 scale per `group` columns), the
    rest as it was."""
    import shutil

    from safetensors.numpy import load_file

    from colibri.checkpoint import write_safetensors
    from colibri.synth import add_packed, fp8_linear, packed_quantization

    out.mkdir(parents=True, exist_ok=True)
    tensors, kinds = {}, {}

    def add(name, arr, kind):
        tensors[name], kinds[name] = arr, kind

    for name, w in load_file(src / "model.safetensors").items():
        if fp8_linear(name):
            add_packed(add, name, w, bits, group)
        else:
            tensors[name] = w
    write_safetensors(out / "model.safetensors", tensors, "F32", kinds)
    cfg = saved_config(src)
    cfg["quantization_config"] = packed_quantization(bits, group)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("generation_config.json", "tokenizer.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out


def to_gptq(src: Path, out: Path, bits: int, group: int, sym: bool = True, fmt: str = "gptq"):
    """A copy of checkpoint `src` as GPTQ releases store it: every linear layer's weight
    GPTQ-quantized (`bits`, a float16 scale and a zero point per `group` columns; qweight,
    qzeros, scales, g_idx), the rest as it was; fmt "awq": as AutoAWQ's GEMM releases store it
    (4 bits, zero points; qweight, qzeros, scales)."""
    import shutil

    from safetensors.numpy import load_file

    from colibri.checkpoint import write_safetensors
    from colibri.synth import add_awq, add_gptq, awq_quantization, fp8_linear, gptq_quantization

    out.mkdir(parents=True, exist_ok=True)
    tensors, kinds = {}, {}

    def add(name, arr, kind):
        tensors[name], kinds[name] = arr, kind

    for name, w in load_file(src / "model.safetensors").items():
        if fp8_linear(name) and fmt == "awq":
            add_awq(add, name, w, group)
        elif fp8_linear(name):
            add_gptq(add, name, w, bits, group, sym, fmt)
        else:
            tensors[name] = w
    write_safetensors(out / "model.safetensors", tensors, "F32", kinds)
    cfg = saved_config(src)
    awq = awq_quantization(group)
    cfg["quantization_config"] = awq if fmt == "awq" else gptq_quantization(bits, group, sym, fmt)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("generation_config.json", "tokenizer.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out


def gptq_weight(qweight, qzeros, scales, g_idx, bits: int, fmt: str = "gptq") -> np.ndarray:
    """The float32 matrix [O, I] a GPTQ weight stands for, straight from the layout GPTQ
    documents: qweight [I * bits / 32, O] holds input column 32 / bits * k + j of every output
    in bits [bits * j, bits * (j + 1)) of row k; qzeros [groups, O * bits / 32] likewise the
    zero point of output 32 / bits * k + j (the "gptq" format: less one); scales [groups, O];
    W^T[i, o] = (q[i, o] - zero[g_idx[i], o]) * scales[g_idx[i], o]."""
    per, mask = 32 // bits, (1 << bits) - 1
    words = np.asarray(qweight).astype(np.int64) & 0xFFFFFFFF
    zwords = np.asarray(qzeros).astype(np.int64) & 0xFFFFFFFF
    q = np.zeros((words.shape[0] * per, words.shape[1]), np.int64)
    z = np.zeros((zwords.shape[0], zwords.shape[1] * per), np.int64)
    for j in range(per):
        q[j::per] = (words >> (bits * j)) & mask
        z[:, j::per] = (zwords >> (bits * j)) & mask
    z = z[:, : q.shape[1]] + (fmt == "gptq")  # a last word's unused outputs dropped
    g = np.asarray(g_idx).astype(np.int64)
    s = np.asarray(scales, np.float32)
    return ((q - z[g]).astype(np.float32) * s[g]).T.copy()


def awq_weight(qweight, qzeros, scales, group: int) -> np.ndarray:
    """The float32 matrix [O, I] an AutoAWQ GEMM weight stands for, from the layout as AWQ
    documents it: qweight [I, O / 8] holds output 8 m + [0, 2, 4, 6, 1, 3, 5, 7][k] of input i
    in bits [4 k, 4 k + 4) of word [i, m]; qzeros [groups, O / 8] likewise each group's zero
    points; W^T[i, o] = (q[i, o] - zero[i // group, o]) * scales[i // group, o]."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    words = np.asarray(qweight).astype(np.int64) & 0xFFFFFFFF
    zwords = np.asarray(qzeros).astype(np.int64) & 0xFFFFFFFF
    q = np.zeros((words.shape[0], words.shape[1] * 8), np.int64)
    z = np.zeros((zwords.shape[0], zwords.shape[1] * 8), np.int64)
    for k in range(8):
        q[:, order[k] :: 8] = (words >> (4 * k)) & 15
        z[:, order[k] :: 8] = (zwords >> (4 * k)) & 15
    g = np.arange(q.shape[0]) // (group if group > 0 else q.shape[0])
    return ((q - z[g]).astype(np.float32) * np.asarray(scales, np.float32)[g]).T.copy()


def decompressed(model_dir: Path) -> Path:
    """A float32 copy of a pack-quantized checkpoint with each packed weight as
    compressed-tensors itself decompresses it in a float32 model (its unpacking, then its
    dequantize with the scales in float32): the oracle's view of that checkpoint. (transformers
    loading the packed checkpoint itself keeps fused experts in bfloat16.)"""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors.torch import load_file, save_file

    out = model_dir.parent / f"{model_dir.name}-decompressed"
    if out.exists():
        return out
    cfg = saved_config(model_dir)
    weights = cfg.pop("quantization_config")["config_groups"]["group_0"]["weights"]
    args = QuantizationArgs(**weights)
    cfg["torch_dtype"] = "float32"
    tensors, dense = {}, {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    for name, t in tensors.items():
        base = name.removesuffix("_packed")
        if name.endswith(".weight_packed"):
            shape = torch.Size(tensors[f"{base}_shape"].tolist())
            q = unpack_from_int32(t, args.num_bits, shape)
            scale = tensors[f"{base}_scale"].float()
            dense[base] = dequantize(q, scale, None, args, dtype=torch.float32)
        elif not name.endswith((".weight_scale", ".weight_shape")):
            dense[name] = t.float()
    return _float32_copy(model_dir, out, cfg, lambda path: save_file(dense, path, {"format": "pt"}))


def gptq_dequantized(model_dir: Path) -> Path:
    """A float32 copy of a GPTQ (AWQ) checkpoint, each weight as `gptq_weight` (`awq_weight`)
    gives it (transformers reads GPTQ and AWQ through GPTQModel's kernels, which this CPU-only
    machine does not build): the oracle's view of that checkpoint."""
    from safetensors.numpy import load_file, save_file

    out = model_dir.parent / f"{model_dir.name}-dequantized"
    if out.exists():
        return out
    cfg = saved_config(model_dir)
    quant = cfg.pop("quantization_config")
    cfg["torch_dtype"] = "float32"
    tensors, dense = {}, {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    fmt = quant.get("checkpoint_format", "gptq")
    for name, t in tensors.items():
        base = name.removesuffix(".qweight")
        if name.endswith(".qweight") and quant["quant_method"] == "awq":
            parts = [tensors[f"{base}.{p}"] for p in ("qzeros", "scales")]
            dense[f"{base}.weight"] = awq_weight(t, *parts, quant["group_size"])
        elif name.endswith(".qweight"):
            parts = [tensors[f"{base}.{p}"] for p in ("qzeros", "scales", "g_idx")]
            dense[f"{base}.weight"] = gptq_weight(t, *parts, quant["bits"], fmt)
        elif not name.endswith((".qzeros", ".scales", ".g_idx")):
            dense[name] = t.astype(np.float32)
    return _float32_copy(model_dir, out, cfg, lambda path: save_file(dense, path, {"format": "pt"}))


def _float32_copy(model_dir: Path, out: Path, cfg: dict, save) -> Path:
    """Folder `out` with the weights `save(path)` writes, config `cfg` and `model_dir`'s
    generation config and tokenizer."""
    out.mkdir()
    save(out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("generation_config.json", "tokenizer.json"):
        if (model_dir / name).exists():
            (out / name).write_bytes((model_dir / name).read_bytes())
    return out


def load_placed(model_dir: Path, tiered: bool, holding=None):
    """(model, probe): the checkpoint loaded with every routed expert resident (model is probe),
    or tiered: 3 device slots a layer and 4 experts' room in RAM, the rest read from disk;
    matrices held as `holding` (a formats.Holding; default: every format) allows."""
    from colibri.engine.model import load_model
    from colibri.experts.budget import TierConfig
    from colibri.formats import HOLD_ALL

    holding = holding or HOLD_ALL

    probe = load_model(model_dir, progress=False, holding=holding)
    if not tiered:
        return probe, probe
    eb, layers = probe.store.expert_bytes, len(probe.cfg.moe_layer_ids)
    tiers = TierConfig(device_bytes=layers * 3 * eb, ram_bytes=4 * eb, unified=False)
    model = load_model(model_dir, tiers=tiers, progress=False, holding=holding)
    assert not model.store.all_resident
    return model, probe


def held_and_dequantized(model_dir: Path, switch: str, tiered: bool) -> list:
    """A quantized DeepSeek-style checkpoint loaded with `switch` (COLIBRI_FP8, COLIBRI_INT4)
    on, then off (dequantized at load), resident or tiered; for each: (how the routed experts
    are held, the dtypes of layer 0's o projection, kv_a norm and lm_head, an expert's bytes,
    and `prefill_then_decode`'s logits for two short prompts and one of 40 tokens)."""
    from colibri.formats import Holding

    prompts = [[5, 9, 300, 17], [44, 2, 2, 81, 6, 7], list(range(3, 43))]
    got = []
    for on in ("1", "0"):
        model, probe = load_placed(model_dir, tiered, Holding.from_env({switch: on}))
        logits, steps = prefill_then_decode(model, prompts)
        attn = model.params["layers"][0]["attn"]
        dense = (attn["o"].dtype, attn["kv_a_norm"].dtype, model.params["lm_head"].dtype)
        got.append((model.store.held, dense, model.store.expert_bytes, logits, steps))
        model.store.close()
        probe.store.close()
    return got


def prefill_then_decode(model, prompts: list[list[int]], steps: int = 3):
    """Each prompt prefilled in a slot of its own, then `steps` greedy decode steps of all of
    them at once: (prefill logits [P, V], decode logits [steps, P, V])."""
    from colibri.engine.runner import Row, Runner

    runner = Runner(model, slots=len(prompts), capacity=64)
    logits = [runner.prefill(s, p)[0] for s, p in enumerate(prompts)]
    out, last = [], logits
    for k in range(steps):
        rows = [Row(s, int(np.argmax(last[s])), len(p) + k) for s, p in enumerate(prompts)]
        last = runner.decode(rows)[0]
        out.append(last)
    return np.asarray(logits), np.asarray(out)


def hf_model(model_dir: Path):
    """transformers' float32 model of the checkpoint (of a pack-quantized one, `decompressed`;
    of a multimodal one, the whole model, which text-only ids run through its language model)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    saved = saved_config(model_dir)
    multimodal = saved.get("model_type") in MULTIMODAL_CONFIGS
    auto = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
    quant = saved.get("quantization_config") or {}
    if quant.get("quant_method") == "compressed-tensors":
        model_dir = decompressed(model_dir)
    if quant.get("quant_method") in ("gptq", "awq"):
        model_dir = gptq_dequantized(model_dir)
    kw = {}
    if quant.get("quant_method") == "fp8":  # its dequantized path, which a CPU takes by itself
        from transformers import FineGrainedFP8Config

        kw["quantization_config"] = FineGrainedFP8Config(
            dequantize=True, weight_block_size=tuple(quant["weight_block_size"])
        )
    m = auto.from_pretrained(model_dir, dtype=torch.float32, **kw)
    m.eval()
    return m


def hf_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf_model(model_dir)(torch.tensor([ids])).logits[0].float().numpy()


def saved_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


# ---------------------------------------------------------------------------- oracle checks


def check_full_logits(model, hf, ids: list[int], atol: float = 1e-4) -> None:
    """colibri's logits at every position of `ids` are transformers' within atol."""
    import torch

    from colibri.engine.runner import Runner

    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(Runner(model, capacity=128).full_logits(ids), ref, atol=atol, rtol=0)


def check_incremental_decode(
    model, ids: list[int], split: int | None = None, atol: float = 1e-4
) -> None:
    """ids[:split] (default half) prefilled into slot 2, the rest decoded one at a time: each
    step's logits are the full forward's at that position."""
    from colibri.engine.runner import Row, Runner

    full = Runner(model, capacity=128).full_logits(ids)
    runner = Runner(model, slots=3, capacity=128)
    split = len(ids) // 2 if split is None else split
    last, _ = runner.prefill(2, ids[:split])
    steps = [last]
    for p in range(split, len(ids)):
        logits, _ = runner.decode([Row(2, ids[p], p)])
        steps.append(logits[0])
    np.testing.assert_allclose(np.stack(steps[:-1]), full[split - 1 : -1], atol=atol, rtol=0)
    np.testing.assert_allclose(steps[-1], full[-1], atol=atol, rtol=0)


def check_rows_alone(model, ids: list[int], rows: int = 16) -> None:
    """Batch invariance through the whole model: `rows` conversations (prefixes of ids of
    growing length) decoded together, and every fifth decoded alone, give that row bitwise
    the same logits (on a GPU, within float32 rounding)."""
    import jax

    from colibri.engine.runner import Row, Runner

    runner = Runner(model, slots=rows, capacity=128)
    batch = []
    for s in range(rows):
        prompt = ids[: 4 + s]
        runner.prefill(s, prompt)
        batch.append(Row(s, ids[(7 * s) % len(ids)], len(prompt)))
    together = runner.decode(batch)[0]  # (each decode writes the same keys and values again)
    alone = np.stack([runner.decode([r])[0][0] for r in batch[::5]])
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(alone, together[::5])
    else:
        np.testing.assert_allclose(alone, together[::5], rtol=0, atol=1e-4)


def hf_greedy(hf, ids: list[int], n: int = 32) -> list[int]:
    """transformers' `generate`: n greedy tokens after `ids`."""
    import torch

    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


def check_greedy(model, hf, ids: list[int], n: int = 32) -> None:
    """n greedy tokens after `ids` are transformers' `generate`'s."""
    from colibri.engine.generate import generate_ids
    from colibri.engine.runner import Runner

    assert list(generate_ids(Runner(model, capacity=128), ids, max_tokens=n)) == hf_greedy(
        hf, ids, n
    )
