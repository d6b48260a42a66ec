"""GGUF export of colibri checkpoints and a greedy llama.cpp run, to measure against llama.cpp."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from colibri.checkpoint import Checkpoint
from colibri.config import ModelConfig, _rope_params, load_config

ARCHS = {"qwen3_moe": "qwen3moe", "olmoe": "olmoe"}  # colibri family -> llama.cpp architecture
DTYPES = ("f32", "bf16", "q8_0", "q4_0")
# llama.cpp's LLAMA_FTYPE_ALL_F32, LLAMA_FTYPE_MOSTLY_BF16, _MOSTLY_Q8_0, _MOSTLY_Q4_0
_FILE_TYPE = {"f32": 0, "bf16": 32, "q8_0": 7, "q4_0": 2}
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER, _TOKEN_UNUSED = 1, 3, 4, 5

# One GGUF tensor: its name, its numpy shape, and how to read it as float32.
Plan = tuple[str, tuple[int, ...], Callable[[], np.ndarray]]


def _gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise ImportError(
            "GGUF export needs the `gguf` package: pip install 'colibri[bench]'"
        ) from None
    return gguf


def export_gguf(model_dir: str | Path, out: str | Path, dtype: str = "f32") -> Path:
    """Write `out`, a GGUF file llama.cpp runs, from the checkpoint in `model_dir`.

    dtype "f32" copies every tensor bit for bit; "bf16" stores the matrices in bfloat16 (rounded
    to nearest even: a bf16 checkpoint's bit for bit), "q8_0" in llama.cpp's 8-bit blocks and
    "q4_0" in its 4-bit ones (32 values and an f16 scale a block; the nearest GGUF format to an
    int4 checkpoint, whose weights are dequantized and quantized again), all keeping norms and
    routers in f32, as llama.cpp's own quantizer does."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: one of {', '.join(DTYPES)}")
    gguf = _gguf()
    model_dir, out = Path(model_dir), Path(out)
    cfg = load_config(model_dir)
    arch = _check_supported(cfg)
    ckpt = Checkpoint(model_dir)
    tmp = out.with_name(out.name + ".tmp")  # a failed export leaves no half-written `out`
    try:
        _write(gguf, gguf.GGUFWriter(tmp, arch), cfg, ckpt, model_dir, dtype)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        ckpt.close()
    tmp.replace(out)
    return out


def _write(
    gguf: Any, w: Any, cfg: ModelConfig, ckpt: Checkpoint, model_dir: Path, dtype: str
) -> None:
    """Metadata, then tensor headers, then tensor data one at a time (never all in memory)."""
    _write_hparams(w, cfg, model_dir.name, _FILE_TYPE[dtype])
    _write_tokenizer(w, model_dir / "tokenizer.json", cfg)
    plan = list(_plan(cfg, ckpt))
    qtypes = {name: _qtype(gguf, name, shape, dtype) for name, shape, _ in plan}
    for name, shape, _ in plan:
        _add_info(w, gguf, name, shape, qtypes[name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, _, read in plan:
        w.write_tensor_data(_encode(gguf, read(), qtypes[name]))
    w.close()


def _check_supported(cfg: ModelConfig) -> str:
    """llama.cpp's architecture for this config, or a ValueError naming what it cannot run."""
    if cfg.family not in ARCHS:
        raise ValueError(f"model_type={cfg.family!r}: GGUF export supports {', '.join(ARCHS)} only")
    rope = _rope_params(cfg.raw)
    problems = {
        "rope_type": (rope["rope_type"], "default"),
        "partial_rotary_factor": (rope.get("partial_rotary_factor", 1.0), 1.0),
        "qkv bias": (cfg.qkv_bias or cfg.o_bias, False),
        "sparse layers": (all(cfg.moe_layers), True),
        # llama.cpp hard-codes the top-k renormalisation: on for qwen3moe, off for olmoe.
        "norm_topk_prob": (cfg.moe.norm_topk_prob, cfg.family == "qwen3_moe"),
        # llama.cpp's olmoe graph never clamps q/k/v.
        "clip_qkv": (cfg.clip_qkv, None),
    }
    if cfg.family == "olmoe":  # its k_norm and o_proj are sized [D]: no GQA, and H x Dh = D
        problems["num_key_value_heads"] = (cfg.num_kv_heads, cfg.num_heads)
        problems["heads x head_dim"] = (cfg.num_heads * cfg.head_dim, cfg.hidden)
    for key, (got, want) in problems.items():
        if got != want:
            raise ValueError(
                f"{cfg.family}: {key}={got!r}, llama.cpp's {ARCHS[cfg.family]} needs {want!r}"
            )
    return ARCHS[cfg.family]


def _write_hparams(w: Any, cfg: ModelConfig, name: str, file_type: int) -> None:
    """The `{arch}.*` keys llama.cpp's loader reads for these two architectures."""
    m = cfg.moe
    w.add_name(name)
    w.add_file_type(file_type)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden)
    w.add_block_count(cfg.num_layers)
    # olmoe reads the expert width from feed_forward_length, qwen3moe from the expert key.
    w.add_feed_forward_length(
        cfg.dense_ff if cfg.family == "qwen3_moe" and cfg.dense_ff else m.moe_ff
    )
    w.add_expert_feed_forward_length(m.moe_ff)
    w.add_expert_count(m.num_experts)
    w.add_expert_used_count(m.top_k)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(float(_rope_params(cfg.raw)["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_eps)


def _write_tokenizer(w: Any, path: Path, cfg: ModelConfig) -> None:
    """A byte-level BPE `tokenizer.json` as llama.cpp's "gpt2" vocabulary, padded to V ids."""
    spec = json.loads(path.read_text())
    model = spec["model"]
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")):
        raise ValueError(f"{path}: GGUF export needs a byte-level BPE tokenizer")
    tokens = [f"[PAD{i}]" for i in range(cfg.vocab_size)]
    types = [_TOKEN_UNUSED] * cfg.vocab_size
    for text, i in model["vocab"].items():
        tokens[i], types[i] = text, _TOKEN_NORMAL
    for t in spec.get("added_tokens", []):
        tokens[t["id"]] = t["content"]
        types[t["id"]] = _TOKEN_CONTROL if t.get("special") else _TOKEN_USER
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # the GPT-2 split regex of a ByteLevel pre-tokenizer
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if cfg.bos_token_id is not None:
        w.add_bos_token_id(int(cfg.bos_token_id))
    if cfg.eos_token_ids:
        w.add_eos_token_id(cfg.eos_token_ids[0])
    w.add_add_bos_token(False)


def _plan(cfg: ModelConfig, ckpt: Checkpoint) -> Iterator[Plan]:
    """Every GGUF tensor in llama.cpp's order and naming, with its Hugging Face source."""
    D, V, E, F = cfg.hidden, cfg.vocab_size, cfg.moe.num_experts, cfg.moe.moe_ff

    def one(name: str, shape: tuple[int, ...]) -> Callable[[], np.ndarray]:
        return lambda: ckpt.read(name, shape)

    def stacked(names: list[str], shape: tuple[int, ...]) -> Callable[[], np.ndarray]:
        return lambda: np.stack([ckpt.read(n, shape) for n in names])

    yield "token_embd.weight", (V, D), one("model.embed_tokens.weight", (V, D))
    for i in range(cfg.num_layers):
        hf, blk = f"model.layers.{i}", f"blk.{i}"
        yield from _attn_plan(cfg, one, f"{hf}.self_attn", blk)
        yield f"{blk}.attn_norm.weight", (D,), one(f"{hf}.input_layernorm.weight", (D,))
        yield f"{blk}.ffn_norm.weight", (D,), one(f"{hf}.post_attention_layernorm.weight", (D,))
        yield f"{blk}.ffn_gate_inp.weight", (E, D), one(f"{hf}.mlp.gate.weight", (E, D))
        for gg, proj, shape in (
            ("gate", "gate_proj", (F, D)),
            ("up", "up_proj", (F, D)),
            ("down", "down_proj", (D, F)),
        ):
            names = [f"{hf}.mlp.experts.{e}.{proj}.weight" for e in range(E)]
            # [E, F, D] or [E, D, F]: GGUF lists dims reversed, llama.cpp's {D, F, E} / {F, D, E}
            yield f"{blk}.ffn_{gg}_exps.weight", (E, *shape), stacked(names, shape)
    yield "output_norm.weight", (D,), one("model.norm.weight", (D,))
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    yield "output.weight", (V, D), one(head, (V, D))  # olmoe has no tied-output fallback


def _attn_plan(cfg: ModelConfig, one: Callable, hf: str, blk: str) -> Iterator[Plan]:
    """q/k/v/o as stored: both architectures rotate with NEOX rope, so no q/k permutation."""
    D, Dh = cfg.hidden, cfg.head_dim
    Hq, Hkv = cfg.num_heads * Dh, cfg.num_kv_heads * Dh
    for gg, proj, shape in (
        ("q", "q_proj", (Hq, D)),
        ("k", "k_proj", (Hkv, D)),
        ("v", "v_proj", (Hkv, D)),
        ("output", "o_proj", (D, Hq)),
    ):
        yield f"{blk}.attn_{gg}.weight", shape, one(f"{hf}.{proj}.weight", shape)
    # qwen3moe normalises each head ([Dh]); olmoe the whole projection ([H*Dh], [Hkv*Dh]).
    qn, kn = ((Dh,), (Dh,)) if cfg.qk_norm == "head" else ((Hq,), (Hkv,))
    yield f"{blk}.attn_q_norm.weight", qn, one(f"{hf}.q_norm.weight", qn)
    yield f"{blk}.attn_k_norm.weight", kn, one(f"{hf}.k_norm.weight", kn)


def _qtype(gguf: Any, name: str, shape: tuple[int, ...], dtype: str) -> Any:
    """BF16 for matrices, or Q8_0 / Q4_0 for those whose rows fill whole 32-value blocks; f32 for
    norms and routers (llama.cpp's quantizer skips 1-D, `*_norm` and `ffn_gate_inp` tensors
    too)."""
    Q = gguf.GGMLQuantizationType
    qtype = {"f32": Q.F32, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}[dtype]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    small = len(shape) == 1 or "ffn_gate_inp" in name or shape[-1] % block
    return Q.F32 if small else qtype


def _add_info(w: Any, gguf: Any, name: str, shape: tuple[int, ...], qtype: Any) -> None:
    if qtype == gguf.GGMLQuantizationType.F32:
        w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        return
    raw = gguf.quant_shape_to_byte_shape(shape, qtype)
    w.add_tensor_info(name, raw, np.dtype(np.uint8), int(np.prod(raw)), raw_dtype=qtype)


def _encode(gguf: Any, arr: np.ndarray, qtype: Any) -> np.ndarray:
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    return arr if qtype == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(arr, qtype)


def llama_generate(
    gguf_path: str | Path,
    prompt_ids: list[int],
    n_new: int,
    n_threads: int | None = None,
    n_ctx: int | None = None,
    kv_type: str = "f16",
    warmup: bool = True,
) -> tuple[list[int], dict[str, float]]:
    """Greedy continuation of `prompt_ids` by llama.cpp at batch 1, and how long each part took.

    Timings: load_s (GGUF file to ready context), prefill_s / prefill_tok_s (the prompt, one
    `eval`), decode_s / decode_tok_s (the n_new - 1 single-token steps after it), and llama.cpp's
    own counters from llama_perf_context (p_eval_ms, n_p_eval, eval_ms, n_eval). kv_type is the
    KV cache's precision: llama.cpp's default "f16", or "f32". warmup runs one untimed
    single-token step first (as llama-bench does), so prefill excludes first-call setup."""
    if not prompt_ids or n_new < 1:
        raise ValueError(f"need a prompt and n_new >= 1 (got {len(prompt_ids)} ids, {n_new})")
    t0 = time.perf_counter()
    llm = _llama(gguf_path, n_ctx or len(prompt_ids) + n_new, n_threads, kv_type, False)
    t1 = time.perf_counter()
    if warmup:
        _warm_up(llm, prompt_ids[0])
    t1w = time.perf_counter()
    llm.eval(list(prompt_ids))
    t2 = time.perf_counter()
    tokens = [_argmax_last(llm)]
    for _ in range(n_new - 1):
        llm.eval([tokens[-1]])
        tokens.append(_argmax_last(llm))
    t3 = time.perf_counter()
    perf = _perf(llm)
    llm.close()
    return tokens, dict(
        load_s=t1 - t0,
        prefill_s=t2 - t1w,
        prefill_tok_s=len(prompt_ids) / (t2 - t1w),
        decode_s=t3 - t2,
        decode_tok_s=(n_new - 1) / (t3 - t2) if n_new > 1 else float("nan"),
        **perf,
    )


def llama_generate_parallel(
    gguf_path: str | Path,
    prompts: list[list[int]],
    n_new: int,
    n_threads: int | None = None,
    kv_type: str = "f32",
    flash_attn: bool = False,
) -> tuple[list[list[int]], dict[str, float]]:
    """Greedy continuations of several prompts by llama.cpp decoding them together, a sequence
    each (as llama-server's parallel slots do: one llama_decode a step, a token of every
    sequence in it, each with its own KV stream), and how long it took.

    Returns each prompt's n_new tokens and timings: load_s, prefill_s (the prompts, one
    llama_decode each), decode_s / decode_tok_s (the n_new - 2 steps after the first batched
    one, which sizes llama.cpp's graph for the batch and is not timed; tokens of all sequences
    a second). kv_type as llama_generate's; flash_attn: llama.cpp's flash attention, off as
    llama_generate runs it (on, 16 sequences of the peers' olmoe shape decoded at 0.85x the
    rate)."""
    import llama_cpp

    kv = _kv_type(kv_type)
    if not prompts or not all(prompts) or n_new < 3:
        raise ValueError(f"need non-empty prompts and n_new >= 3 (got {len(prompts)}, {n_new})")
    n_seq, longest = len(prompts), max(len(p) for p in prompts)
    threads = n_threads or 1
    # llama-cpp-python prints llama.cpp's log through this logger, at its level (as Llama's
    # verbose=False sets it).
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(
        str(gguf_path).encode(), llama_cpp.llama_model_default_params()
    )
    if not model:
        raise RuntimeError(f"{gguf_path}: llama.cpp could not load it")
    params = llama_cpp.llama_context_default_params()
    params.n_seq_max = n_seq
    per_seq = -(-(longest + n_new + 8) // 256) * 256  # llama.cpp pads a stream to 256
    params.n_ctx = n_seq * per_seq  # each sequence's stream a share of it
    params.n_batch = params.n_ubatch = max(512, longest, n_seq)
    params.n_threads = params.n_threads_batch = threads
    params.type_k = params.type_v = kv
    params.flash_attn_type = (
        llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        if flash_attn
        else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    )
    ctx = llama_cpp.llama_init_from_model(model, params)
    batch = llama_cpp.llama_batch_init(params.n_batch, 0, 1)
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    try:
        if not ctx:
            raise RuntimeError(f"{gguf_path}: llama.cpp could not make a context for {n_seq}")
        load_s = time.perf_counter() - t0

        def decode(entries: list[tuple[int, int, int, bool]]) -> None:
            """One llama_decode of (token, position, sequence, wants logits) entries."""
            for i, (tok, pos, seq, logits) in enumerate(entries):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, logits
            batch.n_tokens = len(entries)
            if rc := llama_cpp.llama_decode(ctx, batch):
                raise RuntimeError(f"llama_decode returned {rc}")

        t1 = time.perf_counter()
        out = []
        for s, p in enumerate(prompts):
            decode([(tok, i, s, i == len(p) - 1) for i, tok in enumerate(p)])
            out.append([_greedy(ctx, len(p) - 1, vocab)])
        prefill_s = time.perf_counter() - t1

        def step() -> None:
            decode(
                [
                    (o[-1], len(p) + len(o) - 1, s, True)
                    for s, (p, o) in enumerate(zip(prompts, out, strict=True))
                ]
            )
            for s, o in enumerate(out):
                o.append(_greedy(ctx, s, vocab))

        step()  # sizes the graph for the batch
        llama_cpp.llama_synchronize(ctx)
        t2 = time.perf_counter()
        for _ in range(n_new - 2):
            step()
        decode_s = time.perf_counter() - t2
    finally:
        llama_cpp.llama_batch_free(batch)
        if ctx:
            llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    return out, dict(
        load_s=load_s,
        prefill_s=prefill_s,
        decode_s=decode_s,
        decode_tok_s=n_seq * (n_new - 2) / decode_s,
    )


def llama_logits(
    gguf_path: str | Path, ids: list[int], n_threads: int | None = None, kv_type: str = "f32"
) -> np.ndarray:
    """llama.cpp's logits at every position of `ids`, [T, V] (f32 KV cache by default)."""
    llm = _llama(gguf_path, len(ids), n_threads, kv_type, True)
    llm.eval(list(ids))
    out = np.array(llm.scores[: len(ids)], dtype=np.float32)
    llm.close()
    return out


def _llama(path: str | Path, n_ctx: int, n_threads: int | None, kv_type: str, all_logits: bool):
    import llama_cpp

    kv = _kv_type(kv_type)
    return llama_cpp.Llama(
        model_path=str(path),
        n_ctx=n_ctx,
        n_batch=max(512, n_ctx),  # the whole prompt in one eval call
        n_threads=n_threads,
        n_threads_batch=n_threads,
        type_k=kv,
        type_v=kv,
        logits_all=all_logits,
        verbose=False,
    )


def _warm_up(llm: Any, token: int) -> None:
    """One decode step, then an empty cache and zeroed perf counters."""
    import llama_cpp

    llm.eval([token])
    llama_cpp.llama_synchronize(llm.ctx)  # llama.cpp books a step's time at the next sync
    llm.reset()  # the next eval starts at position 0 and drops the cached step
    llama_cpp.llama_perf_context_reset(llm.ctx)


def _perf(llm: Any) -> dict[str, float]:
    import llama_cpp

    p = llama_cpp.llama_perf_context(llm.ctx)
    return dict(
        p_eval_ms=float(p.t_p_eval_ms),
        n_p_eval=float(p.n_p_eval),
        eval_ms=float(p.t_eval_ms),
        n_eval=float(p.n_eval),
    )


def _argmax_last(llm: Any) -> int:
    """Greedy pick from the last position's logits (Llama keeps no scores without logits_all)."""
    return _greedy(llm.ctx, -1, llm.n_vocab())


def _greedy(ctx: Any, i: int, vocab: int) -> int:
    """Greedy pick from the logits of the context's output i (-1: the last)."""
    import llama_cpp

    row = llama_cpp.llama_get_logits_ith(ctx, i)
    return int(np.argmax(np.ctypeslib.as_array(row, shape=(vocab,))))


def _kv_type(kv_type: str) -> int:
    """llama.cpp's GGML type of a KV cache precision: "f16" (its default) or "f32"."""
    import llama_cpp

    kv = {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32}
    if kv_type not in kv:
        raise ValueError(f"kv_type={kv_type!r}: one of {', '.join(kv)}")
    return kv[kv_type]
