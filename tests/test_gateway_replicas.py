"""`colibri gateway --replicas 2`: two engine subprocesses behind one gateway, driven by the
official `openai` client and raw HTTP on loopback. The routing rule is tested directly first
(stub engines); then one real gateway (two slots and a one-request queue per replica) shows
conversations spread over the replicas, a conversation's next turn back on its replica and
slot, each replica's tokens those of a lone engine, and a replica killed mid-stream: its
requests end cleanly while the other's complete, and it is restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import threading

import httpx
import openai
import psutil
import pytest
from engine_util import Reference
from gateway_util import Gateway, wait_for

from colibri.gateway.app import Gateway as Routes
from colibri.gateway.engine_client import EngineClient
from colibri.gateway.replicas import Replicas, Unavailable
from colibri.gateway.slots import Affinity, QueueFull
from colibri.gateway.templates import load_chat_template

CTX = 32768  # room for streams still decoding when a replica is killed (as in test_gateway)
LONG = 30000  # max_tokens of a request that outlives the test's use of it
# Prompts whose greedy answers on the tiny checkpoint run long (no early end of text).
PROMPTS = ["The quick brown fox", "jumps over the lazy", "springt über den", "free of charge"]


# ---------------------------------------------------------------------------- routing rule


class StubEngine:
    """What `Replicas` (and `/health`) read of an engine: whether it runs, and why not."""

    cancelled = restarts = 0

    def __init__(self) -> None:
        self.alive, self.gone = True, None

    @property
    def why_down(self) -> str:
        return self.gone or "not ready"


def test_routing_prefix_first_then_the_least_loaded_replica():
    async def run():
        a, b = StubEngine(), StubEngine()
        reps = Replicas([a, b], slots=2, max_waiting=1)  # type: ignore[list-item]

        async def take(find, keep, prompt):
            r, slot = await reps.acquire(Affinity(find, keep), prompt)
            return r.index, slot

        assert await take(None, "x", "X asks") == (0, 0)  # idle: the lowest index
        assert await take(None, "y", "Y asks") == (1, 0)  # the fewest in flight
        assert await take(None, "z", "Z asks") == (0, 1)  # a tie: the lowest index
        for r, slot in ((0, 0), (0, 1), (1, 0)):
            reps[r].pool.release(slot)
        # y's next turn returns to replica 1's slot 0, though a new one would go to 0 ...
        assert await take("y", "y2", "Y asks, Y answers, Y asks again") == (1, 0)
        # ... and a plain completion continuing x's prompt to x's slot
        assert await take(None, None, "X asks, and more") == (0, 0)
        # loads 1 and 1: replica 1 still has a slot that never served, replica 0 has none
        assert await take(None, "w", "W asks") == (1, 1)
        assert await take(None, "q", "Q asks") == (0, 1)
        v = asyncio.ensure_future(take(None, "v", "V asks"))  # both full: 0's queue
        await asyncio.sleep(0)
        u = asyncio.ensure_future(take(None, "u", "U asks"))  # then 1's
        await asyncio.sleep(0)
        assert [(r.pool.busy, r.pool.waiting) for r in reps] == [(2, 1), (2, 1)]
        with pytest.raises(QueueFull):  # every queue full too
            await take(None, "t", "T asks")
        reps[1].pool.release(0)
        reps[0].pool.release(1)
        assert (await v, await u) == ((0, 1), (1, 0))  # each queue's slot, handed on
        for r in reps:
            for slot in range(2):
                r.pool.release(slot)
        a.alive, a.gone = False, "engine closed its output"
        assert await take(None, None, "X asks, and more, again") == (1, 1)  # x's replica is down
        b.alive = False
        msg = "replica 0: engine closed its output; replica 1: not ready"
        with pytest.raises(Unavailable, match=msg):
            await take(None, "s", "S asks")

    asyncio.run(run())


def test_a_lost_engine_is_named_until_the_next_one_serves():
    """`/health` gives a down replica's reason from its loss until its next engine is ready:
    during the backoff and during the restart alike."""

    async def run():
        exits = [sys.executable, "-c", "import sys; sys.exit(3)"]
        e = EngineClient(exits, os.environ, name="the engine")
        with pytest.raises(RuntimeError, match=r"closed its output \(exit status 3\)"):
            await e.start(timeout=30)
        assert not e.alive and e.why_down == "engine closed its output (exit status 3)"
        e.cmd = [sys.executable, "-c", "import time; time.sleep(60)"]  # starts, never READY
        supervisor = asyncio.create_task(e.supervise(timeout=60, backoff=(0.0, 0.0)))
        for _ in range(1000):
            if e.restarts:
                break
            await asyncio.sleep(0.01)
        assert e.restarts == 1 and not e.alive
        assert e.why_down == "restarting after: engine closed its output (exit status 3)"
        supervisor.cancel()
        e.kill()

    asyncio.run(run())


class ExitingEngine:
    """An engine whose process exits just after its liveness is first read."""

    cancelled = restarts = 0
    why_down = "engine exited (exit status -9)"

    def __init__(self) -> None:
        self.reads = 0

    @property
    def alive(self) -> bool:
        self.reads += 1
        return self.reads == 1


def test_health_reads_each_replica_once():
    """An engine that exits while `/health` is built is either up or down in all of it: the
    summary's status and the replica's agree."""
    gw = object.__new__(Routes)  # only the replicas and the slot count are read
    engines = [ExitingEngine(), StubEngine()]
    gw.replicas = Replicas(engines, slots=2, max_waiting=1)  # type: ignore[arg-type]
    gw.settings = type("Settings", (), {"kv_slots": 2})()
    h = gw.health_json(authorized=False)
    assert [h["status"]] + [r["status"] for r in h["replicas"]] == ["ok", "ok", "ok"]
    h = gw.health_json(authorized=False)
    assert [h["status"]] + [r["status"] for r in h["replicas"]] == ["degraded", "unavailable", "ok"]
    assert h["replicas"][0]["reason"] == "engine exited (exit status -9)"


# ---------------------------------------------------------------------------- a real gateway


@pytest.fixture(scope="module")
def model_dir(checkpoints):
    return checkpoints("qwen3_moe")


@pytest.fixture(scope="module")
def gateway(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("replicas") / "gateway.log"
    args = ["--replicas", "2", "--kv-slots", "2", "--max-queue", "1", "--ctx", str(CTX)]
    gw = Gateway(model_dir, *args, "--web", "", log=log)
    yield gw
    status = gw.close()
    assert status == 0, gw.logs()
    assert "Traceback" not in gw.logs(), gw.logs()


@pytest.fixture(scope="module")
def ref(model_dir):
    return Reference(model_dir, CTX)


@pytest.fixture
def client(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def expect(ref: Reference, model_dir, messages: list[dict], max_tokens: int) -> tuple[str, int]:
    """A lone engine's greedy answer to these messages, as the gateway renders them: (text,
    tokens)."""
    prompt = load_chat_template(model_dir).render(messages)
    ids = ref.ids(ref.tokenizer.encode(prompt), max_tokens)
    text = b"".join(ref.tokenizer.token_bytes(t) for t in ids).decode("utf-8", errors="replace")
    return text, len(ids)


def busy(gateway: Gateway) -> list[int]:
    return [r["busy"] for r in gateway.health().json()["replicas"]]


@contextlib.contextmanager
def streaming(gateway: Gateway, messages: list[dict], max_tokens: int = LONG):
    """A chat stream, entered once the engine accepted it (the response has begun); leaving
    it disconnects, which cancels what is left."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    url = gateway.url + "/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        assert r.status_code == 200
        yield r.iter_lines()


def idle(gateway: Gateway) -> None:
    wait_for(lambda: busy(gateway) == [0, 0], timeout=30)


def frame(line: str) -> dict:
    """One streamed chunk (`data: {...}`) as JSON."""
    return json.loads(line.removeprefix("data: "))


def delta(line: str) -> str:
    """The text of one streamed chat chunk."""
    return "".join(c["delta"].get("content", "") for c in frame(line)["choices"])


def test_new_conversations_spread_and_each_replica_answers_as_a_lone_engine(
    gateway, client, ref, model_dir
):
    first, second = chat(PROMPTS[0]), chat(PROMPTS[1])
    with streaming(gateway, first) as lines:  # idle: replica 0
        assert busy(gateway) == [1, 0]
        b = client.chat.completions.create(model="m", messages=second, max_tokens=12, temperature=0)
        text = ""  # the first one's opening tokens, while it still runs
        for line in lines:
            if '"content"' in line:
                text += delta(line)
            if len(text) >= 24:
                break
    assert b.model_extra["colibri"]["stats"]["replica"] == 1  # the fewest in flight
    want, n = expect(ref, model_dir, second, 12)
    assert b.choices[0].message.content == want and b.usage.completion_tokens == n
    lone, _ = expect(ref, model_dir, first, 64)
    assert len(lone) > len(text) and lone.startswith(text)  # replica 0's tokens, the same
    idle(gateway)


def test_a_next_turn_returns_to_its_replica_and_slot(gateway, client, ref, model_dir):
    first = chat("Le renard brun rapide")
    with streaming(gateway, chat(PROMPTS[2])):  # replica 0 busy: the new conversation goes to 1
        a = client.chat.completions.create(model="m", messages=first, max_tokens=6, temperature=0)
    idle(gateway)
    second = [
        *first,
        {"role": "assistant", "content": a.choices[0].message.content},
        {"role": "user", "content": "saute par-dessus"},
    ]
    b = client.chat.completions.create(model="m", messages=second, max_tokens=6, temperature=0)
    sa, sb = a.model_extra["colibri"]["stats"], b.model_extra["colibri"]["stats"]
    assert sa["replica"] == 1 and (sb["replica"], sb["slot"]) == (1, sa["slot"])
    assert sb["reused_tokens"] >= sa["prompt_tokens"] - 1  # replica 1 kept the first turn's KV
    assert b.choices[0].message.content == expect(ref, model_dir, second, 6)[0]
    fresh = client.chat.completions.create(
        model="m", messages=chat("naïve café"), max_tokens=2, temperature=0
    )
    assert fresh.model_extra["colibri"]["stats"]["replica"] == 0  # idle again: by index


def test_health_and_experts_report_each_replica(gateway):
    h = gateway.health().json()
    assert h["status"] == "ok" and h["kv_slots"] == 2 and h["slots"] == 4
    reps = h["replicas"]
    assert [r["replica"] for r in reps] == [0, 1] and all(r["status"] == "ok" for r in reps)
    assert h["scheduler"]["capacity"] == 4 and h["scheduler"]["max_queue"] == 2
    assert sum(r["scheduler"]["completed"] for r in reps) == h["scheduler"]["completed"]
    engines = {c.pid for c in psutil.Process(gateway.proc.pid).children()}
    assert {r["pid"] for r in reps} == engines and len(engines) == 2
    url = gateway.url + "/experts"
    x = httpx.get(url).json()
    assert [e["replica"] for e in x["replicas"]] == [0, 1]
    assert all(
        e["seq"] > 0 and (e["rows"], e["cols"]) == (x["rows"], x["cols"]) for e in x["replicas"]
    )
    assert x["seq"] == sum(e["seq"] for e in x["replicas"])
    assert httpx.get(url, params={"since": x["seq"]}).status_code == 304
    p = httpx.get(gateway.url + "/profile").json()
    assert [len(e["turns"]) > 0 for e in p["replicas"]] == [True, True]


def test_a_killed_replica_fails_its_requests_while_the_other_serves(
    gateway, client, ref, model_dir
):
    url = gateway.url + "/v1/chat/completions"
    queued: list[httpx.Response] = []
    later: list = []
    with contextlib.ExitStack() as held:
        l1 = held.enter_context(streaming(gateway, chat(PROMPTS[0])))  # replica 0
        held.enter_context(streaming(gateway, chat(PROMPTS[1])))  # replica 1: cancelled at the end
        l3 = held.enter_context(streaming(gateway, chat(PROMPTS[2])))  # replica 0 (a tie)
        b = held.enter_context(streaming(gateway, chat(PROMPTS[3]), max_tokens=3000))  # 1
        assert busy(gateway) == [2, 2]
        body = {"messages": chat("jumps"), "max_tokens": 4, "temperature": 0}
        c = threading.Thread(target=lambda: queued.append(httpx.post(url, json=body, timeout=60)))
        c.start()  # a tie again: replica 0's queue
        wait_for(lambda: gateway.health().json()["replicas"][0]["waiting"] == 1, timeout=20)

        victim = gateway.health().json()["replicas"][0]["pid"]
        assert victim in {p.pid for p in psutil.Process(gateway.proc.pid).children()}
        psutil.Process(victim).kill()
        h = wait_for(lambda: (h := gateway.health()).json()["replicas"][0]["status"] != "ok" and h)
        assert h.status_code == 200 and h.json()["status"] == "degraded"  # replica 1 serves on
        assert "exit status" in h.json()["replicas"][0]["reason"]

        # a new conversation waits for replica 1 now (0 is down), until one of its slots frees
        d = threading.Thread(
            target=lambda: later.append(
                client.chat.completions.create(
                    model="m", messages=chat("to any person"), max_tokens=5, temperature=0
                )
            )
        )
        d.start()
        wait_for(lambda: gateway.health().json()["replicas"][1]["waiting"] == 1, timeout=20)
        c.join(timeout=60)
        assert queued[0].status_code == 503  # replica 0's queued request
        assert queued[0].json()["error"]["code"] == "engine_unavailable"
        for lines in (l1, l3):  # its streams end with an error frame, then [DONE]
            rest = "\n".join(lines)
            assert '"engine_unavailable"' in rest and rest.strip().endswith("data: [DONE]")
        frames = [line for line in b if line.startswith("data: ")]  # replica 1's completes
        assert frames[-1] == "data: [DONE]"
        assert frame(frames[-3])["choices"][0]["finish_reason"] == "length"
        stats = frame(frames[-2])["colibri"]["stats"]
        assert stats["replica"] == 1 and stats["emitted"] == 3000
    d.join(timeout=60)  # (leaving the block cancelled replica 1's other stream)
    (answer,) = later
    assert answer.model_extra["colibri"]["stats"]["replica"] == 1
    assert answer.choices[0].message.content == expect(ref, model_dir, chat("to any person"), 5)[0]

    # replica 0 is restarted, as a lone engine is, and serves again
    back = wait_for(lambda: (h := gateway.health()).json()["status"] == "ok" and h.json(), 120)
    assert back["restarts"] == 1 and [r["restarts"] for r in back["replicas"]] == [1, 0]
    idle(gateway)
    fresh = chat("Der schnelle braune")
    again = client.chat.completions.create(model="m", messages=fresh, max_tokens=8, temperature=0)
    assert again.model_extra["colibri"]["stats"]["replica"] == 0
    assert again.choices[0].message.content == expect(ref, model_dir, fresh, 8)[0]
