"""Maps each family's Hugging Face tensor names onto colibri's parameter tree and expert slabs."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from colibri import hugepages
from colibri.checkpoint import PACKED_BITS, Checkpoint, CheckpointError, TensorInfo
from colibri.config import ModelConfig
from colibri.formats import BF16_BITS, FP8_ROWS, HOLD_ALL, PACKED_ROWS, Holding, of

Params = dict[str, Any]

log = logging.getLogger("colibri")


# Families whose MoE blocks carry Mixtral's names: block_sparse_moe, experts' w1, w3, w2
MIXTRAL_NAMES = ("mixtral", "minimax_m2")


def moe_prefix(cfg: ModelConfig, layer: int) -> str:
    """The MoE block of a layer: its router, experts and shared experts sit under it."""
    block = "block_sparse_moe" if cfg.family in MIXTRAL_NAMES else "mlp"
    return f"model.layers.{layer}.{block}"


def expert_names(cfg: ModelConfig) -> tuple[str, str, str]:
    """A routed expert's gate, up and down projections."""
    if cfg.family in MIXTRAL_NAMES:
        return ("w1", "w3", "w2")
    return ("gate_proj", "up_proj", "down_proj")


def score_bias_name(cfg: ModelConfig, layer: int) -> str:
    """A sigmoid router's score-correction bias: in the router (DeepSeek-V3, GLM-4.5, dots1),
    beside it in the MoE block (MiniMax-M2)."""
    where = "" if cfg.family == "minimax_m2" else ".gate"
    return f"{moe_prefix(cfg, layer)}{where}.e_score_correction_bias"


@dataclass(frozen=True)
class ExpertSlab:
    """Where one routed expert's three matrices live: gate [F, D], up [F, D], down [D, F].

    Each part is (tensor, byte offset inside that tensor's range, byte count): one contiguous
    range per matrix, whether the checkpoint stores experts one by one or fused as [E, ...].
    """

    parts: tuple[tuple[TensorInfo, int, int], ...]  # gate, up, down

    @property
    def nbytes(self) -> int:
        return sum(n for _, _, n in self.parts)


def expert_slab(ckpt: Checkpoint, cfg: ModelConfig, layer: int, expert: int) -> ExpertSlab:
    """Byte ranges of expert `expert` of MoE layer `layer`."""
    p = f"{moe_prefix(cfg, layer)}.experts"
    per_expert = [f"{p}.{expert}.{n}.weight" for n in expert_names(cfg)]
    if per_expert[0] in ckpt:
        infos = [ckpt.info(n) for n in per_expert]
        return ExpertSlab(tuple((t, 0, t.nbytes) for t in infos))
    fused_gu = f"{_fused_prefix(cfg, layer)}.gate_up_proj"
    if fused_gu not in ckpt:
        ckpt.info(per_expert[0])  # raises, naming the per-expert tensor
    gu, down = ckpt.info(fused_gu), ckpt.info(f"{_fused_prefix(cfg, layer)}.down_proj")
    e_gu, e_down = gu.nbytes // gu.shape[0], down.nbytes // down.shape[0]
    half = e_gu // 2
    return ExpertSlab(
        (
            (gu, expert * e_gu, half),
            (gu, expert * e_gu + half, half),
            (down, expert * e_down, e_down),
        )
    )


def _fused_prefix(cfg: ModelConfig, layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts"


def holds_bf16(ckpt: Checkpoint, holding: Holding = HOLD_ALL) -> bool:
    """Whether colibri keeps this checkpoint's bfloat16 weights as bfloat16 (their bit
    patterns: half the memory and half the bytes a token reads) rather than widening them to
    float32 at load: when it has any, unless `holding.bf16` is off. Compute is float32 either way
    (unless `holding.bf16_products`): the CPU kernels widen each weight exactly as they load it
    and give bitwise what the weights widened at load give; XLA's products (prefill, GPU,
    kernels off), into which the widening is fused, give the same to float32 rounding."""
    return holding.bf16 and any(t.dtype == "BF16" for t in ckpt.tensors.values())


def hold_bf16(params: Params, held: np.dtype = BF16_BITS) -> Params:
    """`params` with every float32 matrix whose values are all bfloat16 numbers (as read from
    a bfloat16 checkpoint) as bfloat16 bits (`held`: BF16_BITS, or BF16_PRODUCTS for products
    in bfloat16, `Holding.bf16_storage`); vectors (norms, biases) and anything else as they
    are. `layers.linear` and the embedding lookup widen them as they use them."""

    def hold(a):
        if not isinstance(a, np.ndarray) or a.ndim != 2 or a.dtype != np.float32:
            return a
        bits = a.view(np.uint32)
        return a if (bits & 0xFFFF).any() else (bits >> 16).astype(np.uint16).view(held)

    return jax.tree.map(hold, params)


def expert_dtype(ckpt: Checkpoint, cfg: ModelConfig, holding: Holding = HOLD_ALL) -> np.dtype:
    """How the routed experts are held: as bfloat16 bits (BF16_BITS, or BF16_PRODUCTS with
    bfloat16 products) when the checkpoint stores every one in bfloat16 and `holds_bf16`; as FP8
    rows (FP8_ROWS: a quarter of the bytes of float32) when it stores every one block-quantized
    in float8_e4m3fn with whole column blocks of a multiple of 8, unless `holding.fp8` is off;
    as int4 rows (INT4_ROWS: about an eighth) when it stores every one pack-quantized (or GPTQ-
    or AWQ-quantized) in four bits with one group width for gate and up and one for down
    (`expert_groups`), unless `holding.int4` is none, as INT4Z_ROWS (with each group's offset)
    if any has zero points; as int8 rows (INT8_ROWS: about a quarter) when every one is in eight
    bits likewise, unless `holding.int8` is none; else as float32 (other pack-quantized experts
    are dequantized as they are read, GPTQ's with activation order among them)."""
    parts = [
        t
        for layer in cfg.moe_layer_ids
        for e in range(cfg.moe.num_experts)
        for t, _, _ in expert_slab(ckpt, cfg, layer, e).parts
    ]
    dtypes = {t.dtype for t in parts}
    if dtypes == {"BF16"} and holds_bf16(ckpt, holding):
        return holding.bf16_storage
    fit = fp8_rows_fit(ckpt, cfg.hidden) and fp8_rows_fit(ckpt, cfg.moe.moe_ff)
    if dtypes == {"F8_E4M3"} and fit and holding.fp8:
        return FP8_ROWS
    bits = {PACKED_BITS.get(d) for d in dtypes}
    if len(bits) == 1 and bits <= {4, 8} and holding.packed(bits.pop()):
        fits = {t: ckpt.packed_fit(t) for t in dict.fromkeys(parts)}  # each matrix's scales once
        helds = {held for _, held in fits.values()}
        if None not in helds and all(expert_groups(ckpt, parts, fits)):
            return max(helds, key=PACKED_ROWS.index)  # int4 rows with offsets hold any int4
    return np.dtype(np.float32)


def expert_groups(
    ckpt: Checkpoint, parts: list[TensorInfo], fits: dict | None = None
) -> tuple[int, int]:
    """The group widths of pack-quantized experts' rows as INT4_ROWS (INT4Z_ROWS, INT8_ROWS)
    hold them: (gate and up, down), each 0 unless every such matrix among `parts` (gate, up,
    down, gate, ...) fits the one (`fits`: their `Checkpoint.packed_fit`s where found)."""
    fits = fits or {}
    found = []
    for which in (slice(0, None, 3), slice(1, None, 3), slice(2, None, 3)):
        widths = {
            (fits[t] if t in fits else ckpt.packed_fit(t))[0] for t in dict.fromkeys(parts[which])
        }
        found.append(widths.pop() if len(widths) == 1 else 0)
    gate, up, down = found
    return (gate if gate == up else 0), down


def row_blocks(ckpt: Checkpoint, cfg: ModelConfig, held: np.dtype) -> tuple[int, int]:
    """The scale block widths of routed experts' rows as held (`held_cols`): for rows of D
    weights (gate, up) and of F (down); (0, 0) for float32 and bfloat16."""
    if np.dtype(held) == FP8_ROWS:
        return ckpt.fp8_block[1], ckpt.fp8_block[1]
    if np.dtype(held) in PACKED_ROWS:
        layer = cfg.moe_layer_ids[0]
        return expert_groups(ckpt, [t for t, _, _ in expert_slab(ckpt, cfg, layer, 0).parts])
    return 0, 0


def fp8_rows_fit(ckpt: Checkpoint, cols: int) -> bool:
    """Whether rows of `cols` weights can be held as FP8 rows: whole column blocks of a
    multiple of 8 (the kernels widen eight at a time)."""
    b1 = ckpt.fp8_block[1]
    return b1 % 8 == 0 and cols % b1 == 0


def held_cols(n: int, held: np.dtype, block: int) -> int:
    """Elements a matrix row of n weights takes held as `held` (`formats.HeldFormat`)."""
    try:
        return of(held).row_elements(n, block)
    except ValueError as err:
        raise CheckpointError(str(err)) from None


def expert_shapes(
    cfg: ModelConfig, held: np.dtype, blocks: tuple[int, int] = (0, 0)
) -> dict[str, tuple]:
    """One expert's matrices as held: gate and up [F, D], down [D, F], their rows as
    `held_cols` says (`blocks`: the scale block widths of rows of D and of F, `row_blocks`)."""
    F, D = cfg.moe.moe_ff, cfg.hidden
    row_d, row_f = held_cols(D, held, blocks[0]), held_cols(F, held, blocks[1])
    return {"gate": (F, row_d), "up": (F, row_d), "down": (D, row_f)}


def read_expert(
    ckpt: Checkpoint,
    cfg: ModelConfig,
    slab: ExpertSlab,
    held: np.dtype = np.float32,
    blocks: tuple[int, int] | None = None,
) -> tuple[np.ndarray, ...]:
    """One expert's (gate, up, down) as `expert_shapes` (float32, bfloat16 bits for a bfloat16
    checkpoint, FP8 rows for a block-quantized one, int4 rows for a pack-quantized one;
    `blocks`: `row_blocks`, found here when not given)."""
    blocks = row_blocks(ckpt, cfg, held) if blocks is None else blocks
    shapes = expert_shapes(cfg, held, blocks).values()
    out = []
    for (t, off, n), shape in zip(slab.parts, shapes, strict=True):
        flat = ckpt.read_part(t, off, n, held)
        if flat.size != shape[0] * shape[1]:
            raise CheckpointError(
                f"{t.path}: expert slab of {t.name!r} has {flat.size} values, expected {shape}"
            )
        out.append(flat.reshape(shape))
    return tuple(out)


def load_dense(ckpt: Checkpoint, cfg: ModelConfig, holding: Holding = HOLD_ALL) -> Params:
    """Every weight except routed experts, as float32 numpy arrays, shape-checked; a
    block-quantized checkpoint's FP8 matrices as FP8 rows where they fit (`holding.fp8`), a
    pack-quantized one's int4 and int8 matrices as their rows where they fit
    (`holding.packed`)."""
    _note_mtp(ckpt, cfg)
    ckpt = _Matrices(ckpt, holding.fp8, {b: holding.packed(b, dense=True) for b in (4, 8)})
    D, V = cfg.hidden, cfg.vocab_size
    embed = ckpt.read("model.embed_tokens.weight", (V, D))
    if cfg.tie_word_embeddings and "lm_head.weight" not in ckpt:
        head = embed
    else:
        head = ckpt.read("lm_head.weight", (V, D))
    layers = [_load_layer(ckpt, cfg, i) for i in range(cfg.num_layers)]
    return {
        "embed": embed,
        "lm_head": head,
        "final_norm": ckpt.read("model.norm.weight", (D,)),
        "layers": layers,
    }


_QKV = ("q", "k", "v", "q_bias", "k_bias", "v_bias")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def mtp_layers(ckpt: Checkpoint, cfg: ModelConfig) -> list[int]:
    """Layers the checkpoint holds past num_hidden_layers: the multi-token prediction layer
    DeepSeek-V3, -V3.2 and GLM-5 ship, which transformers ignores (and colibri too)."""
    names = getattr(ckpt, "tensors", {})
    found = {int(m.group(1)) for name in names if (m := _LAYER.match(name))}
    return sorted(i for i in found if i >= cfg.num_layers)


def _note_mtp(ckpt: Checkpoint, cfg: ModelConfig) -> None:
    extra = mtp_layers(ckpt, cfg)
    if extra:
        names = ", ".join(f"model.layers.{i}.*" for i in extra)
        log.info("%s: not loaded (multi-token prediction, which transformers ignores)", names)


class _Matrices:
    """The checkpoint as load_dense reads it: FP8 matrices as FP8 rows where they fit (when
    `fp8`), pack-quantized ones as their rows where they fit (when `packed[bits]`: INT4_ROWS,
    INT4Z_ROWS with zero points, INT8_ROWS), everything else as float32."""

    def __init__(self, ckpt: Checkpoint, fp8: bool, packed: dict[int, bool]):
        self._ckpt, self._fp8, self._packed = ckpt, fp8, packed

    def __contains__(self, name: str) -> bool:
        return name in self._ckpt

    def read(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        held = np.dtype(np.float32)
        if shape is not None and len(shape) == 2:
            t = self._ckpt.info(name)
            if self._fp8 and t.dtype == "F8_E4M3" and fp8_rows_fit(self._ckpt, shape[1]):
                held = FP8_ROWS
            elif self._packed.get(PACKED_BITS.get(t.dtype)) and t.shape == tuple(shape):
                group, rows = self._ckpt.packed_fit(t)
                held = rows if group else held
        return self._ckpt.read(name, shape, held)


def _same_dtype(tree: Params, *names: str) -> bool:
    return len({tree[n].dtype for n in names}) == 1


def _same_rows(tree: Params, *names: str) -> bool:
    return len({tree[n].shape[1:] for n in names}) == 1


def fuse_qkv(dense: Params) -> Params:
    """`dense` with each GQA layer's q, k and v projections (and biases) stacked into one
    "qkv" matrix [(H + 2 Hkv) Dh, D], so a forward reads them in one linear call: on the CPU
    kernels, one call three times the size shares out better between the threads, and every
    output is still its own dot product (bitwise those of the three calls). MLA layers and
    trees already fused are left as they are."""
    layers = []
    for lw in dense["layers"]:
        attn = lw["attn"]
        qkv = all(name in attn for name in ("q", "k", "v"))
        if qkv and _same_dtype(attn, "q", "k", "v") and _same_rows(attn, "q", "k", "v"):
            w = {name: a for name, a in attn.items() if name not in _QKV}
            w["qkv"] = np.concatenate([attn[name] for name in ("q", "k", "v")])
            if "q_bias" in attn:
                w["qkv_bias"] = np.concatenate([attn[f"{name}_bias"] for name in ("q", "k", "v")])
            lw = {**lw, "attn": w}
        layers.append(lw)
    return {**dense, "layers": layers}


def expert_stacks(
    cfg: ModelConfig, dtype: np.dtype = np.float32, blocks: tuple[int, int] = (0, 0)
) -> dict[str, np.ndarray]:
    """Room for one layer's stacked experts (uninitialised, as `expert_shapes` with E first),
    on huge pages where Linux gives them (decode streams these; see hugepages.py)."""
    E = cfg.moe.num_experts
    shapes = expert_shapes(cfg, dtype, blocks)
    return {k: hugepages.empty((E, *shape), dtype) for k, shape in shapes.items()}


def load_experts(
    ckpt: Checkpoint, cfg: ModelConfig, layer: int, out: dict[str, np.ndarray] | None = None
) -> dict[str, np.ndarray]:
    """All routed experts of one layer stacked into `out` (default: new float32
    `expert_stacks(cfg)`), held as its arrays' dtype (float32, bfloat16 bits, FP8 or int4
    rows)."""
    out = expert_stacks(cfg) if out is None else out
    held = out["gate"].dtype
    blocks = row_blocks(ckpt, cfg, held)
    slabs = [
        read_expert(ckpt, cfg, expert_slab(ckpt, cfg, layer, e), held, blocks)
        for e in range(cfg.moe.num_experts)
    ]
    for i, k in enumerate(("gate", "up", "down")):
        np.stack([s[i] for s in slabs], out=out[k])
    return out


def _load_layer(ckpt: Checkpoint, cfg: ModelConfig, i: int) -> Params:
    p = f"model.layers.{i}"
    D = cfg.hidden
    layer: Params = {
        "ln1": ckpt.read(f"{p}.input_layernorm.weight", (D,)),
        "ln2": ckpt.read(f"{p}.post_attention_layernorm.weight", (D,)),
        "attn": _load_mla(ckpt, cfg, p) if cfg.attention == "mla" else _load_gqa(ckpt, cfg, p),
    }
    if cfg.dsa is not None and not cfg.dsa.shared[i]:  # shared layers reuse an earlier selection
        layer["attn"]["indexer"] = _load_indexer(ckpt, cfg, f"{p}.self_attn.indexer")
    if cfg.moe_layers[i]:
        layer["moe"] = _load_moe(ckpt, cfg, i)
    else:
        layer["mlp"] = _load_mlp(ckpt, f"{p}.mlp", D, cfg.dense_ff)
    return layer


def _load_mlp(ckpt: Checkpoint, p: str, D: int, F: int) -> Params:
    return {
        "gate": ckpt.read(f"{p}.gate_proj.weight", (F, D)),
        "up": ckpt.read(f"{p}.up_proj.weight", (F, D)),
        "down": ckpt.read(f"{p}.down_proj.weight", (D, F)),
    }


def _load_gqa(ckpt: Checkpoint, cfg: ModelConfig, p: str) -> Params:
    D, H, Hkv, Dh = cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    a = f"{p}.self_attn"
    w: Params = {
        "q": ckpt.read(f"{a}.q_proj.weight", (H * Dh, D)),
        "k": ckpt.read(f"{a}.k_proj.weight", (Hkv * Dh, D)),
        "v": ckpt.read(f"{a}.v_proj.weight", (Hkv * Dh, D)),
        "o": ckpt.read(f"{a}.o_proj.weight", (D, H * Dh)),
    }
    if cfg.qkv_bias:
        w["q_bias"] = ckpt.read(f"{a}.q_proj.bias", (H * Dh,))
        w["k_bias"] = ckpt.read(f"{a}.k_proj.bias", (Hkv * Dh,))
        w["v_bias"] = ckpt.read(f"{a}.v_proj.bias", (Hkv * Dh,))
    if cfg.o_bias:
        w["o_bias"] = ckpt.read(f"{a}.o_proj.bias", (D,))
    if cfg.qk_norm == "head":
        w["q_norm"] = ckpt.read(f"{a}.q_norm.weight", (Dh,))
        w["k_norm"] = ckpt.read(f"{a}.k_norm.weight", (Dh,))
    elif cfg.qk_norm == "full":
        w["q_norm"] = ckpt.read(f"{a}.q_norm.weight", (H * Dh,))
        w["k_norm"] = ckpt.read(f"{a}.k_norm.weight")
    return w


def _load_mla(ckpt: Checkpoint, cfg: ModelConfig, p: str) -> Params:
    m = cfg.mla
    assert m is not None
    D, H = cfg.hidden, cfg.num_heads
    a = f"{p}.self_attn"
    w: Params = {}
    if m.q_lora_rank is None:
        w["q"] = ckpt.read(f"{a}.q_proj.weight", (H * m.qk_head_dim, D))
    else:
        w["q_a"] = ckpt.read(f"{a}.q_a_proj.weight", (m.q_lora_rank, D))
        w["q_a_norm"] = ckpt.read(f"{a}.q_a_layernorm.weight", (m.q_lora_rank,))
        w["q_b"] = ckpt.read(f"{a}.q_b_proj.weight", (H * m.qk_head_dim, m.q_lora_rank))
    w["kv_a"] = ckpt.read(
        f"{a}.kv_a_proj_with_mqa.weight", (m.kv_lora_rank + m.qk_rope_head_dim, D)
    )
    w["kv_a_norm"] = ckpt.read(f"{a}.kv_a_layernorm.weight", (m.kv_lora_rank,))
    w["kv_b"] = ckpt.read(
        f"{a}.kv_b_proj.weight", (H * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
    )
    w["o"] = ckpt.read(f"{a}.o_proj.weight", (D, H * m.v_head_dim))
    if cfg.qkv_bias:
        if m.q_lora_rank is not None:
            w["q_a_bias"] = ckpt.read(f"{a}.q_a_proj.bias", (m.q_lora_rank,))
        w["kv_a_bias"] = ckpt.read(
            f"{a}.kv_a_proj_with_mqa.bias", (m.kv_lora_rank + m.qk_rope_head_dim,)
        )
    if cfg.o_bias:
        w["o_bias"] = ckpt.read(f"{a}.o_proj.bias", (D,))
    return w


def _load_indexer(ckpt: Checkpoint, cfg: ModelConfig, p: str) -> Params:
    """DSA's lightning indexer: query and key projections, the keys' LayerNorm (with a bias),
    and the per-head weights of the scores."""
    d, m = cfg.dsa, cfg.mla
    assert d is not None and m is not None and m.q_lora_rank is not None
    return {
        "wq_b": ckpt.read(f"{p}.wq_b.weight", (d.n_heads * d.head_dim, m.q_lora_rank)),
        "wk": ckpt.read(f"{p}.wk.weight", (d.head_dim, cfg.hidden)),
        "k_norm": ckpt.read(f"{p}.k_norm.weight", (d.head_dim,)),
        "k_norm_bias": ckpt.read(f"{p}.k_norm.bias", (d.head_dim,)),
        "weights": ckpt.read(f"{p}.weights_proj.weight", (d.n_heads, cfg.hidden)),
    }


def _load_moe(ckpt: Checkpoint, cfg: ModelConfig, i: int) -> Params:
    p = moe_prefix(cfg, i)
    m, D = cfg.moe, cfg.hidden
    w: Params = {"router": ckpt.read(f"{p}.gate.weight", (m.num_experts, D))}
    if m.router == "sigmoid_group":
        bias = score_bias_name(cfg, i)
        w["bias"] = (
            ckpt.read(bias, (m.num_experts,))
            if bias in ckpt
            else np.zeros(m.num_experts, np.float32)
        )
    if cfg.family == "qwen2_moe" and m.shared_ff:
        w["shared"] = _load_mlp(ckpt, f"{p}.shared_expert", D, m.shared_ff)
        w["shared_gate"] = ckpt.read(f"{p}.shared_expert_gate.weight", (1, D))
    elif m.shared_ff:
        w["shared"] = _load_mlp(ckpt, f"{p}.shared_experts", D, m.shared_ff)
    return w
