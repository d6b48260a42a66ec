"""A checkpoint loaded for running: config, tokenizer, dense weights and experts on device."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from colibri.checkpoint import Checkpoint
from colibri.config import ModelConfig, load_config
from colibri.jaxcache import enable_compilation_cache
from colibri.tokenizer import Tokenizer
from colibri.weights import load_dense, load_experts

log = logging.getLogger("colibri")


@dataclass
class Model:
    cfg: ModelConfig
    ckpt: Checkpoint
    tokenizer: Tokenizer | None
    params: dict  # dense weights, device arrays
    experts: list  # per MoE layer: stacked gate/up/down, device arrays (all resident)

    @property
    def dir(self) -> Path:
        return self.ckpt.dir


def load_model(model_dir: str | Path, progress: bool = True) -> Model:
    """Read config, tokenizer and every weight of a Hugging Face MoE checkpoint folder."""
    enable_compilation_cache()
    model_dir = Path(model_dir)
    cfg = load_config(model_dir)
    ckpt = Checkpoint(model_dir)
    tok_path = model_dir / "tokenizer.json"
    tokenizer = Tokenizer(tok_path) if tok_path.exists() else None
    params = jax.device_put(load_dense(ckpt, cfg))
    layers = cfg.moe_layer_ids
    experts = []
    for i in tqdm(layers, desc="experts", unit="layer", disable=not progress, leave=False):
        experts.append(jax.device_put(load_experts(ckpt, cfg, i)))
    n_params = sum(int(np.prod(a.shape)) for a in jax.tree_util.tree_leaves((params, experts)))
    log.info("loaded %s (%s, %.1fM parameters)", model_dir, cfg.family, n_params / 1e6)
    return Model(cfg, ckpt, tokenizer, params, experts)
