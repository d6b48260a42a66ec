"""Random checkpoints in Hugging Face layout (config, sharded safetensors, tokenizer), any size."""

from __future__ import annotations

import copy
import json
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from colibri.checkpoint import (
    quantize_awq,
    quantize_fp8,
    quantize_gptq,
    quantize_packed,
    write_safetensors,
)
from colibri.config import FAMILIES

log = logging.getLogger("colibri.synth")

# fp8: the linear layers' weights block-quantized to float8_e4m3fn with float32 scales, as in
# DeepSeek-V3's checkpoints; int4 and int8: quantized to symmetric integers with a bfloat16
# scale per group of columns and packed into int32 words (compressed-tensors' pack-quantized
# W4A16 and W8A16); gptq4 and gptq8: GPTQ's layout (`quantize_gptq`, symmetric, float16
# scales), awq4: AutoAWQ's GEMM layout (`quantize_awq`, zero points), with the rest float16;
# everything else (embeddings, norms, routers, lm_head) bf16.
_DTYPES = {
    "f32": "F32",
    "bf16": "BF16",
    "f16": "F16",
    "fp8": "BF16",
    "int4": "BF16",
    "int8": "BF16",
    "gptq4": "F16",
    "gptq8": "F16",
    "awq4": "F16",
}
_TORCH_DTYPES = {k: "bfloat16" for k in _DTYPES} | {
    "f32": "float32",
    **{k: "float16" for k in ("f16", "gptq4", "gptq8", "awq4")},
}
_BITS = {"int4": 4, "int8": 8}
_GPTQ_BITS = {"gptq4": 4, "gptq8": 8}
_FP8_LINEAR = re.compile(r"((?<!weights)_proj|_proj_with_mqa|\.w[123]|indexer\.w(q_b|k))\.weight$")


def fp8_linear(name: str) -> bool:
    """Whether an FP8 checkpoint quantizes this tensor: the weight of a linear layer in the
    attention or an MLP (routed, shared or dense), not embeddings, norms, routers or lm_head;
    of DSA's indexer, the query and key projections, not the heads' weights (kept in float32)."""
    return bool(_FP8_LINEAR.search(name))


@dataclass(frozen=True)
class SynthSpec:
    """Shape of a synthetic checkpoint; every field is validated by `check`."""

    family: str = "qwen3_moe"
    layers: int = 4
    experts: int = 16
    top_k: int = 4
    hidden: int = 128
    moe_ff: int = 64
    vocab: int = 512
    heads: int = 0  # 0: hidden // 64, at least 2
    kv_heads: int = 0  # 0: heads // 2, at least 1
    dtype: str = "f32"
    fp8_block: int = 128  # dtype fp8: the side of a square block sharing one scale
    group: int = 128  # dtype int4/int8/gptq4/gptq8/awq4: columns a scale covers (0: a row)
    seed: int = 0
    shard_mb: float = 512

    def check(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r}: one of {', '.join(FAMILIES)}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: one of {', '.join(_DTYPES)}")
        for name in (
            "layers",
            "experts",
            "top_k",
            "hidden",
            "moe_ff",
            "vocab",
            "shard_mb",
            "fp8_block",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} exceeds experts={self.experts}")
        if self.vocab < 260:
            raise ValueError(f"vocab={self.vocab}: at least 260 (256 bytes + specials)")
        if self.group < 0:
            raise ValueError(f"group={self.group} must be 0 (a whole row) or positive")

    @property
    def n_heads(self) -> int:
        return self.heads or max(2, self.hidden // 64)

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or max(1, self.n_heads // 2)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads


def hf_config(s: SynthSpec) -> dict:
    """The config.json transformers writes for this family and shape."""
    if s.family == "kimi_k25":
        return _kimi_k25_config(s)
    base = dict(
        model_type=s.family,
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        num_hidden_layers=s.layers,
        num_attention_heads=s.n_heads,
        num_key_value_heads=s.n_kv_heads,
        hidden_act="silu",
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        rope_theta=10000.0,
        torch_dtype=_TORCH_DTYPES[s.dtype],
        num_experts_per_tok=s.top_k,
        initializer_range=0.02,
    )
    quant = weight_quantization(s)
    if quant:
        base["quantization_config"] = quant
    moe = {
        "qwen3_moe": dict(
            architectures=["Qwen3MoeForCausalLM"],
            head_dim=s.head_dim,
            num_experts=s.experts,
            moe_intermediate_size=s.moe_ff,
            intermediate_size=4 * s.moe_ff,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            attention_bias=False,
        ),
        "qwen2_moe": dict(
            architectures=["Qwen2MoeForCausalLM"],
            num_experts=s.experts,
            moe_intermediate_size=s.moe_ff,
            intermediate_size=4 * s.moe_ff,
            shared_expert_intermediate_size=2 * s.moe_ff,
            norm_topk_prob=False,
            qkv_bias=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
        "olmoe": dict(
            architectures=["OlmoeForCausalLM"],
            num_experts=s.experts,
            intermediate_size=s.moe_ff,
            norm_topk_prob=False,
            clip_qkv=None,
        ),
        "mixtral": dict(
            architectures=["MixtralForCausalLM"],
            num_local_experts=s.experts,
            intermediate_size=s.moe_ff,
        ),
        "deepseek_v3": dict(
            architectures=["DeepseekV3ForCausalLM"],
            **_v3_routing(s),
            **_v3_mla(s),
            rope_interleave=True,
        ),
        "deepseek_v2": dict(
            architectures=["DeepseekV2ForCausalLM"],
            n_routed_experts=s.experts,
            moe_intermediate_size=s.moe_ff,
            intermediate_size=4 * s.moe_ff,
            n_shared_experts=2,
            topk_method="group_limited_greedy",
            n_group=_groups(s.experts),
            topk_group=max(1, _groups(s.experts) // 2),
            first_k_dense_replace=1,
            routed_scaling_factor=2.0,
            norm_topk_prob=False,
            kv_lora_rank=max(16, s.hidden // 4),
            q_lora_rank=None,  # DeepSeek-V2-Lite: one query projection
            qk_rope_head_dim=16,
            qk_nope_head_dim=32,
            v_head_dim=32,
            num_key_value_heads=s.n_heads,  # MLA: transformers expects one K/V per head
        ),
        "glm4_moe": dict(
            architectures=["Glm4MoeForCausalLM"],
            head_dim=s.head_dim,
            n_routed_experts=s.experts,
            moe_intermediate_size=s.moe_ff,
            intermediate_size=4 * s.moe_ff,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            routed_scaling_factor=1.0,
            norm_topk_prob=True,
            use_qk_norm=True,
            partial_rotary_factor=0.5,
            attention_bias=True,
        ),
        "dots1": dict(
            architectures=["Dots1ForCausalLM"],
            head_dim=s.head_dim,
            **_v3_routing(s),
            attention_bias=False,
            sliding_window=None,
        ),
        "minimax_m2": dict(
            architectures=["MiniMaxM2ForCausalLM"],
            head_dim=s.head_dim,
            num_local_experts=s.experts,
            intermediate_size=s.moe_ff,
            rotary_dim=s.head_dim // 4 * 2,  # half of each head (MiniMax-M2: 64 of 128), even
        ),
        "deepseek_v32": dict(architectures=["DeepseekV32ForCausalLM"], **_dsa_config(s)),
        # GLM-5 with every other layer reusing the selection of the layer before
        "glm_moe_dsa": dict(
            architectures=["GlmMoeDsaForCausalLM"],
            indexer_types=["full" if i % 2 == 0 else "shared" for i in range(s.layers)],
            **_dsa_config(s),
        ),
    }[s.family]
    return {**base, **moe}


# Kimi K2.5's vision tower and projector as synth writes them, whatever the language model's
# size: one small block (colibri skips them; transformers loads them, and runs text without)
KIMI_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    patch_size=14,
    pos_emb_height=4,
    pos_emb_width=4,
    pos_emb_time=2,
    merge_kernel_size=[2, 2],
)


def _kimi_k25_config(s: SynthSpec) -> dict:
    """Kimi K2.5's config.json as transformers writes it: DeepSeek-V3's fields for this shape
    under text_config, KIMI_VISION under vision_config, the quantization_config at the top."""
    text = hf_config(replace(s, family="deepseek_v3"))
    del text["architectures"]
    quant = text.pop("quantization_config", None)
    out = dict(
        architectures=["Kimi_K25ForConditionalGeneration"],
        model_type="kimi_k25",
        text_config=text,
        vision_config=dict(KIMI_VISION),
        projection_hidden_size=KIMI_VISION["hidden_size"],
        tie_word_embeddings=False,
        torch_dtype=text["torch_dtype"],
    )
    return {**out, "quantization_config": quant} if quant else out


def _v3_routing(s: SynthSpec) -> dict:
    """DeepSeek-V3's routed and shared experts and grouped router for this shape (dots1, GLM-5
    and DeepSeek-V3.2 have the same)."""
    return dict(
        n_routed_experts=s.experts,
        moe_intermediate_size=s.moe_ff,
        intermediate_size=4 * s.moe_ff,
        n_shared_experts=1,
        n_group=_groups(s.experts),
        topk_group=max(1, _groups(s.experts) // 2),
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )


def _v3_mla(s: SynthSpec) -> dict:
    """DeepSeek-V3's MLA for this shape (GLM-5 and DeepSeek-V3.2 have the same)."""
    return dict(
        kv_lora_rank=max(16, s.hidden // 4),
        q_lora_rank=max(16, s.hidden // 2),
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        num_key_value_heads=s.n_heads,  # MLA: transformers expects one K/V per head
    )


def _dsa_config(s: SynthSpec) -> dict:
    """DeepSeek-V3.2's and GLM-5's fields: DeepSeek-V3's MLA and routing, and the lightning
    indexer as they ship it (half as many heads as attention, 2048 positions a query)."""
    return dict(
        **_v3_routing(s),
        **_v3_mla(s),
        index_topk=2048,
        index_head_dim=64,
        index_n_heads=max(4, s.n_heads // 2),
    )


def weight_quantization(s: SynthSpec) -> dict | None:
    """The quantization_config that describes weights laid out as `s.dtype`, None if plain."""
    if s.dtype == "fp8":
        return dict(
            quant_method="fp8",
            fmt="e4m3",
            activation_scheme="dynamic",
            weight_block_size=[s.fp8_block, s.fp8_block],
        )
    if s.dtype in _BITS:
        return packed_quantization(_BITS[s.dtype], s.group)
    if s.dtype in _GPTQ_BITS:
        return gptq_quantization(_GPTQ_BITS[s.dtype], s.group)
    if s.dtype == "awq4":
        return awq_quantization(s.group)
    return None


def packed_quantization(bits: int, group: int) -> dict:
    """The quantization_config of a compressed-tensors pack-quantized checkpoint whose linear
    layers (`fp8_linear` names them) hold symmetric `bits`-bit weights, a scale per `group`
    columns (0: per row); lm_head and the routers left as they are."""
    weights = dict(
        num_bits=bits,
        type="int",
        symmetric=True,
        strategy="group" if group else "channel",
        group_size=group or None,
        dynamic=False,
        observer="minmax",
        actorder=None,
    )
    return dict(
        quant_method="compressed-tensors",
        format="pack-quantized",
        quantization_status="compressed",
        config_groups={
            "group_0": dict(
                targets=["Linear"],
                format="pack-quantized",
                weights=weights,
                input_activations=None,
                output_activations=None,
            )
        },
        ignore=["lm_head", "re:.*mlp.gate$"],
        kv_cache_scheme=None,
    )


def add_packed(add, name: str, w: np.ndarray, bits: int, group: int) -> None:
    """add(name, array, dtype) the three tensors of weight `name` pack-quantized."""
    if group and w.shape[1] % group:
        raise ValueError(f"{name}: {w.shape[1]} columns are not whole groups of {group}")
    packed, scale, shape = quantize_packed(w, bits, group)
    base = name.removesuffix(".weight")
    add(f"{base}.weight_packed", packed, "I32")
    add(f"{base}.weight_scale", scale, "BF16")
    add(f"{base}.weight_shape", shape, "I64")


def gptq_quantization(
    bits: int, group: int, sym: bool = True, fmt: str = "gptq", desc_act: bool = False
) -> dict:
    """The quantization_config of a GPTQ checkpoint (as Qwen's "-GPTQ-Int4" releases carry
    it) whose linear layers (`fp8_linear` names them) hold `bits`-bit weights, a scale and zero
    point per `group` columns (0: per row, GPTQ's -1)."""
    return dict(
        quant_method="gptq",
        bits=bits,
        group_size=group or -1,
        desc_act=desc_act,
        sym=sym,
        static_groups=False,
        true_sequential=True,
        damp_percent=0.01,
        checkpoint_format=fmt,
    )


def add_gptq(
    add,
    name: str,
    w: np.ndarray,
    bits: int,
    group: int,
    sym: bool = True,
    fmt: str = "gptq",
    order: np.ndarray | None = None,
) -> None:
    """add(name, array, dtype) the four tensors of weight `name` GPTQ-quantized
    (`quantize_gptq`)."""
    base = name.removesuffix(".weight")
    parts = quantize_gptq(w, bits, group, sym, fmt, order)
    for part, arr in parts.items():
        add(f"{base}.{part}", arr, "F16" if part == "scales" else "I32")


def awq_quantization(group: int) -> dict:
    """The quantization_config of an AutoAWQ GEMM checkpoint whose linear layers hold 4-bit
    weights with a scale and zero point per `group` columns (0: per row)."""
    return dict(quant_method="awq", bits=4, group_size=group or -1, zero_point=True, version="gemm")


def add_awq(add, name: str, w: np.ndarray, group: int) -> None:
    """add(name, array, dtype) the three tensors of weight `name` AWQ-quantized
    (`quantize_awq`)."""
    base = name.removesuffix(".weight")
    for part, arr in quantize_awq(w, group).items():
        add(f"{base}.{part}", arr, "F16" if part == "scales" else "I32")


def _groups(experts: int) -> int:
    return next(g for g in (8, 4, 2, 1) if experts % g == 0 and experts // g >= 2)


def synthesize(spec: SynthSpec, out: Path, progress: bool = True) -> Path:
    """Write config.json, generation_config.json, sharded safetensors and tokenizer.json."""
    from colibri.config import config_from_dict

    spec.check()
    out.mkdir(parents=True, exist_ok=True)
    raw = hf_config(spec)
    cfg = config_from_dict(raw, source="synth")
    _write_weights(out, cfg, spec, progress)
    eos = write_tokenizer(out / "tokenizer.json", spec.vocab)
    raw["eos_token_id"] = eos
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos, "do_sample": False}, indent=2) + "\n"
    )
    return out


# ---- synth --config: a real model's config.json with random weights ------------------------

# model_types `synthesize_config` writes: colibri's families, but Kimi K2.5, whose sizes sit
# under text_config (`synth --family kimi_k25` writes it).
CONFIG_FAMILIES = tuple(f for f in FAMILIES if f != "kimi_k25")
SIZES = ("layers", "experts", "top_k", "hidden", "moe_ff", "vocab", "heads", "kv_heads")
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_DSA = ("deepseek_v32", "glm_moe_dsa")
_FROM_TORCH = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
# quantization_config fields that describe the layout synth writes, per quant_method
_LAYOUT_KEYS = {
    "fp8": ("quant_method", "fmt", "weight_block_size"),
    "compressed-tensors": ("quant_method", "format", "config_groups", "ignore"),
    "gptq": ("quant_method", "bits", "group_size", "sym", "desc_act", "checkpoint_format"),
    "awq": ("quant_method", "bits", "group_size", "zero_point", "version"),
}


def size_fields(raw: dict) -> dict[str, str]:
    """The config.json field each size override (SynthSpec's names) sets in this config."""
    family = raw.get("model_type")
    experts = next((k for k in _EXPERT_KEYS if k in raw), None)
    if experts is None:
        deepseek = family in ("deepseek_v2", "deepseek_v3", "glm4_moe", "dots1", *_DSA)
        experts = {"mixtral": "num_local_experts", "minimax_m2": "num_local_experts"}.get(
            family, "n_routed_experts" if deepseek else "num_experts"
        )
    return dict(
        layers="num_hidden_layers",
        experts=experts,
        top_k="num_experts_per_tok",
        hidden="hidden_size",
        moe_ff=(
            "intermediate_size"
            if family in ("olmoe", "mixtral", "minimax_m2")
            else "moe_intermediate_size"
        ),
        vocab="vocab_size",
        heads="num_attention_heads",
        kv_heads="num_key_value_heads",
    )


def parse_set(text: str) -> tuple[str, Any]:
    """`KEY=VALUE` of `synth --set`: VALUE read as JSON (32, 1e-5, null, [0, 3], true), else
    as the string it is."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set {text!r}: expected KEY=VALUE (VALUE in JSON: 32, null, [0, 3])")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def read_config(config: dict | str | Path) -> tuple[dict, str]:
    """A config dict and where it came from: a dict, a config.json, or a folder holding one."""
    if isinstance(config, dict):
        return copy.deepcopy(config), "config"
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object of fields")
    return raw, str(path)


def synthesize_config(
    config: dict | str | Path,
    out: Path,
    *,
    sets: Iterable[str] | dict | None = None,
    dtype: str | None = None,
    fp8_block: int | None = None,
    group: int | None = None,
    seed: int = 0,
    shard_mb: float = 512,
    progress: bool = True,
    **sizes: int | None,
) -> Path:
    """Write a random checkpoint shaped by a real model's config.json (a dict, the file or its
    folder): config.json keeps every field of it, with the sizes given (`SIZES`, SynthSpec's
    names; None: the config's) and `sets` ({field: value}, or "KEY=VALUE" texts) in place;
    the weights have exactly the shapes these fields imply. `dtype` (SynthSpec's names) lays
    the weights out; by default as the config's quantization_config says when synth writes
    that layout (else it is dropped, with a warning), unquantized in its torch_dtype otherwise.
    What had to change beyond the overrides (layer lists cut to the layers, token ids beyond
    the vocabulary) is logged as a warning."""
    raw, source = read_config(config)
    new, spec = _plan_config(raw, source, sizes, sets, dtype, fp8_block, group, seed, shard_mb)
    cfg = _shape_config(new, source)
    out.mkdir(parents=True, exist_ok=True)
    _write_weights(out, cfg, spec, progress)
    eos = write_tokenizer(out / "tokenizer.json", spec.vocab)
    for key, value in list(new.items()):  # special ids of the real tokenizer, past the vocab
        if not key.endswith("_token_id") or value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if any(isinstance(i, int) and i >= spec.vocab for i in ids):
            fitted = [i if not isinstance(i, int) or i < spec.vocab else eos for i in ids]
            new[key] = fitted if isinstance(value, list) else fitted[0]
            log.warning(
                "synth: %s=%s is outside vocab_size=%d: %s (the synthetic tokenizer's eos)",
                key, value, spec.vocab, new[key],
            )  # fmt: skip
    (out / "config.json").write_text(json.dumps(new, indent=2) + "\n")
    gen = {k: new[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in new}
    (out / "generation_config.json").write_text(
        json.dumps({**gen, "do_sample": False}, indent=2) + "\n"
    )
    changed = [f"{k}={new.get(k)!r} (was {raw.get(k)!r})" for k in new if new[k] != raw.get(k)]
    log.info("synth: %s with %s", source, ", ".join(changed) or "every field as it was")
    from colibri.config import ConfigError, config_from_dict

    try:
        config_from_dict(new, source=str(out / "config.json"))
    except ConfigError as e:
        log.warning("synth: transformers runs this checkpoint, colibri does not: %s", e)
    return out


def _plan_config(raw, source, sizes, sets, dtype, fp8_block, group, seed, shard_mb):
    """The config.json `synthesize_config` writes (token ids not yet fitted to the vocabulary),
    and the SynthSpec whose dtype, block, group, seed and shard size lay out its weights."""
    family = raw.get("model_type")
    if family not in CONFIG_FAMILIES:
        raise ValueError(
            f"{source}: model_type={family!r}: synth writes {', '.join(CONFIG_FAMILIES)}"
        )
    unknown = set(sizes) - set(SIZES)
    if unknown:
        raise TypeError(f"unknown sizes {sorted(unknown)}: {', '.join(SIZES)}")
    new = copy.deepcopy(raw)
    keys = size_fields(raw)
    given = {k: v for k, v in sizes.items() if v is not None}
    for name, v in given.items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name}={v!r} must be a positive integer")
        new[keys[name]] = v
    heads, kv = raw.get("num_attention_heads"), raw.get("num_key_value_heads")
    if "heads" in given and "kv_heads" not in given and isinstance(heads, int):
        per_kv = heads // kv if isinstance(kv, int) and kv > 0 else 1  # the config's GQA groups
        n = max(1, given["heads"] // per_kv)
        new["num_key_value_heads"] = next(k for k in range(n, 0, -1) if given["heads"] % k == 0)
    for key, value in sets.items() if isinstance(sets, dict) else map(parse_set, sets or ()):
        new[key] = value
    _fit_layers(raw, new)
    _check_sizes(new, keys, source)
    layout = _layout(raw, new, dtype, fp8_block, group, source)
    spec = SynthSpec(vocab=new["vocab_size"], seed=seed, shard_mb=shard_mb, **layout)
    spec.check()
    quant = weight_quantization(spec)
    given_quant = new.pop("quantization_config", None)
    if quant:
        if isinstance(given_quant, dict) and dtype is None:  # honoured: the layout's fields set
            keep = _LAYOUT_KEYS[quant["quant_method"]]
            quant = {**quant, **{k: v for k, v in given_quant.items() if k not in keep}}
            diff = sorted(k for k in given_quant if quant.get(k) != given_quant[k])
            if diff:
                log.warning("synth: quantization_config %s set as synth lays the weights", diff)
        new["quantization_config"] = quant
    dtype_key = "dtype" if "dtype" in new and "torch_dtype" not in new else "torch_dtype"
    new[dtype_key] = _TORCH_DTYPES[spec.dtype]
    return new, spec


def _fit_layers(raw: dict, new: dict) -> None:
    """Layer-indexed fields within a changed num_hidden_layers: mlp_only_layers keeps the
    indices below it, max_window_layers at most it (all of them where it covered all),
    layer_types cut or repeated to its length."""
    was, L = raw.get("num_hidden_layers"), new.get("num_hidden_layers")
    if was == L or not isinstance(L, int):
        return
    only = new.get("mlp_only_layers")
    if isinstance(only, list):
        new["mlp_only_layers"] = [i for i in only if not isinstance(i, int) or i < L]
    window = new.get("max_window_layers")
    if isinstance(window, int):
        new["max_window_layers"] = L if isinstance(was, int) and window >= was else min(window, L)
    types = new.get("layer_types")
    if isinstance(types, list) and types:
        new["layer_types"] = [types[i % len(types)] for i in range(L)]
    for key in ("mlp_layer_types", "indexer_types", "index_topk_pattern"):  # cut, or the last
        got = new.get(key)  # repeated (DeepSeek-V3.2's and GLM-5's per-layer lists)
        if isinstance(got, (list, str)) and got:
            kinds = [got[min(i, len(got) - 1)] for i in range(L)]
            new[key] = "".join(kinds) if isinstance(got, str) else kinds


def _check_sizes(new: dict, keys: dict[str, str], source: str) -> None:
    """What transformers and the tokenizer need of the sizes, said with the flag to give."""
    vocab, experts, top_k = (new.get(keys[k]) for k in ("vocab", "experts", "top_k"))
    if not isinstance(vocab, int) or vocab < 260:
        raise ValueError(f"vocab_size={vocab!r}: at least 260 (256 bytes + specials)")
    if isinstance(experts, int) and isinstance(top_k, int) and top_k > experts:
        raise ValueError(
            f"{source}: num_experts_per_tok={top_k} exceeds {keys['experts']}={experts}"
            " (give --top-k)"
        )
    hidden, heads = new.get("hidden_size"), new.get("num_attention_heads")
    no_head_dim = new.get("head_dim") is None or new.get("model_type") == "deepseek_v2"
    if isinstance(hidden, int) and isinstance(heads, int) and no_head_dim and hidden % heads:
        raise ValueError(
            f"{source}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}"
            " (give --heads)"
        )
    if new.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias=true is not supported (synth writes no MLP biases)")


def _layout(raw: dict, new: dict, dtype, fp8_block, group, source: str) -> dict:
    """SynthSpec's dtype, fp8_block and group for the weights: `dtype` when given, else the
    layout the config's quantization_config names when synth writes it, else the torch_dtype;
    fp8_block and group when given override the config's."""
    quant = new.get("quantization_config")
    layout: dict = {}
    if dtype is not None:
        if quant:
            log.warning("synth: quantization_config of %s replaced: --dtype %s", source, dtype)
        layout = {"dtype": dtype}
    elif quant:
        layout = _quant_layout(quant) or {}
        if not layout:
            log.warning(
                "synth: quantization_config %s of %s is not a layout synth writes: dropped,"
                " the weights are unquantized",
                json.dumps(quant, sort_keys=True)[:200], source,
            )  # fmt: skip
    if not layout:
        torch_dtype = new.get("torch_dtype", new.get("dtype"))
        layout = {"dtype": _FROM_TORCH.get(torch_dtype, "bf16" if torch_dtype else "f32")}
        if torch_dtype and torch_dtype not in _FROM_TORCH:
            log.warning("synth: torch_dtype=%r: the weights are written as bf16", torch_dtype)
    if fp8_block is not None:
        layout["fp8_block"] = fp8_block
    if group is not None:
        layout["group"] = group
    return layout


def _quant_layout(quant: Any) -> dict | None:
    """SynthSpec's dtype, fp8_block and group for a quantization_config, None when synth does
    not write what it describes."""
    if not isinstance(quant, dict):
        return None
    method = quant.get("quant_method")

    def cols(g: Any) -> int | None:  # columns a scale covers, 0 for a whole row
        ok = isinstance(g, int) and not isinstance(g, bool) and (g == -1 or g > 0)
        return (0 if g == -1 else g) if ok else None

    if method == "fp8" and quant.get("fmt", "e4m3") == "e4m3":
        block = quant.get("weight_block_size")
        if isinstance(block, list) and len(block) == 2 and block[0] == block[1]:
            return {"dtype": "fp8", "fp8_block": block[0]} if cols(block[0]) else None
    if method == "compressed-tensors" and quant.get("format") == "pack-quantized":
        groups = list((quant.get("config_groups") or {}).values())
        w = groups[0].get("weights") or {} if len(groups) == 1 else {}
        g = groups[0] if groups else {}
        plain = not (g.get("input_activations") or g.get("output_activations"))
        if plain and w.get("type", "int") == "int" and w.get("symmetric") and not w.get("dynamic"):
            n = cols(w.get("group_size") or -1) if w.get("strategy") == "group" else 0
            if w.get("num_bits") in (4, 8) and w.get("strategy") in ("group", "channel"):
                return {"dtype": f"int{w['num_bits']}", "group": n} if n is not None else None
    if method == "gptq" and quant.get("bits") in (4, 8) and quant.get("sym", True):
        from colibri.config import gptq_format

        plain = not quant.get("desc_act") and not quant.get("dynamic")
        n = cols(quant.get("group_size", 128))
        if plain and gptq_format(quant) == "gptq" and n is not None:
            return {"dtype": f"gptq{quant['bits']}", "group": n}
    if method == "awq" and quant.get("bits", quant.get("w_bit")) == 4:
        n = cols(quant.get("group_size", quant.get("q_group_size", 128)))
        gemm = str(quant.get("version", "gemm")).lower() == "gemm"
        if gemm and quant.get("zero_point", True) and n is not None:
            return {"dtype": "awq4", "group": n}
    return None


def _shape_config(raw: dict, source: str):
    """colibri's reading of `raw`, for the shapes of the tensors only: fields that change no
    shape and that colibri may refuse to run (the activation, rope, a sliding window, the
    quantization, DeepSeek-V2's topk_method) read as colibri's defaults."""
    from colibri.config import config_from_dict

    drop = (
        "quantization_config",
        "rope_scaling",
        "rope_parameters",
        "partial_rotary_factor",
        "rotary_dim",
        "topk_method",
        "layer_types",
    )
    shaped = {k: v for k, v in raw.items() if k not in drop}
    shaped.update(
        hidden_act="silu", use_sliding_window=False, sliding_window=None, rope_theta=10000.0
    )
    return config_from_dict(shaped, source=source)


def _write_weights(out: Path, cfg, spec: SynthSpec, progress: bool) -> None:
    """Random weights of the shapes `cfg` implies, laid out as `spec.dtype` says, in shards."""
    rng = np.random.default_rng(spec.seed)
    writer = _ShardWriter(out, int(spec.shard_mb * 2**20), _DTYPES[spec.dtype])
    for name, shape in tqdm(
        list(_tensor_shapes(cfg)), desc="synth", unit="tensor", disable=not progress, leave=False
    ):
        w = _init(rng, name, shape)
        if spec.dtype == "fp8" and fp8_linear(name):
            bits, scale_inv = quantize_fp8(w, (spec.fp8_block, spec.fp8_block))
            writer.add(name, bits, "F8_E4M3")
            writer.add(f"{name}_scale_inv", scale_inv, "F32")
        elif spec.dtype in _BITS and fp8_linear(name):
            add_packed(writer.add, name, w, _BITS[spec.dtype], spec.group)
        elif spec.dtype in _GPTQ_BITS and fp8_linear(name):
            add_gptq(writer.add, name, w, _GPTQ_BITS[spec.dtype], spec.group)
        elif spec.dtype == "awq4" and fp8_linear(name):
            add_awq(writer.add, name, w, spec.group)
        else:
            writer.add(name, w)
    writer.close()


def _init(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name.endswith("norm.weight") or "layernorm" in name:
        return (1.0 + 0.05 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith("e_score_correction_bias") or name.endswith("norm.bias"):
        return (0.05 * rng.standard_normal(shape)).astype(np.float32)
    fan_in = shape[-1] if len(shape) > 1 else 1
    std = 1.0 / np.sqrt(fan_in)
    return (std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)


def _tensor_shapes(cfg):
    """(name, shape) of every tensor, in the per-expert layout transformers writes."""
    if cfg.family == "kimi_k25":
        yield from _kimi_k25_shapes(cfg)
        return
    D, V = cfg.hidden, cfg.vocab_size
    yield "model.embed_tokens.weight", (V, D)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (D,)
        yield f"{p}.post_attention_layernorm.weight", (D,)
        yield from _attn_shapes(cfg, f"{p}.self_attn")
        if cfg.dsa is not None and not cfg.dsa.shared[i]:
            yield from _indexer_shapes(cfg, f"{p}.self_attn.indexer")
        if cfg.moe_layers[i]:
            yield from _moe_shapes(cfg, i)
        else:
            yield from _mlp_shapes(f"{p}.mlp", D, cfg.dense_ff)
    yield "model.norm.weight", (D,)
    yield "lm_head.weight", (V, D)


def _mlp_shapes(p: str, D: int, F: int, names=("gate_proj", "up_proj", "down_proj")):
    yield f"{p}.{names[0]}.weight", (F, D)
    yield f"{p}.{names[1]}.weight", (F, D)
    yield f"{p}.{names[2]}.weight", (D, F)


def _attn_shapes(cfg, a: str):
    D, H, Hkv, Dh = cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if cfg.attention == "mla":
        m = cfg.mla
        if m.q_lora_rank is None:  # DeepSeek-V2-Lite: one query projection
            yield f"{a}.q_proj.weight", (H * m.qk_head_dim, D)
        else:
            yield f"{a}.q_a_proj.weight", (m.q_lora_rank, D)
            if cfg.qkv_bias:
                yield f"{a}.q_a_proj.bias", (m.q_lora_rank,)
            yield f"{a}.q_a_layernorm.weight", (m.q_lora_rank,)
            yield f"{a}.q_b_proj.weight", (H * m.qk_head_dim, m.q_lora_rank)
        yield f"{a}.kv_a_proj_with_mqa.weight", (m.kv_lora_rank + m.qk_rope_head_dim, D)
        if cfg.qkv_bias:
            yield f"{a}.kv_a_proj_with_mqa.bias", (m.kv_lora_rank + m.qk_rope_head_dim,)
        yield f"{a}.kv_a_layernorm.weight", (m.kv_lora_rank,)
        yield f"{a}.kv_b_proj.weight", (H * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
        yield f"{a}.o_proj.weight", (D, H * m.v_head_dim)
        if cfg.o_bias:
            yield f"{a}.o_proj.bias", (D,)
        return
    for n, rows in (("q", H * Dh), ("k", Hkv * Dh), ("v", Hkv * Dh)):
        yield f"{a}.{n}_proj.weight", (rows, D)
        if cfg.qkv_bias:
            yield f"{a}.{n}_proj.bias", (rows,)
    yield f"{a}.o_proj.weight", (D, H * Dh)
    if cfg.o_bias:
        yield f"{a}.o_proj.bias", (D,)
    if cfg.qk_norm == "head":
        yield f"{a}.q_norm.weight", (Dh,)
        yield f"{a}.k_norm.weight", (Dh,)
    elif cfg.qk_norm == "full":
        yield f"{a}.q_norm.weight", (H * Dh,)
        yield f"{a}.k_norm.weight", (Hkv * Dh,)


def _indexer_shapes(cfg, a: str):
    """DSA's lightning indexer (`weights._load_indexer`)."""
    d = cfg.dsa
    yield f"{a}.wq_b.weight", (d.n_heads * d.head_dim, cfg.mla.q_lora_rank)
    yield f"{a}.wk.weight", (d.head_dim, cfg.hidden)
    yield f"{a}.k_norm.weight", (d.head_dim,)
    yield f"{a}.k_norm.bias", (d.head_dim,)
    yield f"{a}.weights_proj.weight", (d.n_heads, cfg.hidden)


def _moe_shapes(cfg, i: int):
    from colibri.weights import expert_names, moe_prefix, score_bias_name

    m, D = cfg.moe, cfg.hidden
    p = moe_prefix(cfg, i)
    yield f"{p}.gate.weight", (m.num_experts, D)
    if m.router == "sigmoid_group":  # DeepSeek-V2 (softmax) has no score-correction bias
        yield score_bias_name(cfg, i), (m.num_experts,)
    names = expert_names(cfg)
    for e in range(m.num_experts):
        yield from _mlp_shapes(f"{p}.experts.{e}", D, m.moe_ff, names)
    if cfg.family == "qwen2_moe":
        yield from _mlp_shapes(f"{p}.shared_expert", D, m.shared_ff)
        yield f"{p}.shared_expert_gate.weight", (1, D)
    elif m.shared_ff:
        yield from _mlp_shapes(f"{p}.shared_experts", D, m.shared_ff)


def _kimi_k25_shapes(cfg):
    """Kimi K2.5's tensors as its release names them: DeepSeek-V3's under language_model.,
    then KIMI_VISION's vision tower and projector as transformers saves them."""
    for name, shape in _tensor_shapes(replace(cfg, family="deepseek_v3")):
        yield f"language_model.{name}", shape
    v = KIMI_VISION
    h, f, p = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    merged = h * v["merge_kernel_size"][0] * v["merge_kernel_size"][1]

    def linear(name, rows, cols):
        yield f"{name}.weight", (rows, cols)
        yield f"{name}.bias", (rows,)

    def norm(name, n):
        yield f"{name}.weight", (n,)
        yield f"{name}.bias", (n,)

    t = "vision_tower.encoder"
    yield f"{t}.patch_embed.proj.weight", (h, 3, p, p)
    yield f"{t}.patch_embed.proj.bias", (h,)
    yield "vision_tower.patch_embed.pos_emb.weight", (v["pos_emb_height"], v["pos_emb_width"], h)
    for b in range(v["num_hidden_layers"]):
        yield from norm(f"{t}.blocks.{b}.norm0", h)
        yield from norm(f"{t}.blocks.{b}.norm1", h)
        yield from linear(f"{t}.blocks.{b}.wqkv", 3 * h, h)
        yield from linear(f"{t}.blocks.{b}.wo", h, h)
        yield from linear(f"{t}.blocks.{b}.mlp.fc0", f, h)
        yield from linear(f"{t}.blocks.{b}.mlp.fc1", h, f)
    yield from norm(f"{t}.final_layernorm", h)
    yield from norm("model.mm_projector.pre_norm", h)
    yield from linear("mm_projector.proj.0", merged, merged)
    yield from linear("mm_projector.proj.2", cfg.hidden, merged)


class _ShardWriter:
    """Accumulates tensors and writes `model-0000i-of-0000n.safetensors` plus the index."""

    def __init__(self, out: Path, shard_bytes: int, dtype: str):
        self.out, self.shard_bytes, self.dtype = out, shard_bytes, dtype
        self.pending: dict[str, np.ndarray] = {}
        self.kinds: dict[str, str] = {}  # tensors not written as `dtype`
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.files: list[Path] = []

    def add(self, name: str, arr: np.ndarray, dtype: str | None = None) -> None:
        kind = dtype or self.dtype
        size = arr.size * {"F32": 4, "F8_E4M3": 1, "I32": 4, "I64": 8}.get(kind, 2)
        if self.pending and self.pending_bytes + size > self.shard_bytes:
            self._flush()
        self.pending[name] = arr
        if dtype:
            self.kinds[name] = dtype
        self.pending_bytes += size

    def _flush(self) -> None:
        path = self.out / f"shard-{len(self.files):05d}.safetensors"
        write_safetensors(path, self.pending, self.dtype, self.kinds)
        self.files.append(path)
        self.shards.append(list(self.pending))
        self.pending, self.kinds, self.pending_bytes = {}, {}, 0

    def close(self) -> None:
        if self.pending:
            self._flush()
        n = len(self.files)
        weight_map = {}
        for k, (path, names) in enumerate(zip(self.files, self.shards, strict=True)):
            final = self.out / f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            path.rename(final)
            weight_map.update({name: final.name for name in names})
        if n == 1:
            (self.out / f"model-00001-of-{n:05d}.safetensors").rename(
                self.out / "model.safetensors"
            )
            return
        index = {"metadata": {}, "weight_map": weight_map}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")


_TEXT = (
    "def forward(x, params):\n    return x @ params['w'] + params['b']\n",
    "The router sends every token to a few experts; the rest stay cold on disk. ",
    "Die Experten liegen im Speicher, im Arbeitsspeicher oder auf der Platte. ",
    "Les experts sont chargés à la demande depuis le disque. ",
    "#include <stdio.h>\nint main(void) { return 0; }\n",
)


def write_tokenizer(path: Path, vocab: int, text: list[str] | None = None) -> int:
    """Byte-level BPE of at most `vocab` ids trained on `text` (default: a fixed text, so always
    the same tokenizer); eos `<|endoftext|>` is added last. Returns the eos id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = text if text is not None else list(_TEXT) * 10
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - 1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text, trainer)
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path))
    return int(tok.token_to_id("<|endoftext|>"))
