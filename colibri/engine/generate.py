"""Single-conversation generation on top of the runner: the `colibri generate` path."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from colibri.engine.runner import Row, Runner
from colibri.engine.sampling import sample


def generate_ids(
    runner: Runner,
    prompt: list[int],
    max_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_ids: tuple[int, ...] = (),
    slot: int = 0,
) -> Iterator[int]:
    """Yield up to max_tokens new token ids after `prompt` (a stop id ends it, unyielded)."""
    if not prompt:
        raise ValueError("empty prompt")
    if len(prompt) + max_tokens - 1 > runner.capacity:  # the last token is never fed back
        raise ValueError(
            f"prompt of {len(prompt)} tokens + {max_tokens} new exceeds the context of "
            f"{runner.capacity}"
        )
    rng = np.random.default_rng(seed)
    logits, _ = runner.prefill(slot, prompt)
    pos = len(prompt)
    for i in range(max_tokens):
        tok = sample(logits, temperature, top_p, rng)
        if tok in stop_ids:
            return
        yield tok
        if i + 1 < max_tokens:
            logits = runner.decode([Row(slot, tok, pos)])[0][0]
            pos += 1
