"""DeepSeek-V3.2 and GLM-5 (DeepSeek sparse attention) against transformers on tiny checkpoints:
logits, incremental decode and greedy tokens with each query keeping the 8 positions its
indexer scores highest (prompts of 39 tokens, 32 decoded past them); the indexer choosing what
transformers' does, with no tie at the cut; a context within index_topk; GLM-5's layers that
reuse the selection of the layer before; the layer-by-layer path with offloaded experts; the
MTP layer both ship left out; configs as transformers reads them; `colibri synth --family`."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import tiny

from colibri.cli import main as cli
from colibri.config import ConfigError, config_from_dict
from colibri.engine.model import load_model
from colibri.engine.runner import Runner
from colibri.formats import FP8_ROWS
from colibri.model import indexer

PROMPT = "def add(a, b): The quick brown fox, naïve café 🐦"
TOPK = tiny.MORE_FAMILY_CONFIGS["deepseek_v32"]["index_topk"]  # 8: well below the prompt
FAMILIES = ["deepseek_v32", "glm_moe_dsa"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """built(family, dtype) -> a tiny checkpoint with an MTP layer appended (memoised)."""
    memo = {}

    def get(family: str, dtype: str = "float32"):
        if (family, dtype) not in memo:
            out = tmp_path_factory.mktemp(f"{family}-{dtype}")
            if dtype == "fp8":
                memo[family, dtype] = tiny.to_fp8(get(family), out, block=8)
            else:
                memo[family, dtype] = tiny.add_mtp(tiny.build(family, out))
        return memo[family, dtype]

    return get


@pytest.fixture(scope="module", params=FAMILIES)
def case(request, built):
    d = built(request.param)
    return d, load_model(d, progress=False), tiny.hf_model(d)


def test_full_sequence_logits_match_transformers(case):
    _, model, hf = case
    ids = model.tokenizer.encode(PROMPT)
    assert len(ids) > 4 * TOPK
    tiny.check_full_logits(model, hf, ids)


def test_fp8_logits_match_transformers(built):
    """GLM-5 block-quantized as its FP8 release (the indexer's query and key projections too,
    not its heads' weights): held as FP8 rows, against transformers' dequantized weights."""
    d = built("glm_moe_dsa", "fp8")
    model = load_model(d, progress=False)
    assert model.store.held == FP8_ROWS
    w = model.params["layers"][0]["attn"]["indexer"]
    assert (w["wq_b"].dtype, w["wk"].dtype, w["weights"].dtype) == (FP8_ROWS, FP8_ROWS, np.float32)
    ids = model.tokenizer.encode(PROMPT)
    ref = tiny.hf_logits(d, ids)
    np.testing.assert_allclose(Runner(model, capacity=128).full_logits(ids), ref, atol=1e-4, rtol=0)


def test_a_rows_logits_are_the_same_alone_and_among_sixteen(case):
    _, model, _ = case
    tiny.check_rows_alone(model, model.tokenizer.encode(PROMPT))


def test_incremental_decode_matches_full_forward(case):
    _, model, _ = case
    # the prefill already chooses; each decoded token chooses again
    tiny.check_incremental_decode(model, model.tokenizer.encode(PROMPT), split=2 * TOPK)


def test_greedy_tokens_identical_to_transformers_generate(case):
    _, model, hf = case
    tiny.check_greedy(model, hf, model.tokenizer.encode(PROMPT))


# ---- the indexer's choice -------------------------------------------------------------------


def _oracle_selections(hf, ids: list[int]) -> dict[int, tuple]:
    """Per layer that runs an indexer in transformers: its inputs (normed hidden states, query
    latent, rope cos and sin) and the top-k positions it chose for each query."""
    import torch

    got, hooks = {}, []
    for i, layer in enumerate(hf.model.layers):
        if layer.self_attn.indexer is None:  # GLM-5's shared layers
            continue

        def hook(module, args, kwargs, out, i=i):
            x, q_lat, (cos, sin) = args[0], args[1], args[2]
            got[i] = (*(t[0].numpy() for t in (x, q_lat, cos, sin)), out[0].numpy())

        hooks.append(layer.self_attn.indexer.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            hf(torch.tensor([ids]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return got


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_indexer_chooses_what_transformers_does_with_no_tie_at_the_cut(family, built):
    """Over the prompt and the 32 tokens decoded after it (everything the tests above attend
    to), every query past the first 8 positions keeps 8 of them: the k-th best score clears the
    next by far more than float32 rounding (the oracle is unambiguous), and the positions
    `indexer.index_scores` ranks first are the ones transformers chose."""
    d = built(family)
    model, hf = load_model(d, progress=False), tiny.hf_model(d)
    cfg, ids = model.cfg, model.tokenizer.encode(PROMPT)
    ids = ids + tiny.hf_greedy(hf, ids)
    chosen = _oracle_selections(hf, ids)
    full = [i for i in range(cfg.num_layers) if not cfg.dsa.shared[i]]
    assert sorted(chosen) == full and len(full) >= 2
    gaps = []
    for i, (x, q_lat, cos, sin, theirs) in chosen.items():
        w = model.params["layers"][i]["attn"]["indexer"]
        half = cos.shape[-1] // 2  # transformers' cos and sin hold each frequency's value twice
        rope = (jnp.asarray(cos[..., :half])[None], jnp.asarray(sin[..., :half])[None])
        x, q_lat = jnp.asarray(x)[None], jnp.asarray(q_lat)[None]
        keys = indexer.index_keys(cfg, w, x, rope)
        pos = jnp.arange(len(ids))[None]
        scores = np.asarray(indexer.index_scores(cfg, w, keys, x, q_lat, pos, rope))[0]
        for t in range(TOPK, len(ids)):
            order = np.argsort(-scores[t, : t + 1], kind="stable")
            ranked = scores[t, order]
            gaps.append((ranked[TOPK - 1] - ranked[TOPK]) / max(1.0, abs(ranked[0])))
            assert set(order[:TOPK]) == set(theirs[t].tolist()), (i, t)
    assert min(gaps) > 1e-4, min(gaps)


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_the_selection_and_its_rope_layout_change_the_logits(family, built):
    """The tests above see the selection: attending to every position, or rotating the
    indexer's dims in the other layout, moves the logits far from transformers'."""
    d = built(family)
    model = load_model(d, progress=False)
    ids = model.tokenizer.encode(PROMPT)
    ref = tiny.hf_logits(d, ids)
    dsa = model.cfg.dsa
    for changed in (dict(topk=4096), dict(interleave=not dsa.interleave)):
        cfg = dataclasses.replace(model.cfg, dsa=dataclasses.replace(dsa, **changed))
        other = Runner(dataclasses.replace(model, cfg=cfg), capacity=128).full_logits(ids)
        assert np.abs(other - ref).max() > 1e-2, changed


def test_context_within_index_topk_attends_to_all_of_it(built, tmp_path):
    """index_topk 80 against a 39-token prompt and 32 tokens decoded: transformers keeps every
    position (min(index_topk, seen)); so does colibri, where its cache's bucket is longer
    than index_topk (decode, 128 positions) and where it is not (prefill, 64)."""
    d = tmp_path / "topk80"
    shutil.copytree(built("deepseek_v32"), d)
    raw = tiny.saved_config(d)
    (d / "config.json").write_text(json.dumps({**raw, "index_topk": 80}))
    model, hf = load_model(d, progress=False), tiny.hf_model(d)
    ids = model.tokenizer.encode(PROMPT)
    tiny.check_full_logits(model, hf, ids)
    tiny.check_greedy(model, hf, ids)


def test_shared_layers_run_no_indexer(built):
    """GLM-5's layers 1 and 2 ("shared") have no indexer weights, cache no indexer keys and
    attend where layer 0 chose (which the oracle tests above check against transformers)."""
    model = load_model(built("glm_moe_dsa"), progress=False)
    assert model.cfg.dsa.shared == (False, True, True, False)
    runner = Runner(model, capacity=64)
    for i, shared in enumerate(model.cfg.dsa.shared):
        attn = model.params["layers"][i]["attn"]
        assert ("indexer" in attn) != shared and ("ik" in runner.cache[i]) != shared
        assert any(f"layers.{i}.self_attn.indexer." in n for n in model.ckpt.tensors) != shared


# ---- the engine ------------------------------------------------------------------------------


def test_layer_by_layer_with_offloaded_experts_gives_the_resident_tokens(built):
    """Tiered (3 device slots a layer, the rest in RAM and on disk), the runner goes layer by
    layer (steps.dsa_project, passing each selection on): the resident run's logits and
    tokens."""
    d = built("glm_moe_dsa")
    model, probe = tiny.load_placed(d, tiered=True)
    prompts = [[5, 9, 300, 17], [44, 2, 2, 81, 6, 7], list(range(3, 43))]
    got, want = tiny.prefill_then_decode(model, prompts), tiny.prefill_then_decode(probe, prompts)
    assert model.store.stats.misses > 0  # experts really were staged in from RAM and disk
    for a, b in zip(got, want, strict=True):  # each decode step feeds the greedy token
        np.testing.assert_array_equal(a.argmax(-1), b.argmax(-1))
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_mtp_layer_is_left_out_and_said_so_once(built, caplog):
    """Both ship one more layer than num_hidden_layers (model.layers.3 here): colibri reads
    none of it, counts it among neither the layers nor the MoE layers, and says so in one line."""
    with caplog.at_level(logging.INFO, logger="colibri"):
        model = load_model(built("deepseek_v32"), progress=False)
    assert "model.layers.3.eh_proj.weight" in model.ckpt.tensors
    lines = [r.getMessage() for r in caplog.records if "multi-token prediction" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("model.layers.3.*: not loaded"), lines
    assert model.cfg.moe_layer_ids == (1, 2) and len(model.params["layers"]) == 3
    assert len(model.store.resident) == 2


# ---- configs as transformers reads them ------------------------------------------------------

GLM5 = dict(
    model_type="glm_moe_dsa",
    vocab_size=300,
    hidden_size=64,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    kv_lora_rank=32,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
)


@pytest.mark.parametrize(
    "fields",
    [
        {},  # every layer runs its indexer; transformers' defaults for the rest
        {"index_topk_pattern": "FSSFSF"},
        {"index_topk_freq": 2, "index_skip_topk_offset": 1},
        {"index_topk_freq": 3},
        {"indexer_types": ["full", "shared", "full", "full", "shared", "shared"]},
        {"model_type": "deepseek_v32", "index_topk_pattern": "FSSFSF"},  # V3.2 reads none
        {"model_type": "deepseek_v32", "mlp_layer_types": ["dense", "sparse"] * 3},
    ],
    ids=["defaults", "pattern", "freq-offset", "freq", "indexer_types", "v32", "mlp-types"],
)
def test_configs_read_as_transformers_reads_them(fields):
    from transformers import AutoConfig

    raw = {**GLM5, **fields}
    hf = AutoConfig.for_model(**raw)
    cfg = config_from_dict(raw)
    types = getattr(hf, "indexer_types", None) or ["full"] * hf.num_hidden_layers
    assert cfg.dsa.shared == tuple(t == "shared" for t in types)
    assert cfg.moe_layers == tuple(t == "sparse" for t in hf.mlp_layer_types)
    assert (cfg.dsa.n_heads, cfg.dsa.head_dim, cfg.dsa.topk) == (
        hf.index_n_heads,
        hf.index_head_dim,
        hf.index_topk,
    )
    m = cfg.moe
    assert (m.n_group, m.topk_group, m.routed_scaling_factor, m.shared_ff) == (
        hf.n_group,
        hf.topk_group,
        hf.routed_scaling_factor,
        hf.moe_intermediate_size * hf.n_shared_experts,
    )
    assert cfg.rope.interleave and cfg.dsa.interleave == (raw["model_type"] == "glm_moe_dsa")


def test_configs_colibri_cannot_run_are_refused():
    with pytest.raises(ConfigError, match="indexer_types"):
        config_from_dict({**GLM5, "index_topk_pattern": "SFFFFF"})  # nothing to reuse
    with pytest.raises(ConfigError, match="index_topk_pattern"):
        config_from_dict({**GLM5, "index_topk_pattern": "FSF"})  # not one a layer
    with pytest.raises(ConfigError, match="q_lora_rank"):
        config_from_dict({**GLM5, "q_lora_rank": None})


# ---- colibri synth --family ------------------------------------------------------------------


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_synth_family_matches_transformers(family, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / family
    flags = ["--layers", "3", "--experts", "8", "--top-k", "2", "--hidden", "64"]
    flags += ["--moe-ff", "32", "--vocab", "300", "--out", str(out)]
    assert cli(["synth", "--family", family, *flags]) == 0
    hf, info = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # every tensor transformers expects, and no other
    model = load_model(out, progress=False)
    ids = model.tokenizer.encode("def forward(x): The router sends")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(Runner(model, capacity=64).full_logits(ids), ref, atol=1e-4)


def test_glm5_through_the_engine_slots_prefix_reuse_restart_and_tiers(built, tmp_path):
    """GLM-5 (indexer keys cached beside the latents, shared-selection layers) through the real
    engine: four conversations decoding at once in four slots give each one's single-slot
    tokens, past index_topk, resident and under CAP=1 RAM_GB=0 (every expert staged from
    disk); after a KVSAVE restart a follow-up turn reuses the saved prefix as much as it does
    without a restart, and both give the tokens of the follow-up run from scratch."""
    from engine_util import Mux, Reference, text

    from colibri.protocol.codec import Accept

    d = built("glm_moe_dsa")
    prompts = ["def add(a, b):", "The quick brown fox", "naïve café 🐦", "Permission is"]
    ref = Reference(d, 128)
    want = [ref.text(p, 24) for p in prompts]
    env = dict(KV_SLOTS="4", CTX="128", KVSAVE="1", STATE_DIR=str(tmp_path))

    def turns(e: Mux, first: int) -> list[bytes]:
        for i, p in enumerate(prompts):
            e.submit(first + i, i, p, max_tokens=24)
        evs = e.collect(*range(first, first + len(prompts)), timeout=300)
        return [text(evs, first + i) for i in range(len(prompts))]

    follow = prompts[0] + " return a + b"
    a = Mux(d, **env)
    try:
        assert turns(a, 1) == want
    finally:
        assert a.close() == 0, a.stderr()
        a.kill()
    b = Mux(d, **env)  # restarted: slot 0's KV (latents, roped and indexer keys) from its file
    try:
        b.submit(20, 0, follow, max_tokens=12)
        restarted = b.collect(20, timeout=300)
    finally:
        assert b.close() == 0, b.stderr()
        b.kill()
    assert "cached positions restored" in b.stderr()
    tiered = Mux(d, KV_SLOTS="4", CTX="128", CAP="1", RAM_GB="0")
    try:
        assert turns(tiered, 30) == want
        tiered.submit(40, 0, follow, max_tokens=12)  # the same follow-up, no restart
        kept = tiered.collect(40, timeout=300)
    finally:
        assert tiered.close() == 0, tiered.stderr()
        tiered.kill()
    reused = [next(ev for ev in evs if isinstance(ev, Accept)) for evs in (restarted, kept)]
    assert reused[0].reused_tokens == reused[1].reused_tokens > 0
    assert text(restarted, 20) == text(kept, 40) == ref.text(follow, 12)
