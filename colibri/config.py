"""Model configuration read from a Hugging Face `config.json`, normalised across MoE families."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


class ConfigError(ValueError):
    """A config.json that colibri cannot run, with the field and value that are wrong."""


FAMILIES = (
    "qwen3_moe",
    "qwen2_moe",
    "olmoe",
    "mixtral",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe",
    "dots1",
    "minimax_m2",
    "deepseek_v32",
    "glm_moe_dsa",
    "kimi_k25",
)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: frequencies of the rotated part of each head, and their layout."""

    inv_freq: tuple[float, ...]  # [R/2] rotation frequencies, R = rotated dims per head
    attention_scaling: float = 1.0  # cos/sin multiplier (YaRN), 1.0 otherwise
    interleave: bool = False  # DeepSeek layout: rotated pairs are (x0, x1), (x2, x3), ...

    @property
    def rotary_dim(self) -> int:
        return 2 * len(self.inv_freq)


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention sizes (DeepSeek-V2, -V3): K/V are cached as one compressed
    latent."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class DsaConfig:
    """DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): a lightning indexer per layer scores
    every cached position for each query, and the query attends only to its `topk` best
    (`indexer.select`)."""

    n_heads: int
    head_dim: int
    topk: int
    interleave: bool  # the indexer's rope layout: GLM-5 rotates pairs, DeepSeek-V3.2 halves
    shared: tuple[bool, ...]  # [L] True where a layer reuses the previous layer's selection


@dataclass(frozen=True)
class MoeConfig:
    """Routed experts and the routing rule of the sparse layers."""

    num_experts: int
    top_k: int
    moe_ff: int  # F of one routed expert
    # "softmax" (Qwen, OLMoE, Mixtral), "softmax_group" (DeepSeek-V2: softmax, top groups by
    # their best expert, scaled weights) or "sigmoid_group" (DeepSeek-V3, GLM-4.5, dots1;
    # MiniMax-M2 as one group)
    router: str
    norm_topk_prob: bool
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_ff: int = 0  # F of the shared expert(s), 0 when there is none
    shared_gate: bool = False  # Qwen2-MoE scales the shared expert by sigmoid(x @ w)


@dataclass(frozen=True)
class ModelConfig:
    """Everything the pure JAX model needs to know about one checkpoint's architecture."""

    family: str
    vocab_size: int
    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dense_ff: int  # F of the dense MLP layers (first_k_dense_replace, mlp_only_layers)
    rms_eps: float
    rope: RopeConfig
    moe: MoeConfig
    moe_layers: tuple[bool, ...]  # [L] True where the MLP is a routed MoE block
    attention: str = "gqa"  # "gqa" or "mla"
    mla: MlaConfig | None = None
    dsa: DsaConfig | None = None  # MLA with a lightning indexer (attention stays "mla")
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str = (
        "none"  # "none", "head" (per head: Qwen3, GLM, dots1) or "full" (whole projection:
        # OLMoE, MiniMax-M2)
    )
    clip_qkv: float | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, m in enumerate(self.moe_layers) if m)

    @property
    def attn_scale(self) -> float:
        if self.attention == "mla":
            assert self.mla is not None
            return _mla_scale(self.mla.qk_head_dim, self.raw)
        return self.head_dim**-0.5


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read `config.json` (and `generation_config.json` for eos) from a checkpoint folder."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no config.json in the model folder") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    gen = Path(model_dir) / "generation_config.json"
    try:
        gen_raw = json.loads(gen.read_text()) if gen.exists() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{gen}: not valid JSON ({e})") from None
    if not isinstance(gen_raw, dict):
        raise ConfigError(f"{gen}: expected a JSON object of fields, not {_kind(gen_raw)}")
    if isinstance(raw, dict) and "quantization_config" not in raw and not _quantization(raw):
        quant = quantization_config(model_dir)
        if quant:  # AutoGPTQ's quantize_config.json
            raw = {**raw, "quantization_config": quant}
            path = path.parent / "quantize_config.json"
    return config_from_dict(raw, gen_raw, source=str(path))


def quantization_config(model_dir: str | Path) -> dict:
    """config.json's `quantization_config` (`_quantization`), else AutoGPTQ's
    `quantize_config.json` beside it (older GPTQ releases carry only that), else {}."""
    for name, key in (("config.json", "quantization_config"), ("quantize_config.json", None)):
        try:
            raw = json.loads((Path(model_dir) / name).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        quant = _quantization(raw) if key and isinstance(raw, dict) else raw
        if isinstance(quant, dict):
            return quant if key else {"quant_method": "gptq", **quant}
    return {}


def _quantization(raw: dict[str, Any]) -> Any:
    """A config's quantization_config, else its text_config's: transformers looks there too
    (Kimi K2.5 nests it with the language model's fields)."""
    text = raw.get("text_config")
    nested = text.get("quantization_config") if isinstance(text, dict) else None
    return raw.get("quantization_config") or nested


def config_from_dict(
    raw: dict[str, Any], gen: dict[str, Any] | None = None, source: str = "config.json"
) -> ModelConfig:
    """Normalise one Hugging Face config dict into a `ModelConfig`."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object of fields, not {_kind(raw)}")
    try:
        return _config_from_dict(raw, gen or {}, source)
    except ConfigError:
        raise
    except (TypeError, ValueError, KeyError, ZeroDivisionError, OverflowError) as e:
        # a field the typed reader does not cover yet (rope parameters): still one line
        raise ConfigError(f"{source}: unreadable field ({type(e).__name__}: {e})") from None


def _config_from_dict(raw: dict[str, Any], gen: dict[str, Any], source: str) -> ModelConfig:
    family = raw.get("model_type")
    if family not in FAMILIES:
        raise ConfigError(
            f"{source}: model_type={family!r} is not supported (supported: {', '.join(FAMILIES)})"
        )
    fields = source
    if family in TEXT_CONFIGS:  # a multimodal wrapper: colibri runs its language model
        raw, fields = _text_config(raw, source), f"{source} text_config"
    c = _Fields(raw, fields)
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{source}: hidden_act={act!r} is not supported (only 'silu')")
    if raw.get("use_sliding_window"):
        raise ConfigError(f"{source}: use_sliding_window=True is not supported")
    _check_quantization(raw.get("quantization_config"), source)
    builder = {
        "qwen3_moe": _qwen_like,
        "qwen2_moe": _qwen_like,
        "olmoe": _qwen_like,
        "mixtral": _mixtral,
        "deepseek_v2": _deepseek_like,
        "deepseek_v3": _deepseek_like,
        "glm4_moe": _deepseek_like,
        "dots1": _deepseek_like,
        "minimax_m2": _minimax_m2,
        "deepseek_v32": _deepseek_like,
        "glm_moe_dsa": _deepseek_like,
        "kimi_k25": _kimi_k25,
    }[family]
    heads = c.int("num_attention_heads")
    common = dict(
        family=family,
        vocab_size=c.int("vocab_size"),
        hidden=c.int("hidden_size"),
        num_layers=c.int("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=c.opt_int("num_key_value_heads", heads, null=True),
        head_dim=c.head_dim(),
        rms_eps=c.number("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=c.opt_int("max_position_embeddings", 4096),
        bos_token_id=c.opt_int("bos_token_id", None, lo=0, null=True),
        eos_token_ids=_eos_ids(c, _Fields(gen, _beside(source, "generation_config.json"))),
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        raw=raw,
    )
    common.update(builder(c, family))
    cfg = ModelConfig(**common)
    _validate(cfg, source)
    return cfg


def _check_quantization(quant: Any, source: str) -> None:
    """Block-quantized FP8 weights (DeepSeek-V3's and Qwen3's "-FP8" checkpoints),
    compressed-tensors' pack-quantized integer weights (W4A16, W8A16), GPTQ's (Qwen's
    "-GPTQ-Int4" releases) and AWQ's are read (checkpoint.Fp8Scales, GroupScales); other
    quantization formats are refused."""
    if quant is None:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method == "compressed-tensors":
        return _check_compressed_tensors(quant, source)
    if method == "gptq":
        return _check_gptq(quant, source)
    if method == "awq":
        return _check_awq(quant, source)
    fmt = quant.get("fmt", "e4m3") if isinstance(quant, dict) else None
    block = quant.get("weight_block_size", [128, 128]) if isinstance(quant, dict) else None
    if method != "fp8" or fmt != "e4m3":
        raise ConfigError(
            f"{source}: quantization_config quant_method={method!r} fmt={fmt!r} is not supported"
            " (colibri reads block-quantized fp8 e4m3 checkpoints, and unquantized ones)"
        )
    ok = isinstance(block, list) and len(block) == 2
    if not ok or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        raise ConfigError(
            f"{source}: quantization_config weight_block_size={block!r} must be two positive"
            " integers"
        )


def _check_compressed_tensors(quant: dict, source: str) -> None:
    """compressed-tensors' weight-only integer schemes in the pack-quantized format: weights
    of 4 or 8 bits, symmetric (no zero points), a scale per group of columns or per row;
    activations, the KV cache and rotations left unquantized."""

    def refuse(what: str) -> None:
        raise ConfigError(
            f"{source}: quantization_config (compressed-tensors) {what} is not supported (colibri"
            " reads pack-quantized symmetric int4/int8 weights with group or channel scales)"
        )

    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        refuse("without config_groups")
    for key in ("kv_cache_scheme", "transform_config"):
        if quant.get(key):
            refuse(f"{key}={quant[key]!r}")
    for name, scheme in groups.items():
        scheme = scheme if isinstance(scheme, dict) else {}
        fmt = scheme.get("format") or quant.get("format")
        if fmt != "pack-quantized":
            refuse(f"{name}: format={fmt!r}")
        for acts in ("input_activations", "output_activations"):
            if scheme.get(acts):
                refuse(f"{name}: {acts} (activation quantization)")
        w = scheme.get("weights")
        if not isinstance(w, dict):
            refuse(f"{name}: weights={w!r}")
        if w.get("type", "int") != "int" or w.get("num_bits") not in (4, 8):
            refuse(f"{name}: weights type={w.get('type')!r} num_bits={w.get('num_bits')!r}")
        if not w.get("symmetric", True):
            refuse(f"{name}: asymmetric weights (zero points)")
        if w.get("strategy") not in ("group", "channel") or w.get("dynamic"):
            refuse(f"{name}: weights strategy={w.get('strategy')!r} dynamic={w.get('dynamic')!r}")


def _check_gptq(quant: dict, source: str) -> None:
    """GPTQ's weight-only integers in its own layouts ("gptq" and "gptq_v2"): 4 or 8 bits
    packed into int32 words, a scale and a zero point per group of input columns (or per
    row), in any column order (desc_act's g_idx); the same settings for every layer."""

    def refuse(what: str) -> None:
        raise ConfigError(
            f"{source}: quantization_config (gptq) {what} is not supported (colibri reads 4- and"
            " 8-bit GPTQ weights in the 'gptq' and 'gptq_v2' layouts, packed into int32)"
        )

    fmt = gptq_format(quant)
    if quant.get("is_marlin_format"):
        refuse("is_marlin_format=True (Marlin's repacked layout)")
    if fmt not in ("gptq", "gptq_v2"):
        refuse(f"checkpoint_format={fmt!r}")
    if quant.get("bits") not in (4, 8):
        refuse(f"bits={quant.get('bits')!r}")
    if quant.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        refuse(f"pack_dtype={quant.get('pack_dtype')!r}")
    if quant.get("dynamic"):
        refuse("dynamic (per-module bits and groups)")
    group = quant.get("group_size", 128)
    if not _group_size(group):
        refuse(f"group_size={group!r}")


def _check_awq(quant: dict, source: str) -> None:
    """AutoAWQ's GEMM layout: 4-bit weights with a scale and a zero point per group of input
    columns, packed eight outputs to an int32 word."""

    def refuse(what: str) -> None:
        raise ConfigError(
            f"{source}: quantization_config (awq) {what} is not supported (colibri reads 4-bit"
            " AWQ weights with zero points in the GEMM layout)"
        )

    version = str(quant.get("version", "gemm")).lower()
    if version != "gemm":
        refuse(f"version={quant.get('version')!r}")
    bits = quant.get("bits", quant.get("w_bit"))
    if bits != 4:
        refuse(f"bits={bits!r}")
    if not quant.get("zero_point", True):
        refuse("zero_point=False")
    group = quant.get("group_size", quant.get("q_group_size", 128))
    if not _group_size(group):
        refuse(f"group_size={group!r}")


def _group_size(group: Any) -> bool:
    """A GPTQ/AWQ group size: columns a scale covers, or -1 for a whole row."""
    return isinstance(group, int) and not isinstance(group, bool) and (group == -1 or group > 0)


def gptq_format(quant: dict) -> str:
    """The layout a GPTQ config names: "gptq" (the original, zero points stored less one)
    unless its checkpoint_format (GPTQModel: format) says otherwise."""
    return quant.get("checkpoint_format") or quant.get("format") or "gptq"


_REQUIRED: Any = object()


def _kind(v: Any) -> str:
    """How a JSON value that is not what was expected reads in an error: "a list", "null"."""
    if v is None:
        return "null"
    name = {list: "list", str: "string", bool: "boolean", dict: "object"}.get(type(v), "number")
    return f"a {name}" if name != "object" else "an object"


def _beside(source: str, name: str) -> str:
    """The file `name` in the folder of `source` (a path, or a label such as "synth")."""
    path = Path(source)
    return str(path.with_name(name)) if path.name.endswith(".json") else f"{source} {name}"


class _Fields:
    """Typed access to config fields: each value is checked where it is read, and an error
    names the file, the field and the value. Absent fields take their default (and null
    ones too where `null=True`: Hugging Face's "unset", e.g. head_dim or num_key_value_heads
    of None)."""

    def __init__(self, raw: dict[str, Any], source: str):
        self.raw, self.source = raw, source

    def fail(self, key: str, want: str) -> ConfigError:
        return ConfigError(f"{self.source}: {key}={self.raw.get(key)!r} must be {want}")

    def _absent(self, key: str, default: Any, null: bool) -> bool:
        """Whether `key` takes its default (never for a required field: it is checked)."""
        unset = key not in self.raw or (null and self.raw[key] is None)
        return unset and default is not _REQUIRED

    def int(self, key: str) -> int:
        """A required positive integer."""
        return self.opt_int(key)

    def opt_int(self, key: str, default: Any = _REQUIRED, lo: int = 1, null: bool = False) -> Any:
        """An integer >= lo, `default` when absent."""
        if self._absent(key, default, null):
            return default
        v = self.raw.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            want = "a positive integer" if lo == 1 else f"an integer >= {lo}"
            raise self.fail(key, want)
        return v

    def number(self, key: str, default: Any = _REQUIRED, null: bool = False) -> Any:
        """A finite positive number (as a float), `default` when absent."""
        if self._absent(key, default, null):
            return default
        v = self.raw.get(key)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        if not ok or not math.isfinite(v) or v <= 0:
            raise self.fail(key, "a positive number")
        return float(v)

    def choice(self, key: str, options: tuple[str, ...], default: Any = _REQUIRED) -> Any:
        """One of `options` (strings), `default` when absent."""
        if self._absent(key, default, False):
            return default
        v = self.raw.get(key)
        if v not in options:
            raise self.fail(key, "one of " + ", ".join(repr(o) for o in options))
        return v

    def indices(self, key: str) -> tuple[int, ...]:
        """A list of non-negative integers (layer indices); () when absent or null."""
        v = self.raw.get(key)
        if v is None:
            return ()
        ok = isinstance(v, list) and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v
        )
        if not ok:
            raise self.fail(key, "a list of layer indices (integers >= 0)")
        return tuple(v)

    def head_dim(self) -> int:
        """head_dim, else hidden_size / num_attention_heads."""
        default = self.int("hidden_size") // self.int("num_attention_heads")
        if default == 0 and self.raw.get("head_dim") is None:
            raise ConfigError(
                f"{self.source}: hidden_size={self.raw['hidden_size']} is smaller than"
                f" num_attention_heads={self.raw['num_attention_heads']} and no head_dim is given"
            )
        return self.opt_int("head_dim", default, null=True)


# rope_theta where a config gives none: transformers' default_theta of the family, else 10000
_DEFAULT_THETA = {"mixtral": 1e6, "minimax_m2": 5e6}


def _rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    """rope_parameters (transformers 5) or rope_theta + rope_scaling (older configs)."""
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    theta = _DEFAULT_THETA.get(raw.get("model_type"), 10000.0)
    params.setdefault("rope_theta", raw.get("rope_theta", theta))
    if "partial_rotary_factor" in raw:
        params.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def _rope(c: _Fields, dim: int, interleave: bool = False) -> RopeConfig:
    """Inverse frequencies for `dim` rotated dims, following transformers' rope initialisers."""
    raw = c.raw
    p = _rope_params(raw)
    rope = _Fields(p, c.source)  # rope_theta, factor: top level or in rope_parameters
    base = rope.number("rope_theta")
    kind = p["rope_type"]
    inv = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    scaling = 1.0
    if kind == "linear":
        inv = inv / np.float32(rope.number("factor"))
    elif kind == "yarn":
        inv, scaling = _yarn(p, dim, base, raw)
    elif kind != "default":
        raise ConfigError(
            f"{c.source}: rope_type={kind!r} is not supported (default, linear, yarn)"
        )
    return RopeConfig(tuple(float(x) for x in inv.astype(np.float32)), float(scaling), interleave)


def _partial_rotary(c: _Fields, default: float) -> float:
    """The part of each head that is rotated: partial_rotary_factor (top level or in the rope
    parameters), in (0, 1]."""
    rope = _Fields(_rope_params(c.raw), c.source)
    partial = rope.number("partial_rotary_factor", default)
    if partial > 1:
        raise rope.fail("partial_rotary_factor", "in (0, 1]")
    return partial


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(p: dict[str, Any], dim: int, base: float, raw: dict[str, Any]) -> tuple[Any, float]:
    """YaRN frequencies and attention factor (transformers' `_compute_yarn_parameters`)."""
    orig = p.get("original_max_position_embeddings") or raw.get("max_position_embeddings")
    factor = p.get("factor") or raw["max_position_embeddings"] / orig
    attn = p.get("attention_factor")
    mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
    if attn is None:
        if mscale and mscale_all:
            attn = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attn = _yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    pos = base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extra_w = 1 - ramp
    inv = (1.0 / (factor * pos)) * (1 - extra_w) + (1.0 / pos) * extra_w
    return inv.astype(np.float32), float(attn)


def _mla_scale(qk_head_dim: int, raw: dict[str, Any]) -> float:
    """DeepSeek softmax scale, with YaRN's mscale_all_dim correction when rope is scaled."""
    scale = qk_head_dim**-0.5
    p = _rope_params(raw)
    if p["rope_type"] != "default" and p.get("mscale_all_dim"):
        m = _yarn_mscale(p["factor"], p["mscale_all_dim"])
        scale = scale * m * m
    return scale


def _qwen_like(c: _Fields, family: str) -> dict[str, Any]:
    """Qwen3-MoE, Qwen2-MoE and OLMoE: GQA, softmax top-k routing."""
    raw = c.raw
    rope = _rope(c, int(c.head_dim() * _partial_rotary(c, 1.0)))
    L = c.int("num_hidden_layers")
    if family == "olmoe":
        moe_layers = tuple(True for _ in range(L))
    else:
        step = c.opt_int("decoder_sparse_step", 1)
        only = set(c.indices("mlp_only_layers"))
        moe_layers = tuple((i not in only) and (i + 1) % step == 0 for i in range(L))
    shared_ff = 0
    if family == "qwen2_moe":
        shared_ff = c.opt_int("shared_expert_intermediate_size", 0, lo=0, null=True)
    moe = MoeConfig(
        num_experts=c.int("num_experts" if "num_experts" in raw else "num_local_experts"),
        top_k=c.int("num_experts_per_tok"),
        moe_ff=c.int("moe_intermediate_size") if family != "olmoe" else c.int("intermediate_size"),
        router="softmax",
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        shared_ff=shared_ff,
        shared_gate=shared_ff > 0,
    )
    qk_norm = {"qwen3_moe": "head", "olmoe": "full", "qwen2_moe": "none"}[family]
    bias = raw.get("qkv_bias", True) if family == "qwen2_moe" else raw.get("attention_bias", False)
    return dict(
        rope=rope,
        moe=moe,
        moe_layers=moe_layers,
        dense_ff=c.opt_int("intermediate_size", 0, lo=0, null=True),
        qk_norm=qk_norm,
        qkv_bias=bool(bias),
        o_bias=bool(raw.get("attention_bias", False)) and family != "qwen2_moe",
        clip_qkv=c.number("clip_qkv", None, null=True) if family == "olmoe" else None,
    )


def _mixtral(c: _Fields, family: str) -> dict[str, Any]:
    """Mixtral: GQA, softmax top-k routing always renormalised, experts as w1/w2/w3."""
    moe = MoeConfig(
        num_experts=c.int("num_local_experts"),
        top_k=c.int("num_experts_per_tok"),
        moe_ff=c.int("intermediate_size"),
        router="softmax",
        norm_topk_prob=True,
    )
    L = c.int("num_hidden_layers")
    return dict(
        rope=_rope(c, c.head_dim()),
        moe=moe,
        moe_layers=tuple(True for _ in range(L)),
        dense_ff=c.int("intermediate_size"),
    )


def _deepseek_like(c: _Fields, family: str) -> dict[str, Any]:
    """DeepSeek-V3 (MLA), GLM-4.5 (GQA, partial rotary) and dots1 (Qwen3's attention): grouped
    sigmoid routing. DeepSeek-V2 (MLA): softmax routing (`_deepseek_v2_routing`).
    DeepSeek-V3.2 and GLM-5: DeepSeek-V3's MLA and routing with a lightning indexer (`_dsa`)."""
    if family in _DSA_DEFAULTS:  # transformers' defaults for the fields a config may leave out
        c = _Fields({**_DSA_DEFAULTS[family], **c.raw}, c.source)
    raw = c.raw
    experts_key = "n_routed_experts" if raw.get("n_routed_experts") else "num_local_experts"
    routing = dict(
        router="sigmoid_group",
        # dots1 renormalises the top-k weights only when asked: its default is False
        norm_topk_prob=bool(raw.get("norm_topk_prob", family != "dots1")),
        n_group=c.opt_int("n_group", 1, null=True),
        topk_group=c.opt_int("topk_group", 1, null=True),
    )
    if family == "deepseek_v2":
        routing = _deepseek_v2_routing(c)
    moe = MoeConfig(
        num_experts=c.opt_int(experts_key, 0, lo=0, null=True),
        top_k=c.int("num_experts_per_tok"),
        moe_ff=c.int("moe_intermediate_size"),
        routed_scaling_factor=c.number("routed_scaling_factor", 1.0),
        shared_ff=c.int("moe_intermediate_size") * c.opt_int("n_shared_experts", 0, 0, null=True),
        **routing,
    )
    L = c.int("num_hidden_layers")
    first_dense = c.opt_int("first_k_dense_replace", 0, lo=0, null=True)
    moe_layers = tuple(i >= first_dense for i in range(L))
    if family in _DSA_DEFAULTS and raw.get("mlp_layer_types") is not None:
        moe_layers = _mlp_layer_types(c, L)
    out: dict[str, Any] = dict(
        moe=moe,
        moe_layers=moe_layers,
        dense_ff=c.int("intermediate_size"),
        qkv_bias=bool(raw.get("attention_bias", False)),
    )
    if family in ("deepseek_v2", "deepseek_v3", *_DSA_DEFAULTS):
        mla = MlaConfig(
            q_lora_rank=c.opt_int("q_lora_rank", None, null=True),
            kv_lora_rank=c.int("kv_lora_rank"),
            qk_nope_head_dim=c.int("qk_nope_head_dim"),
            qk_rope_head_dim=c.int("qk_rope_head_dim"),
            v_head_dim=c.int("v_head_dim"),
        )
        # DeepSeek-V2 always rotates interleaved pairs (transformers reads no rope_interleave),
        # and so do DeepSeek-V3.2 and GLM-5 in their MLA
        fixed = family == "deepseek_v2" or family in _DSA_DEFAULTS
        interleave = fixed or bool(raw.get("rope_interleave", True))
        out.update(
            attention="mla",
            mla=mla,
            rope=_rope(c, mla.qk_rope_head_dim, interleave),
            o_bias=bool(raw.get("attention_bias", False)),
        )
        if family in _DSA_DEFAULTS:
            out["dsa"] = _dsa(c, family, mla)
    elif family == "dots1":  # q/k RMSNorm per head, every dim rotated, biases on all four
        _full_attention_only(c)
        out.update(
            rope=_rope(c, c.head_dim()),
            qk_norm="head",
            o_bias=bool(raw.get("attention_bias", False)),
        )
    else:
        out.update(
            rope=_rope(c, int(c.head_dim() * _partial_rotary(c, 0.5))),
            qk_norm="head" if raw.get("use_qk_norm") else "none",
        )
    return out


# transformers' values of the fields a DeepSeek-V3.2 or GLM-5 config may leave out, where they
# differ from what colibri assumes of the other DeepSeek-like families
_DSA_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v32": dict(
        n_group=8,
        topk_group=4,
        first_k_dense_replace=3,
        routed_scaling_factor=2.5,
        n_shared_experts=1,
        index_topk=2048,
        index_head_dim=128,
        index_n_heads=64,
    ),
    "glm_moe_dsa": dict(
        n_group=1,
        topk_group=1,
        first_k_dense_replace=3,
        routed_scaling_factor=2.5,
        n_shared_experts=1,
        index_topk=2048,
        index_head_dim=128,
        index_n_heads=32,
    ),
}


def _mlp_layer_types(c: _Fields, L: int) -> tuple[bool, ...]:
    """mlp_layer_types ("dense" or "sparse" per layer; DeepSeek-V3.2, GLM-5) as moe_layers."""
    types = c.raw["mlp_layer_types"]
    ok = isinstance(types, list) and len(types) == L
    if not ok or not all(t in ("dense", "sparse") for t in types):
        raise c.fail("mlp_layer_types", f"a list of {L} 'dense' or 'sparse'")
    return tuple(t == "sparse" for t in types)


def _dsa(c: _Fields, family: str, mla: MlaConfig) -> DsaConfig:
    """The lightning indexer as transformers builds it. GLM-5's layers marked "shared" in
    indexer_types run no indexer and reuse the previous layer's selection; without
    indexer_types, index_topk_pattern ("F" full, "S" shared) says which, else every
    index_topk_freq-th layer from index_skip_topk_offset on runs its own (by default all do).
    DeepSeek-V3.2 runs one in every layer."""
    L = c.int("num_hidden_layers")
    types: Any = ["full"] * L
    if family == "glm_moe_dsa":
        types = c.raw.get("indexer_types")
        pattern = c.raw.get("index_topk_pattern")
        if types is None and isinstance(pattern, str):
            letters = {"F": "full", "S": "shared"}
            types = [letters.get(ch, ch) for ch in pattern]
        elif types is None and pattern is not None:
            types = pattern
        elif types is None:
            freq = max(c.opt_int("index_topk_freq", 1, lo=0), 1)
            offset = c.opt_int("index_skip_topk_offset", 2, lo=0)
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(L)]
    ok = isinstance(types, list) and len(types) == L and all(t in ("full", "shared") for t in types)
    if not ok:
        key = "indexer_types" if "indexer_types" in c.raw else "index_topk_pattern"
        raise c.fail(key, f"{L} layers, each 'full' or 'shared' ('F' or 'S')")
    if types[0] == "shared":
        raise c.fail("indexer_types", "'full' at layer 0 (a shared layer reuses an earlier one)")
    dsa = DsaConfig(
        n_heads=c.int("index_n_heads"),
        head_dim=c.int("index_head_dim"),
        topk=c.int("index_topk"),
        interleave=family == "glm_moe_dsa",  # DeepSeek-V3.2's indexer rotates halves
        shared=tuple(t == "shared" for t in types),
    )
    if mla.qk_rope_head_dim > dsa.head_dim:
        raise c.fail("index_head_dim", f"at least qk_rope_head_dim={mla.qk_rope_head_dim}")
    if mla.q_lora_rank is None:  # the indexer's queries start from the query LoRA's latent
        raise c.fail("q_lora_rank", "set (the indexer projects the query latent)")
    return dsa


def _full_attention_only(c: _Fields) -> None:
    """dots1's layers from max_window_layers on attend through a sliding window
    (transformers' layer_types, derived from sliding_window and max_window_layers when not
    given): refused, as colibri attends to every cached position."""
    types = c.raw.get("layer_types")
    if types is None:
        first = c.opt_int("max_window_layers", 62, lo=0)
        window = c.raw.get("sliding_window", 4096)
        L = c.int("num_hidden_layers")
        slides = [window is not None and i >= first for i in range(L)]
        types = ["sliding_attention" if s else "full_attention" for s in slides]
    if not isinstance(types, list):
        raise c.fail("layer_types", "a list of layer types")
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if sliding:
        raise ConfigError(
            f"{c.source}: layers {sliding} attend through a sliding window"
            f" (sliding_window={c.raw.get('sliding_window', 4096)!r}), which is not supported"
        )


def _minimax_m2(c: _Fields, family: str) -> dict[str, Any]:
    """MiniMax-M2: GQA with q/k RMSNorm over all heads together and the first rotary_dim dims
    of each head rotated; sigmoid routing steered by a score-correction bias, top-k
    renormalised (DeepSeek-V3's rule with one group, unscaled); experts named as Mixtral's."""
    head_dim = c.opt_int("head_dim", 128)  # transformers' default, not hidden / heads
    rotary = c.opt_int("rotary_dim", None, null=True)  # partial_rotary_factor overrides it
    if rotary is not None and rotary > head_dim:
        raise c.fail("rotary_dim", f"at most head_dim={head_dim}")
    partial = _partial_rotary(c, 1.0 if rotary is None else rotary / head_dim)
    moe = MoeConfig(
        num_experts=c.int("num_local_experts"),
        top_k=c.int("num_experts_per_tok"),
        moe_ff=c.int("intermediate_size"),
        router="sigmoid_group",
        norm_topk_prob=True,
    )
    L = c.int("num_hidden_layers")
    return dict(
        head_dim=head_dim,
        rope=_rope(c, int(head_dim * partial)),
        moe=moe,
        moe_layers=tuple(True for _ in range(L)),
        dense_ff=0,
        qk_norm="full",
    )


# Multimodal families whose language model colibri runs, and the text_config model_types each
# wraps (transformers reads the "kimi_k2" of Kimi K2.5's release as deepseek_v3).
TEXT_CONFIGS = {"kimi_k25": ("deepseek_v3", "kimi_k2")}


def _text_config(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The language model's fields of a multimodal config (Kimi K2.5: DeepSeek-V3's, under
    text_config) with what transformers reads of the wrapper itself: its tie_word_embeddings
    (Kimi_K25Config's default: tied), its quantization_config (`_quantization`), and its dtype
    and special token ids where it sets them. The vision fields are not read."""
    family = raw["model_type"]
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(
            f"{source}: text_config must be an object of the language model's fields, not"
            f" {_kind(text)}"
        )
    kinds = TEXT_CONFIGS[family]
    kind = text.get("model_type", kinds[0])
    if kind not in kinds:
        raise ConfigError(
            f"{source}: text_config model_type={kind!r} is not supported ({family} wraps"
            f" {' or '.join(kinds)})"
        )
    out = {**text, "model_type": family}
    out["tie_word_embeddings"] = raw.get("tie_word_embeddings", True)
    quant = _quantization(raw)
    if quant is not None:
        out["quantization_config"] = quant
    dtype = raw.get("torch_dtype") or raw.get("dtype")
    if dtype:
        out["torch_dtype"] = dtype
    for key in ("bos_token_id", "eos_token_id"):
        if raw.get(key) is not None:
            out[key] = raw[key]
    return out


def _kimi_k25(c: _Fields, family: str) -> dict[str, Any]:
    """Kimi K2.5's language model: DeepSeek-V3 (MLA, grouped sigmoid routing, shared experts,
    dense first layers), its fields gathered by `_text_config`."""
    return _deepseek_like(c, "deepseek_v3")


def _deepseek_v2_routing(c: _Fields) -> dict[str, Any]:
    """DeepSeek-V2's router as transformers' DeepseekV2TopkRouter computes it: softmax over
    every routed expert (float32), top-k of all of them ("greedy") or of the `topk_group`
    groups (of `n_group`) whose best expert scores highest ("group_limited_greedy"), the
    weights times routed_scaling_factor and never renormalised: transformers reads
    norm_topk_prob and leaves it unused."""
    method = c.choice("topk_method", ("greedy", "group_limited_greedy"), "greedy")
    grouped = method == "group_limited_greedy"
    return dict(
        router="softmax_group",
        norm_topk_prob=False,
        n_group=c.int("n_group") if grouped else 1,
        topk_group=c.int("topk_group") if grouped else 1,
    )


def _eos_ids(c: _Fields, gen: _Fields) -> tuple[int, ...]:
    """eos_token_id of generation_config.json, else of config.json: one id, a list or null."""
    f = gen if "eos_token_id" in gen.raw else c
    eos = f.raw.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise f.fail("eos_token_id", "a token id, a list of them or null")
    return tuple(ids)


def _validate(cfg: ModelConfig, source: str) -> None:
    m = cfg.moe
    if cfg.num_heads % cfg.num_kv_heads:
        raise ConfigError(
            f"{source}: num_attention_heads={cfg.num_heads} is not a multiple of "
            f"num_key_value_heads={cfg.num_kv_heads}"
        )
    if any(cfg.moe_layers) and not 0 < m.top_k <= m.num_experts:
        raise ConfigError(
            f"{source}: num_experts_per_tok={m.top_k} must be in 1..{m.num_experts} experts"
        )
    if m.router in ("sigmoid_group", "softmax_group"):
        if m.num_experts % m.n_group:
            raise ConfigError(f"{source}: n_group={m.n_group} does not divide {m.num_experts}")
        if not 0 < m.topk_group <= m.n_group:
            raise ConfigError(f"{source}: topk_group={m.topk_group} must be in 1..{m.n_group}")
    if cfg.rope.rotary_dim % 2:
        raise ConfigError(f"{source}: rotary dim {cfg.rope.rotary_dim} must be even")
