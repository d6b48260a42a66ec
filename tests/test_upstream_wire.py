"""colibri's engine under colibrì's own gateway: the launch convention of its C binary, the
`upstream` wire profile, PROF, the 7th SUBMIT field, CANCEL and STOP, all through real
subprocesses read by a server written the strict way (`strict_server.StrictEngine`)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from engine_util import Reference
from strict_server import TEN, StrictEngine, colibri_engine, upstream_env

PROMPTS = ["The quick brown fox", "def add(a, b):", "Le renard brun", "naïve café"]
SCHEMA = b'{"type": "object", "properties": {"name": {"type": "string"}}}'
GBNF = b'root ::= "{" ws "}"\nws ::= [ \\t\\n]*\n'


@pytest.fixture(scope="module")
def model_dir(checkpoints):
    return checkpoints("qwen3_moe")


@pytest.fixture(scope="module")
def ref(model_dir):
    return Reference(model_dir, capacity=256)


def engine(model_dir, *args: str, kv_slots: int = 1, **env: str) -> StrictEngine:
    """`colibri-engine <args>` as colibrì's gateway starts it."""
    cmd = [colibri_engine(), *args]
    return StrictEngine(cmd, upstream_env(model_dir, kv_slots, CTX="256", **env))


def check_turn(r, n_prompt: int) -> None:
    """PROF right before DONE, its numbers those of DONE."""
    assert r.done is not None, r.error
    emitted, tok_s, prompt_tokens = int(r.done[3]), float(r.done[4]), int(r.done[7])
    assert prompt_tokens == n_prompt and r.prof is not None
    wall, p_prompt, p_completion = float(r.prof[1]), int(r.prof[2]), int(r.prof[3])
    times, forwards = [float(x) for x in r.prof[4:9]], int(r.prof[9])
    assert (p_prompt, p_completion) == (prompt_tokens, emitted)
    assert min(times) >= 0 and forwards >= emitted  # a prefill, then a step per later token
    if emitted > 1:  # DONE's rate is over the decode window, which lies inside the wall time
        assert (emitted - 1) / tok_s <= wall + 0.01


def test_launch_convention_and_an_upstream_turn(model_dir, ref):
    eng = engine(model_dir, "8", kv_slots=2)
    try:
        r = eng.generate(1, PROMPTS[0], 12)
        assert r.text == ref.text(PROMPTS[0], 12)
        check_turn(r, len(ref.tokenizer.encode(PROMPTS[0])))
        assert set(eng.kinds) <= TEN and eng.kinds["PROF"] == 1 and eng.kinds["HITS"] >= 1
        assert eng.failed is None
    finally:
        status = eng.close()
    assert status == 0 and "upstream wire" in eng.stderr()


def test_placement_never_changes_tokens_under_a_small_cap(model_dir, ref):
    eng = engine(model_dir, "3")  # 3 of 8 experts a layer on the device: staged as routed
    try:
        for i, prompt in enumerate(PROMPTS, 1):
            assert eng.generate(i, prompt, 10).text == ref.text(prompt, 10)
        assert eng.failed is None
        rows, cols = int(eng.latest["EMAP"][1]), int(eng.latest["EMAP"][2])
        device = int(eng.latest["TIERS"][1])
        assert 0 < device <= 3 * rows < rows * cols
    finally:
        assert eng.close() == 0


def test_grammar_field_in_every_form_and_a_normal_turn_after(model_dir, ref):
    eng = engine(model_dir, kv_slots=2)
    want = ref.text(PROMPTS[1], 8)
    try:
        assert eng.generate(1, PROMPTS[1], 8, grammar=SCHEMA).text == want  # kept, changes nothing
        assert eng.generate(2, PROMPTS[1], 8, grammar=GBNF, slot=1).text == want
        assert eng.generate(3, PROMPTS[1], 8, grammar=b"root \xff\xfe").error == ["BAD_REQUEST"]
        assert eng.generate(4, PROMPTS[1], 8, grammar=b"root\0x").error == ["BAD_REQUEST"]
        big = b"x" * ((1 << 20) + 1)  # over colibrì's 1 MiB: drained, refused
        assert eng.generate(5, PROMPTS[1], 8, grammar=big).error == ["BAD_REQUEST"]
        assert eng.generate(6, PROMPTS[1], 8, grammar=b"", count=0).text == want
        r = eng.generate(7, PROMPTS[1], 8)
        assert r.text == want and r.prof is not None
        assert eng.failed is None and set(eng.kinds) <= TEN
    finally:
        assert eng.close() == 0


@pytest.mark.parametrize("delta", [-3, 3], ids=["count short", "count long"])
def test_a_wrong_grammar_count_is_fatal_and_work_in_flight_finishes(model_dir, delta):
    eng = engine(model_dir, kv_slots=2, NGEN="40")
    try:
        eng.submit(1, PROMPTS[0], 40)
        deadline = time.monotonic() + 60
        while not eng.partial(1) and time.monotonic() < deadline:
            time.sleep(0.01)
        eng.submit(2, PROMPTS[1], 8, slot=1, grammar=GBNF, count=len(GBNF) + delta)
        eng.send(b"CANCEL 1\n")  # never read: the stream lost its framing at request 2
        bad = eng.result(2)
        assert bad.error == ["BAD_FRAME"]
        first = eng.result(1)
        assert first.done is not None and first.emitted == 40 and first.prof is not None
        assert eng.proc.wait(timeout=60) == 0  # input is no longer read: the engine is done
    finally:
        eng.kill()


def test_cancel_and_stop(model_dir, ref):
    eng = engine(model_dir, kv_slots=2, NGEN="200")
    try:
        for rid, request in ((1, b"CANCEL 1\n"), (2, b"STOP 2\n")):
            eng.submit(rid, PROMPTS[2], 200, slot=rid - 1)
            deadline = time.monotonic() + 60
            while len(eng.partial(rid)) < 2 and time.monotonic() < deadline:
                time.sleep(0.005)
            eng.send(request)
        cancelled, stopped = eng.result(1), eng.result(2)
        assert cancelled.error == ["CANCELLED"] and cancelled.done is None
        assert stopped.done is not None and 0 < stopped.emitted < 200
        check_turn(stopped, len(ref.tokenizer.encode(PROMPTS[2])))
        assert ref.text(PROMPTS[2], stopped.emitted).startswith(stopped.text)
        eng.submit(3, PROMPTS[3], 4)
        eng.send(b"CANCEL 99\nSTOP 98\n")  # no such requests: NOT_FOUND, and nothing else
        assert eng.result(3).text == ref.text(PROMPTS[3], 4)
        assert eng.failed is None and set(eng.kinds) <= TEN
    finally:
        assert eng.close() == 0


@pytest.mark.parametrize("command", ["colibri-engine", "colibri engine"])
def test_a_strict_server_runs_turns_over_both_commands(model_dir, ref, command):
    """Several turns, two at once, a conversation continued in its slot; TOPK asked for and
    kept off the upstream wire."""
    if command == "colibri-engine":
        cmd = [colibri_engine()]
        env = upstream_env(model_dir, 2, CTX="256", SERVE_TOPK="1")
    else:
        cmd = [sys.executable, "-m", "colibri.cli", "engine", "--model", str(model_dir)]
        env = upstream_env(model_dir, 2, CTX="256", SERVE_TOPK="1", WIRE="upstream")
    eng = StrictEngine(cmd, env)
    try:
        eng.submit(1, PROMPTS[0], 10, slot=0)
        eng.submit(2, PROMPTS[1], 10, slot=1)
        first, second = eng.result(1), eng.result(2)
        assert first.text == ref.text(PROMPTS[0], 10) and second.text == ref.text(PROMPTS[1], 10)
        follow = PROMPTS[0] + " jumps over the lazy dog"
        third = eng.generate(3, follow, 6, slot=0)  # the slot's KV prefix is reused
        assert third.text == ref.text(follow, 6)
        for r, prompt in ((first, PROMPTS[0]), (second, PROMPTS[1]), (third, follow)):
            check_turn(r, len(ref.tokenizer.encode(prompt)))
        assert eng.failed is None and set(eng.kinds) <= TEN and eng.kinds["PROF"] == 3
    finally:
        assert eng.close() == 0


def test_launch_errors_are_one_line_and_status_2(model_dir):
    env = upstream_env(model_dir)
    del env["SNAP"]
    r = subprocess.run([colibri_engine()], env=env, capture_output=True, timeout=60)
    assert r.returncode == 2 and b"no model: set SNAP or pass --model" in r.stderr
    env = upstream_env(model_dir, WIRE="colibri")
    r = subprocess.run([colibri_engine(), "8"], env=env, capture_output=True, timeout=120)
    assert r.returncode == 2 and b"WIRE='colibri': expected full or upstream" in r.stderr
    r = subprocess.run([colibri_engine(), "-1"], env=upstream_env(model_dir), capture_output=True)
    assert r.returncode == 2 and b"cap -1" in r.stderr
