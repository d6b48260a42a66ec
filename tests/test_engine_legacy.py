"""The legacy protocol and `colibri chat` on it: the real subprocess on a tiny checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from engine_util import Legacy, Reference

from colibri.protocol import legacy
from colibri.protocol.codec import READY_LINE, Stat

CTX = 128
NGEN = 6
END = legacy.END_LINE


@pytest.fixture(scope="module")
def model_dir(checkpoints):
    return checkpoints("qwen3_moe")


@pytest.fixture(scope="module")
def ref(model_dir):
    return Reference(model_dir, CTX)


def _answer(e: Legacy) -> tuple[bytes, Stat]:
    text = e.read_until(END)[: -len(END)]
    line = e.read_until(b"\n")
    kind, *fields = line[:-1].split(b" ")
    assert kind == b"STAT"
    return text, Stat.from_fields(fields)


def _bytes(ref: Reference, ids: list[int]) -> bytes:
    return b"".join(ref.tokenizer.token_bytes(t) for t in ids)


def test_legacy_session(model_dir, ref):
    enc = ref.tokenizer.encode
    e = Legacy(model_dir, KV_SLOTS="2", CTX=str(CTX), NGEN=str(NGEN))
    try:
        assert e.read_until(READY_LINE + b"\n") == READY_LINE + b"\n"
        assert e.read_until(b"\n").startswith(b"STAT 0 0.00 0.0 ")

        # a plain line, then MORE continues exactly where NGEN cut the answer
        conv = enc("The quick brown\n")
        full = ref.ids(conv, 2 * NGEN)
        e.send(b"The quick brown\n")
        first, stat = _answer(e)
        assert first == _bytes(ref, full[:NGEN]) and stat.emitted == NGEN
        e.send(b"\x02MORE\n")
        more, stat = _answer(e)
        assert first + more == _bytes(ref, full) and stat.emitted == len(full) - NGEN

        # the next line extends the conversation: its tokens follow the answers
        conv = conv + full + enc("Der schnelle\n")
        e.send(b"Der schnelle\n")
        assert _answer(e)[0] == _bytes(ref, ref.ids(conv, NGEN))

        # RESET forgets it (no reply): nothing to continue, and the same line answers the same
        e.send(b"\x02RESET\n\x02MORE\n")
        assert _answer(e)[0] == b""
        e.send(b"The quick brown\n")
        assert _answer(e)[0] == first

        # the pre-mux API frame: a rendered prompt into a KV slot, max_tokens capped by NGEN
        prompt = b"Le renard brun"
        e.send(b"\x02PROMPT %d 50 0.0 1.0 1\n%s\n" % (len(prompt), prompt))
        text, stat = _answer(e)
        assert text == ref.text("Le renard brun", NGEN) and stat.emitted == NGEN

        # refused frames get an empty answer; the engine goes on
        e.send(b"\x02PROMPT 3 5 9.0 1.0\nabc\n")  # temperature out of range
        assert _answer(e)[0] == b""
        e.send(b"\x02BOGUS\n")
        assert _answer(e)[0] == b""
        e.send(b"\x02PROMPT 3 5 zero 1.0\nabc\n")  # refused; its payload is not a prompt line
        assert _answer(e)[0] == b""
        e.send(b"\x02MORE\n")  # continues the PROMPT's answer
        assert text + _answer(e)[0] == ref.text("Le renard brun", 2 * NGEN)
        e.send(b"x " * 200 + b"\n")  # longer than CTX
        assert _answer(e)[1].emitted == 0
        assert e.close() == 0
    finally:
        e.kill()
    assert "Traceback" not in e.stderr()


def test_chat_client(model_dir, ref):
    cmd = [sys.executable, "-m", "colibri.cli", "chat", "--model", str(model_dir)]
    stdin = b"The quick brown\n\n/more\n/reset\nThe quick brown\n"
    env = {"NGEN": str(NGEN), "CTX": str(CTX), "KV_SLOTS": "2"}
    r = subprocess.run(
        cmd, input=stdin, capture_output=True, timeout=120, env={**os.environ, **env}
    )
    assert r.returncode == 0, r.stderr.decode()
    full = _bytes(ref, ref.ids(ref.tokenizer.encode("The quick brown\n"), 2 * NGEN))
    first = _bytes(ref, ref.ids(ref.tokenizer.encode("The quick brown\n"), NGEN))
    assert r.stdout == first + b"\n" + full[len(first) :] + b"\n" + first + b"\n"
