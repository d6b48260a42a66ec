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


def conversation_prompts(prompt: list[int], slots: int, vocab: int) -> list[list[int]]:
    """The prompts of `slots` conversations: `prompt`, then others that share all but its last
    8 tokens (tails drawn from the tokenizer's byte range and merges, the same every run)."""
    head = len(prompt) - 8
    rng = np.random.default_rng(1)
    return [prompt] + [
        prompt[:head] + rng.integers(0, min(vocab, 4096), 8).tolist() for _ in range(1, slots)
    ]


def other_conversations(runner, prompt: list[int], slots: int) -> list[int]:
    """Fill slots 1..slots-1 with the other conversations of `conversation_prompts`, slot 0
    holding `prompt` (slot 0's KV copied up to where they part). Their first greedy tokens."""
    head = len(prompt) - 8
    kv = runner.export_slot(0, head)
    firsts = []
    others = conversation_prompts(prompt, slots, runner.model.cfg.vocab_size)[1:]
    for s, other in enumerate(others, start=1):
        runner.import_slot(s, kv)
        logits, _ = runner.prefill(s, other[head:], start=head)
        firsts.append(int(np.argmax(logits)))
    return firsts
