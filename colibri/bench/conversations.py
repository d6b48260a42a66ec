"""The conversations the benchmarks decode: a fixed prompt, other conversations that share all
but its last 8 tokens, and BURST and STREAM_MS, which bound the greedy steps the engine takes a
forward."""

from __future__ import annotations

import numpy as np

from colibri.engine.settings import EngineSettings

BURST = EngineSettings().burst  # greedy steps a forward at most, as the engine takes them
STREAM_MS = EngineSettings().stream_ms  # and no more than the recent steps say fit in this


def prompt_ids(vocab: int, n: int) -> list[int]:
    """A fixed prompt of n token ids drawn from the tokenizer's byte range and merges."""
    return np.random.default_rng(7).integers(0, min(vocab, 4096), n).tolist()


def other_conversations(runner, prompt: list[int], slots: int) -> list[int]:
    """Fill slots 1..slots-1 with other conversations, slot 0 holding `prompt`: the prompt with
    its last 8 tokens changed (slot 0's KV copied up to there). Their first greedy tokens."""
    head = len(prompt) - 8
    kv = runner.export_slot(0, head)
    rng = np.random.default_rng(1)
    firsts = []
    for s in range(1, slots):
        runner.import_slot(s, kv)
        tail = rng.integers(0, min(runner.model.cfg.vocab_size, 4096), 8).tolist()
        logits, _ = runner.prefill(s, tail, start=head)
        firsts.append(int(np.argmax(logits)))
    return firsts
