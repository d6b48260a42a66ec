"""The checkpoints the benchmarks run on: the peers benchmark's two synthetic shapes (SHAPES,
every benchmark's default) and, for the kernels' benchmarks, one with the rows of the models
people run (ALL_SHAPES), made once and cached under CACHE (in the working folder)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from colibri.synth import SynthSpec, synthesize

SHAPES = {
    # ~0.5B parameters: 8 layers x 64 experts of 3 x 768 x 384, top-8.
    "qwen3_moe": SynthSpec(
        family="qwen3_moe",
        layers=8,
        experts=64,
        top_k=8,
        hidden=768,
        moe_ff=384,
        vocab=8192,
        kv_heads=4,
        dtype="f32",
        seed=0,
        shard_mb=1024,
    ),
    # ~0.4B parameters: 8 layers x 64 experts of 3 x 512 x 512, top-8; OLMoE has no grouped
    # KV heads (llama.cpp's olmoe expects full-width k norms).
    "olmoe": SynthSpec(
        family="olmoe",
        layers=8,
        experts=64,
        top_k=8,
        hidden=512,
        moe_ff=512,
        vocab=8192,
        kv_heads=8,
        dtype="f32",
        seed=1,
        shard_mb=1024,
    ),
}
# Beside them, for the kernels' benchmarks (not the peers' default): rows as long as the models
# people run (Qwen3-30B-A3B: hidden 2048, moe_ff 768), with fewer layers and experts: 4 layers
# x 32 experts of 3 x 2048 x 768, top-8; and their attention heads.
ALL_SHAPES = {
    **SHAPES,
    "wide": dataclasses.replace(
        SHAPES["qwen3_moe"], layers=4, experts=32, hidden=2048, moe_ff=768, seed=2
    ),
    # Attention heads as the models people run have them (Qwen3-30B-A3B: 128 columns, eight
    # query heads a KV head), with two KV heads and small experts: for the attention kernel.
    "gqa128": dataclasses.replace(
        SHAPES["qwen3_moe"],
        layers=4,
        experts=8,
        hidden=2048,
        moe_ff=64,
        heads=16,
        kv_heads=2,
        seed=3,
    ),
    # Multi-head latent attention as DeepSeek-V3, GLM-5 and Kimi K2.5 have it (a 512-wide
    # latent, 32 heads here), with few small experts: for MLA's attention through the engine.
    "mla": dataclasses.replace(
        SHAPES["qwen3_moe"],
        family="deepseek_v3",
        layers=4,
        experts=8,
        top_k=2,
        hidden=2048,
        moe_ff=64,
        seed=5,
    ),
}
CACHE = Path(".cache/bench-peers")


def ensure_inputs(name: str, with_llama: bool = False) -> dict[str, Path]:
    """The shape `name` (ALL_SHAPES) as float32, synthesized if missing, for every peer that
    reads it (with_llama: exported to GGUF f32 and q8_0 for llama.cpp too)."""
    ckpt = CACHE / name
    if not (ckpt / "config.json").exists():
        synthesize(ALL_SHAPES[name], ckpt)
    paths = {"colibri": ckpt, "transformers": ckpt}
    if with_llama:
        from colibri.gguf import export_gguf

        for peer, dtype in (("llama.cpp f32", "f32"), ("llama.cpp q8_0", "q8_0")):
            out = CACHE / f"{name}-{dtype}.gguf"
            if not out.exists():
                export_gguf(ckpt, out, dtype=dtype)
            paths[peer] = out
    return paths


def held_checkpoint(name: str, dtype: str) -> Path:
    """The shape `name` as `dtype`: float32 ("f32" or "float32": `ensure_inputs`'), or "bf16"
    or one of colibri.bench.formats' FORMATS, synthesized as that format asks; made if
    missing."""
    from colibri.bench.formats import FORMATS

    if dtype in ("f32", "float32"):
        return ensure_inputs(name)["colibri"]
    return shape_checkpoint(name, dtype, **FORMATS.get(dtype, {}).get("synth", {}))


def shape_checkpoint(name: str, dtype: str, /, **changes) -> Path:
    """The shape `name` (ALL_SHAPES) synthesized in `dtype` (cached under .cache/bench-peers;
    `changes` may name the synthesized dtype where `dtype` only names the cache)."""
    out = CACHE / f"{name}-{dtype}"
    if not (out / "config.json").exists():
        synthesize(dataclasses.replace(ALL_SHAPES[name], **{"dtype": dtype, **changes}), out)
    return out
