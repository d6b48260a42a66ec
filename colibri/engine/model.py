"""A checkpoint opened for running: config, tokenizer, dense weights on device, an expert store."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import jax

from colibri import formats, hugepages
from colibri.checkpoint import PACKED_BITS, Checkpoint
from colibri.config import ModelConfig, load_config
from colibri.experts.budget import TierConfig
from colibri.experts.store import ExpertStore
from colibri.jaxcache import enable_compilation_cache
from colibri.model import parallel
from colibri.tokenizer import Tokenizer
from colibri.weights import fuse_qkv, hold_bf16, holds_bf16, load_dense

log = logging.getLogger("colibri")

# The tensors beside a quantized weight (its scales, packed words, shape): not parameters.
_FP8_SCALES = ("_scale_inv", "_scales_inv")


@dataclass
class LoadedModel:
    cfg: ModelConfig
    ckpt: Checkpoint
    tokenizer: Tokenizer | None
    params: dict  # dense weights (embeddings, attention, norms, routers, shared experts), device
    store: ExpertStore  # routed experts across device slots, RAM and disk

    @property
    def dir(self) -> Path:
        return self.ckpt.dir

    @property
    def experts(self) -> list | None:
        """Per MoE layer stacked experts when all are resident, else None."""
        return self.store.resident


def load_model(
    model_dir: str | Path,
    tiers: TierConfig | None = None,
    usage_path: str | Path | None = None,
    progress: bool = True,
    holding: formats.Holding = formats.HOLD_ALL,
) -> LoadedModel:
    """Open a Hugging Face MoE checkpoint folder; routed experts placed as `tiers` says,
    matrices kept in the held formats `holding` allows."""
    enable_compilation_cache()
    model_dir = Path(model_dir)
    cfg = load_config(model_dir)
    ckpt = Checkpoint(model_dir)
    tok_path = model_dir / "tokenizer.json"
    tokenizer = Tokenizer(tok_path) if tok_path.exists() else None
    bf16 = holds_bf16(ckpt, holding)
    dense = fuse_qkv(load_dense(ckpt, cfg, holding))
    if bf16:
        dense = hold_bf16(dense, holding.bf16_storage)
    # On 2 MiB pages, as the routed experts are: the linear calls stream these every step.
    params = parallel.replicated(hugepages.hold(dense) if jax.default_backend() == "cpu" else dense)
    store = ExpertStore(ckpt, cfg, tiers or TierConfig(), usage_path, progress, holding)
    n_dense = sum(  # weights as the checkpoint names them, quantized ones by their values
        math.prod(t.shape)
        for name, t in ckpt.tensors.items()
        if ".experts." not in name
        and not name.endswith(_FP8_SCALES)
        and name not in ckpt.companions
    )
    n_routed = 3 * cfg.moe.moe_ff * cfg.hidden * store.E * len(cfg.moe_layer_ids)
    how = "bfloat16 ones held as bfloat16" if bf16 else "held as float32"
    if bf16 and holding.bf16_products:
        how += ", their products in bfloat16"
    packed = sorted({t.dtype for t in ckpt.tensors.values() if t.dtype in PACKED_BITS})
    held = formats.of(store.held)
    if held.scaled:
        how += f", routed experts as {held.what}"
    elif packed:
        bits = "/".join(f"int{PACKED_BITS[k]}" for k in packed)
        kind = {"PACK": "pack-quantized", "GPTQ": "GPTQ", "AWQ": "AWQ"}[packed[0].rstrip("48")]
        how += f", {kind} {bits} weights dequantized to float32"
    stacks = jax.tree_util.tree_leaves(store.resident)
    on_cpu = [a for a in stacks if all(d.platform == "cpu" for d in a.devices())]
    shards = [b.data for a in on_cpu for b in a.addressable_shards]  # one a device
    huge = hugepages.huge_bytes([(b.unsafe_buffer_pointer(), b.nbytes) for b in shards])
    log.info(
        "loaded %s (%s, %.1fM dense + %.1fM routed parameters, %s; %d MiB of experts on huge "
        "pages); %s",
        model_dir,
        cfg.family,
        n_dense / 1e6,
        n_routed / 1e6,
        how,
        huge >> 20,
        store.summary(),
    )
    return LoadedModel(cfg, ckpt, tokenizer, params, store)
