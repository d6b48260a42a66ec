"""What the peers benchmark's roofline (colibri.bench.accounting) says a decode step reads and
computes, against transformers running that step: its FLOPs as torch's counter sees them, its
keys and values as its cache holds them, its weights as its parameters are."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from colibri.bench.accounting import (
    attention_flops,
    expert_flops,
    f32_step_parts,
    kv_bytes,
    part_bound,
    step_bytes,
    step_flops,
)
from colibri.config import load_config
from colibri.synth import SynthSpec, synthesize

PROMPT, ROWS = 12, 3


@pytest.fixture(scope="module", params=["qwen3_moe", "olmoe"])
def decoded(request, tmp_path_factory):
    """A checkpoint of the benchmark's families, its config, and one greedy decode step of ROWS
    conversations after PROMPT tokens in transformers (eager attention and experts: products
    torch's counter sees), with its FLOPs and its cache after the step."""
    spec = SynthSpec(
        family=request.param, layers=2, experts=8, top_k=2, hidden=128, moe_ff=64, vocab=384
    )
    ckpt = synthesize(spec, tmp_path_factory.mktemp("bench") / spec.family, progress=False)
    model = AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    ids = torch.randint(0, spec.vocab, (ROWS, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cache = model(ids, use_cache=True).cache
        step = ids[:, -1:]
        with FlopCounterMode(display=False) as counter:
            model(step, cache=cache, use_cache=True)
    return load_config(ckpt), model, cache, counter.get_total_flops()


def test_step_flops_are_what_torch_counts(decoded):
    cfg, _, _, counted = decoded
    assert step_flops(cfg, ROWS, PROMPT, tokens=1) == counted


def test_kv_bytes_are_the_cache_a_step_reads(decoded):
    cfg, _, cache, _ = decoded
    held = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))
    assert held == kv_bytes(cfg, ROWS, PROMPT, tokens=1)  # PROMPT + 1 positions
    # Over several steps, the mean context: step i attends over PROMPT + i + 1 positions.
    per_position = held / (PROMPT + 1)
    mean = sum(PROMPT + i + 1 for i in range(5)) / 5
    assert kv_bytes(cfg, ROWS, PROMPT, tokens=5) == pytest.approx(per_position * mean)


def test_step_bytes_are_the_weights_one_row_touches(decoded):
    cfg, model, _, _ = decoded
    k, touched = cfg.moe.top_k, 0
    for name, p in model.named_parameters():
        if ".experts." in name:  # [experts, ...]: top-k of them a layer
            touched += k * p[0].nbytes
        elif "embed_tokens" in name:
            touched += p[0].nbytes  # one row a token
        else:
            touched += p.nbytes
    counted = step_bytes(cfg, [k] * cfg.num_layers, 1)
    # The q and k norms (a head's width, or OLMoE's full width, a layer) are left out.
    assert counted <= touched
    assert counted == pytest.approx(touched, rel=0.01)


@pytest.mark.parametrize("dtype", ["f32", "int8"])
def test_held_step_bytes_are_the_arrays_one_row_reads(tmp_path, dtype):
    """held_step_bytes, from the arrays the engine holds: for a float32 checkpoint what
    step_bytes counts (but the q and k norms it leaves out); for int8 rows, the chosen experts
    at a byte a weight plus a float32 scale and offset per group of 128 columns, the rest as
    the engine holds it."""
    from colibri.bench.accounting import held_step_bytes
    from colibri.engine.model import load_model

    spec = SynthSpec(layers=2, experts=8, top_k=2, hidden=256, moe_ff=128, vocab=384, dtype=dtype)
    model = load_model(synthesize(spec, tmp_path / dtype, progress=False), progress=False)
    cfg, k = model.cfg, spec.top_k
    held = held_step_bytes(model.params, model.experts, [k] * cfg.num_layers)
    dense = held_step_bytes(model.params, model.experts, [0] * cfg.num_layers)
    D, F = spec.hidden, spec.moe_ff
    if dtype == "f32":
        counted = step_bytes(cfg, [k] * cfg.num_layers, 1)
        assert counted <= held
        assert counted == pytest.approx(held, rel=0.01)
    else:  # gate, up: F rows of D values; down: D rows of F; 8 bytes a group beside them
        row_bytes = 2 * F * (D + 8 * D // 128) + D * (F + 8 * F // 128)
        assert held - dense == cfg.num_layers * k * row_bytes


def test_mla_reads_its_latent_cache_and_computes_the_absorbed_form(tmp_path):
    """MLA's step reads the cache the engine holds, a latent and a roped key a position
    (DeepSeek-V3), not the keys and values transformers expands them to; its attention
    computes each head's scores over both and its weighted latents."""
    spec = SynthSpec(
        family="deepseek_v3", layers=2, experts=8, top_k=2, hidden=128, moe_ff=64, vocab=384
    )
    cfg = load_config(synthesize(spec, tmp_path / "mla", progress=False))
    r, R = cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim
    assert kv_bytes(cfg, ROWS, PROMPT, tokens=1) == ROWS * (PROMPT + 1) * 2 * (r + R) * 4
    per_position = 2 * cfg.num_heads * (2 * r + R) * 2  # two layers, a multiply-add 2 FLOP
    assert attention_flops(cfg, ROWS, PROMPT, tokens=1) == ROWS * (PROMPT + 1) * per_position


def test_a_step_split_into_parts_is_the_whole_step(decoded):
    """The routed experts, the other weights and the keys and values: their bytes and FLOPs
    add up to the step's, the experts' FLOPs those torch counts in the experts alone."""
    cfg = decoded[0]
    chosen = [2.0] * cfg.num_layers
    parts = f32_step_parts(cfg, chosen, ROWS, PROMPT, tokens=1)
    assert set(parts) == {"experts", "dense", "attention"}
    whole = step_bytes(cfg, chosen, ROWS) + kv_bytes(cfg, ROWS, PROMPT, tokens=1)
    assert sum(b for b, _ in parts.values()) == pytest.approx(whole)
    assert sum(f for _, f in parts.values()) == pytest.approx(step_flops(cfg, ROWS, PROMPT, 1))
    assert parts["experts"] == (
        4.0 * sum(chosen) * 3 * cfg.hidden * cfg.moe.moe_ff,
        expert_flops(cfg, ROWS),
    )
    assert parts["attention"][1] == attention_flops(cfg, ROWS, PROMPT, tokens=1)
    assert min(b for b, _ in parts.values()) > 0 and min(f for _, f in parts.values()) > 0


def test_a_part_bound_by_its_arithmetic_lends_no_time_to_one_bound_by_its_reads():
    # As long to read the one as to compute the other: the whole step would look balanced.
    parts = {"attention": (100.0, 0.0), "experts": (0.0, 200.0)}
    assert part_bound(parts, 1.0, {"attention": 1.0, "experts": 2.0}) == pytest.approx(0.5)
    parts = {"attention": (100.0, 50.0), "experts": (300.0, 200.0)}
    assert part_bound(parts, 1.0, dict.fromkeys(parts, 1.0)) == pytest.approx(400 / 400)
    assert part_bound(parts, 2.0, dict.fromkeys(parts, 1.0)) == pytest.approx(200 / 250)
