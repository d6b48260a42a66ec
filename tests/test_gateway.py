"""The gateway as a black box: `colibri gateway` over the real engine on a tiny checkpoint,
driven by the official `openai` client and raw HTTP on loopback. Pure parts (stop strings, the
slot pool, static paths, templates) are tested directly first.

One shared gateway (16 slots, an API key, a test copy of web/dist with symlinks) serves most
tests; the queue/engine-death test starts its own one-slot gateway and kills its engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import threading

import httpx
import openai
import psutil
import pytest
from engine_util import Reference
from gateway_util import Gateway, gateway_command, gateway_env, raw_get, wait_for
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from colibri.gateway.replies import StopScanner
from colibri.gateway.slots import Affinity, QueueFull, SlotPool
from colibri.gateway.static import StaticSite
from colibri.gateway.templates import FALLBACK, ChatTemplateError, load_chat_template

CTX = 256
KEY = "sk-colibri-test"
JSON_HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
BOS = "<s>"
# Exercises what HF templates use: loops, conditions, filters, bos_token, raise_exception.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<{{ m['role'] }}>{{ m['content'] | trim }}</{{ m['role'] }}>\n"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
PROMPTS = [
    "def add(a, b):",
    "The quick brown fox",
    "Der schnelle braune",
    "Le renard brun",
    "int main(void) {",
    "Permission is hereby",
    "emoji 🐦 colibrì",
    "return a + b",
    "jumps over the lazy",
    "springt über den",
    "saute par-dessus",
    'printf("hello',
    "free of charge",
    "naïve café",
    "to any person",
    "The lazy dog",
]


def render(messages: list[dict]) -> str:
    """TEMPLATE by hand: what the gateway must send the engine."""
    turns = "".join(f"<{m['role']}>{m['content'].strip()}</{m['role']}>\n" for m in messages)
    return BOS + turns + "<assistant>"


# ---------------------------------------------------------------------------- pure parts


def test_stop_scanner_holds_back_partial_stops_and_cuts_at_the_first():
    s = StopScanner(["END", "\n\n"])
    assert s.feed("abc E") == "abc "  # "E" may start END
    assert s.feed("N") == ""
    assert s.feed("X more\n") == "ENX more"  # not END after all; "\n" may start "\n\n"
    assert s.feed("\nrest") == "" and s.hit
    assert s.feed("later") == "" and s.flush() == ""
    plain = StopScanner([])
    assert plain.feed("a") == "a" and not plain.hit
    tail = StopScanner(["xyz"])
    assert tail.feed("abx") == "ab" and tail.flush() == "x"  # the end releases the held tail
    early = StopScanner(["bc", "abcd"])
    assert early.feed("zabc") == "za" and early.hit  # the earliest stop position wins


def test_slot_pool_affinity_lru_queue_and_handoff():
    async def run():
        pool = SlotPool(2, max_waiting=1)
        a = await pool.acquire(Affinity(None, "conv-a"), "A prompt")
        b = await pool.acquire(Affinity(None, "conv-b"), "B prompt")
        assert {a, b} == {0, 1}
        waiter = asyncio.ensure_future(pool.acquire(Affinity("conv-b", "conv-b2"), "x"))
        await asyncio.sleep(0)
        assert pool.waiting == 1
        with pytest.raises(QueueFull):
            await pool.acquire(Affinity(), "y")
        pool.release(a)  # handed straight to the waiter, never free in between
        assert await waiter == a and pool.busy == 2
        pool.release(a)
        pool.release(b)
        assert await pool.acquire(Affinity("conv-b", None), "z") == b  # conversation key
        pool.release(b)
        assert await pool.acquire(Affinity(), "z, continued") == b  # the prompt continues
        assert await pool.acquire(Affinity(), "new") == a  # the only free one
        pool.release(a)
        pool.release(b)
        assert await pool.acquire(Affinity(), "other") == b  # least recently used
        assert await pool.acquire(Affinity(), "more") == a
        gone = asyncio.ensure_future(pool.acquire(Affinity(), "w"))
        await asyncio.sleep(0)
        assert pool.waiting == 1
        gone.cancel()  # a waiter whose client left is dropped from the queue
        await asyncio.gather(gone, return_exceptions=True)
        assert pool.waiting == 0
        pool.release(a)
        pool.release(b)
        assert pool.busy == 0

    asyncio.run(run())


def test_a_slot_tells_its_reuse_only_to_its_own_conversation():
    async def run():
        pool = SlotPool(1, max_waiting=0)
        a = await pool.acquire(Affinity(None, "alice"), "alice's secret prompt")
        assert pool.own(a)  # an unused slot: nothing to learn
        pool.release(a)
        again = await pool.acquire(Affinity("alice", "alice-2"), "alice's secret prompt, more")
        assert pool.own(again)  # her conversation's key
        pool.release(again)
        probe = await pool.acquire(Affinity("mallory", "mallory"), "alice's sec")
        assert not pool.own(probe)  # another's cache: the reused count is not told
        pool.release(probe)
        cont = await pool.acquire(Affinity(), "alice's sec and more")
        assert pool.own(cont)  # continues the slot's last prompt, which it holds whole

    asyncio.run(run())


def test_static_site_refuses_every_way_out(tmp_path):
    root = tmp_path / "dist"
    (root / "assets").mkdir(parents=True)
    (root / "index.html").write_text("index")
    (root / "assets" / "app.js").write_text("js")
    outside = tmp_path / "secret"
    outside.mkdir()
    (outside / "key.txt").write_text("secret")
    (root / "out").symlink_to(outside)
    (root / "leak.txt").symlink_to(outside / "key.txt")
    (root / "assets" / "alias.js").symlink_to(root / "assets" / "app.js")  # inside: fine
    site = StaticSite(root)
    real = root.resolve()
    assert site.lookup("/") == real / "index.html"
    assert site.lookup("/assets/app.js") == real / "assets" / "app.js"
    assert site.lookup("/assets/alias.js") == real / "assets" / "app.js"
    assert site.lookup("/chat/42") == real / "index.html"  # client-side route
    for bad in [
        "/../secret/key.txt",
        "/assets/../../secret/key.txt",
        "/./index.html",
        "//etc/passwd",
        "/out/key.txt",
        "/leak.txt",
        "/assets\\..\\..\\secret\\key.txt",
        "/C:/Windows/win.ini",
        "/index.html\0.js",
        "/missing.js",
        "/experts.json",
        str(outside / "key.txt"),  # an absolute path is a path under the root: not there
    ]:
        found = site.lookup(bad)
        assert found is None or found == real / "index.html", bad


def test_templates_hf_forms_and_fallback(tmp_path):
    assert load_chat_template(tmp_path).source == FALLBACK
    cfg = {
        "chat_template": [
            {"name": "tool_use", "template": "T"},
            {"name": "default", "template": TEMPLATE},
        ],
        "bos_token": {"content": BOS, "special": True},
        "eos_token": "<|end|>",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = load_chat_template(tmp_path)
    msgs = [{"role": "system", "content": " be brief "}, {"role": "user", "content": "hi"}]
    assert t.render(msgs) == render(msgs)
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        t.render([{"role": "tool", "content": "x"}])
    (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}")  # the file wins
    assert load_chat_template(tmp_path).render([]) == "<|end|>"


# ---------------------------------------------------------------------------- fixtures

# An atlas in colibri's own schema (data/experts.json's), two experts of layer 1.
MINI_ATLAS = {
    "categories": ["python", "german"],
    "experts": [
        {"layer": 1, "expert": 0, "affinity": [0.5, 0.5], "spec": 0.0, "top": "python"},
        {"layer": 1, "expert": 3, "affinity": [0.125, 0.875], "spec": 0.46, "top": "german"},
    ],
    "version": 1,
}


@pytest.fixture(scope="module")
def model_dir(checkpoints, tmp_path_factory):
    """The tiny qwen3_moe checkpoint plus a tokenizer_config.json with a chat template."""
    folder = tmp_path_factory.mktemp("gateway") / "tiny-chat"
    shutil.copytree(checkpoints("qwen3_moe"), folder)
    cfg = {"chat_template": TEMPLATE, "bos_token": {"content": BOS}, "eos_token": "<|end|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A copy of web/dist with a symlink out of it, a secret beside it, and an experts.json."""
    base = tmp_path_factory.mktemp("site")
    dist = base / "dist"
    shutil.copytree(os.path.join(os.path.dirname(__file__), "..", "web", "dist"), dist)
    (base / "secret.txt").write_text("TOP-SECRET")
    (dist / "leak.txt").symlink_to(base / "secret.txt")
    (dist / "up").symlink_to(base)
    (base / "experts.json").write_text(json.dumps(MINI_ATLAS))
    return base


@pytest.fixture(scope="module")
def gateway(model_dir, site, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "gateway.log"
    args = ["--kv-slots", "16", "--ctx", str(CTX), "--web", str(site / "dist")]
    args += ["--experts-json", str(site / "experts.json")]
    gw = Gateway(model_dir, *args, log=log, key=KEY)
    yield gw
    status = gw.close()
    assert status == 0, gw.logs()
    assert "Traceback" not in gw.logs(), gw.logs()


@pytest.fixture(scope="module")
def ref(model_dir):
    return Reference(model_dir, CTX)


@pytest.fixture
def client(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def expect(ref: Reference, prompt: str, max_tokens: int) -> tuple[str, list[int]]:
    """What the engine alone gives greedily for this exact prompt: text and token ids."""
    ids = ref.ids(ref.tokenizer.encode(prompt), max_tokens)
    text = b"".join(ref.tokenizer.token_bytes(t) for t in ids).decode("utf-8", errors="replace")
    return text, ids


def check_colibri(col: dict, usage, prompt_tokens: int, emitted: int, max_tokens: int) -> None:
    """The colibri object agrees with DONE and with the usage counts."""
    stats = col["stats"]
    assert stats["emitted"] == emitted == usage.completion_tokens == len(col["topk"])
    assert stats["prompt_tokens"] == prompt_tokens == usage.prompt_tokens
    assert usage.total_tokens == prompt_tokens + emitted
    assert stats["length_limited"] == (emitted == max_tokens)
    assert stats["tok_s"] >= 0 and 0 <= stats["hit_pct"] <= 100 and stats["rss_gb"] > 0
    assert set(col["perf"]) == {"dt", "t_edisk", "t_ewait", "t_emm", "t_attn", "t_kvb", "t_head"}
    assert col["perf"]["dt"] > 0 and len(col["entropy"]) == 2  # two MoE layers
    assert all(len(k) == 5 for k in col["topk"]) and isinstance(col["gpus"], list)
    assert isinstance(col["repin"], list)


# ---------------------------------------------------------------------------- openai client


def test_openai_chat_non_streaming_matches_engine(client, gateway, ref):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "The quick brown fox"},
    ]
    resp = client.chat.completions.create(
        model="tiny-chat", messages=messages, max_tokens=12, temperature=0
    )
    text, ids = expect(ref, render(messages), 12)
    choice = resp.choices[0]
    assert choice.message.content == text and choice.message.role == "assistant"
    assert choice.finish_reason == ("length" if len(ids) == 12 else "stop")
    assert resp.model == "tiny-chat" and resp.object == "chat.completion"
    n_prompt = len(ref.tokenizer.encode(render(messages)))
    col = resp.model_extra["colibri"]
    check_colibri(col, resp.usage, n_prompt, len(ids), 12)
    for k, tok in zip(col["topk"], ids, strict=True):  # greedy: the chosen token ranks first
        best = ref.tokenizer.token_bytes(tok).decode("utf-8", errors="replace")
        assert k[0]["token"] == best and k[0]["logprob"] <= 0


def test_openai_chat_streaming_ends_with_the_colibri_frame(client, ref):
    messages = [{"role": "user", "content": "Der schnelle braune Fuchs"}]
    stream = client.chat.completions.create(
        model="tiny-chat", messages=messages, max_tokens=16, temperature=0, stream=True
    )
    chunks = list(stream)
    text, ids = expect(ref, render(messages), 16)
    *body, finish, last = chunks
    assert body[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in body) == text
    assert finish.choices[0].finish_reason == ("length" if len(ids) == 16 else "stop")
    assert last.choices == [] and "colibri" in last.model_extra  # the frame before [DONE]
    n_prompt = len(ref.tokenizer.encode(render(messages)))
    check_colibri(last.model_extra["colibri"], last.usage, n_prompt, len(ids), 16)


def test_multi_turn_chat_returns_to_its_slot_and_reuses_kv(client, ref):
    first = [{"role": "user", "content": "Le renard brun rapide"}]
    a = client.chat.completions.create(model="m", messages=first, max_tokens=6, temperature=0)
    second = [
        *first,
        {"role": "assistant", "content": a.choices[0].message.content},
        {"role": "user", "content": "saute par-dessus"},
    ]
    b = client.chat.completions.create(model="m", messages=second, max_tokens=6, temperature=0)
    sa, sb = a.model_extra["colibri"]["stats"], b.model_extra["colibri"]["stats"]
    assert sb["slot"] == sa["slot"]
    assert sb["reused_tokens"] >= sa["prompt_tokens"] - 1  # the first turn's KV was kept
    assert b.choices[0].message.content == expect(ref, render(second), 6)[0]


def test_stop_sequences_cut_the_text_and_stop_the_engine(client, ref):
    messages = [{"role": "user", "content": "Permission is hereby granted"}]
    text, ids = expect(ref, render(messages), 40)
    clean = [i for i in range(4, len(text) - 2) if "\ufffd" not in text[i : i + 2]]
    assert clean, f"no usable stop string in {text!r}"
    stop = text[clean[0] : clean[0] + 2]
    want = text[: text.find(stop)]
    kw = dict(model="m", messages=messages, max_tokens=40, temperature=0, stop=[stop, "\x00"])
    resp = client.chat.completions.create(**kw)
    assert resp.choices[0].message.content == want
    assert resp.choices[0].finish_reason == "stop"
    col = resp.model_extra["colibri"]
    assert col["stats"]["emitted"] == resp.usage.completion_tokens < len(ids)  # STOP ended it
    assert not col["stats"]["length_limited"]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == want  # the held-back tail never leaked a partial stop string


def test_text_completions(client, ref):
    prompt = "int main(void) {"
    text, ids = expect(ref, prompt, 10)
    resp = client.completions.create(model="m", prompt=prompt, max_tokens=10, temperature=0)
    assert resp.choices[0].text == text and resp.object == "text_completion"
    assert (
        resp.usage.completion_tokens == len(ids) == resp.model_extra["colibri"]["stats"]["emitted"]
    )
    chunks = list(
        client.completions.create(
            model="m", prompt=prompt, max_tokens=10, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert "colibri" in chunks[-1].model_extra


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == ["tiny-chat"]


def test_sixteen_concurrent_streaming_clients(gateway, ref):
    wants = [expect(ref, render([{"role": "user", "content": p}]), 24)[0] for p in PROMPTS]
    got: dict[int, str] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            c = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0)
            msgs = [{"role": "user", "content": PROMPTS[i]}]
            stream = c.chat.completions.create(
                model="m", messages=msgs, max_tokens=24, temperature=0, stream=True
            )
            got[i] = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not errors, errors
    assert [got.get(i) for i in range(len(PROMPTS))] == wants
    assert wait_for(lambda: gateway.health().json()["busy"] == 0, timeout=10)


def test_disconnect_mid_stream_cancels_and_frees_the_slot(gateway):
    conv = {"X-Colibri-Conversation": "disconnect-test"}
    body = {"messages": [{"role": "user", "content": "The lazy dog"}], "temperature": 0}
    warm = gateway.post("/v1/chat/completions", {**body, "max_tokens": 4}, headers=conv).json()
    slot = warm["colibri"]["stats"]["slot"]
    cancelled = gateway.health().json()["cancelled"]

    headers = {**gateway.headers, **conv}
    long = {**body, "max_tokens": CTX, "stream": True}
    with httpx.stream(
        "POST", gateway.url + "/v1/chat/completions", json=long, headers=headers, timeout=60
    ) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ") and '"content"' in line
            if seen >= 3:
                break  # leaving the block closes the connection mid-stream

    health = wait_for(
        lambda: (h := gateway.health().json())["cancelled"] > cancelled and h["busy"] == 0 and h,
        timeout=20,
    )
    assert health["cancelled"] == cancelled + 1  # the engine acknowledged our CANCEL
    after = gateway.post("/v1/chat/completions", {**body, "max_tokens": 4}, headers=conv)
    assert after.status_code == 200
    stats = after.json()["colibri"]["stats"]
    assert stats["slot"] == slot and stats["reused_tokens"] > 0  # same slot, its KV kept


# ---------------------------------------------------------------------------- HTTP surface


def test_static_site_and_path_traversal(gateway, site):
    index = (site / "dist" / "index.html").read_bytes()
    assert raw_get(gateway.port, "/") == (200, index)
    assert raw_get(gateway.port, "/some/client/route") == (200, index)  # SPA fallback
    status, atlas = raw_get(gateway.port, "/experts.json")
    assert status == 200 and set(json.loads(atlas)["experts"]) == {"1:0", "1:3"}  # keyed
    assert raw_get(gateway.port, "/missing.css")[0] == 404
    for target in [
        "/..%2f..%2f..%2f..%2fetc/passwd",
        "/%2e%2e/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
        "/../../../../etc/passwd",
        "/%2E%2E%2F%2E%2E%2Fsecret.txt",
        "/..%5c..%5csecret.txt",
        "//etc/passwd",
        "/leak.txt",
        "/up/secret.txt",
        "/%252e%252e/secret.txt",
    ]:
        status, body = raw_get(gateway.port, target)
        assert status in (400, 404), (target, status)
        assert b"TOP-SECRET" not in body and b"root:" not in body, target
    status, body = raw_get(gateway.port, "/etc/passwd")  # an absolute path stays under the root
    assert b"root:" not in body and (status == 404 or body == index)
    assert raw_get(gateway.port, "/v1/nope")[0] == 404  # the API has no SPA fallback


def test_api_key_is_required_when_set(gateway):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(gateway.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(gateway.url + "/v1/chat/completions", headers=headers, json={})
        assert r.status_code == 401
        assert httpx.get(gateway.url + "/experts", headers=headers).status_code == 401
    bad = openai.OpenAI(base_url=gateway.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert gateway.health().status_code == 200  # probes need no key


def test_bad_requests_are_openai_errors(gateway, client):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="m", messages=msgs, temperature=5)
    big = {"messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    r = gateway.post("/v1/chat/completions", big)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    long = [{"role": "user", "content": "x " * 400}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=long, max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    cases = [
        b"{not json",
        json.dumps({"messages": []}).encode(),
        json.dumps({"messages": msgs, "n": 2}).encode(),
        json.dumps({"messages": msgs, "top_p": 0}).encode(),
        json.dumps({"messages": [{"role": "tool", "content": "x"}]}).encode(),  # template refuses
        json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
    ]
    for raw in cases:
        r = httpx.post(gateway.url + "/v1/chat/completions", content=raw, headers=JSON_HEADERS)
        assert r.status_code == 400, (raw, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = gateway.post("/v1/completions", {"prompt": "", "max_tokens": 2})
    assert r.status_code == 400  # EMPTY_PROMPT from the engine
    chunked = (b"x" * (1 << 16) for _ in range(40))  # no Content-Length: counted while read
    r = httpx.post(gateway.url + "/v1/completions", content=chunked, headers=JSON_HEADERS)
    assert r.status_code == 413


def test_experts_endpoint_reports_the_latest_maps(gateway, ref):
    gateway.post("/v1/completions", {"prompt": "The quick", "max_tokens": 8, "temperature": 0})
    r = httpx.get(gateway.url + "/experts", headers=gateway.headers)
    s = r.json()
    cfg = ref.model.cfg
    rows, cols = len(cfg.moe_layer_ids), cfg.moe.num_experts
    assert (s["rows"], s["cols"]) == (rows, cols) and s["seq"] > 0
    grid = s["map_grid"]
    assert len(grid) == rows and all(len(row) == cols for row in grid)
    assert all(0 <= b < 256 and b >> 6 <= 2 for row in grid for b in row)
    assert all(h in (0, 1) for row in s["hits_grid"] for h in row) and len(s["hits_grid"]) == rows
    assert len(s["entropy"]) == rows and isinstance(s["gpus"], list)
    assert isinstance(s["repin"], list) and s["tiers"]["vram"] + s["tiers"]["ram"] >= 0
    assert sum(b & 63 for row in grid for b in row) > 0  # heat after traffic


# ---------------------------------------------------------------------------- colibrì's shapes
# What colibrì's web UI (its `web/src`) reads from its own gateway, read here the way it does.


def ui_map_byte(hexmap: str, i: int) -> int:
    """Brain.tsx: parseInt(map.substr(i * 2, 2), 16)."""
    return int(hexmap[i * 2 : i * 2 + 2], 16)


def ui_hit(hexhits: str, i: int) -> bool:
    """Brain.tsx: parseInt(hits.substr((i >> 3) * 2, 2), 16) & (1 << (i & 7))."""
    return bool(int(hexhits[(i >> 3) * 2 : (i >> 3) * 2 + 2], 16) & (1 << (i & 7)))


def test_experts_as_colibris_ui_reads_them(gateway):
    url, headers = gateway.url + "/experts", gateway.headers
    gateway.post("/v1/completions", {"prompt": PROMPTS[4], "max_tokens": 6, "temperature": 0})
    s = httpx.get(url, headers=headers).json()
    rows, cols = s["rows"], s["cols"]
    assert isinstance(s["map"], str) and len(s["map"]) == 2 * rows * cols
    assert isinstance(s["hits"], str) and len(s["hits"]) == 2 * ((rows * cols + 7) // 8)
    for i in range(rows * cols):
        r, c = divmod(i, cols)
        assert ui_map_byte(s["map"], i) == s["map_grid"][r][c]
        assert ui_hit(s["hits"], i) == bool(s["hits_grid"][r][c])
    # ?since=<seq>: 304 while nothing changed, the map again once something did
    assert httpx.get(url, params={"since": s["seq"]}, headers=headers).status_code == 304
    gateway.post("/v1/completions", {"prompt": PROMPTS[5], "max_tokens": 6, "temperature": 0})
    again = httpx.get(url, params={"since": s["seq"]}, headers=headers)
    assert again.status_code == 200 and again.json()["seq"] > s["seq"]
    bad = httpx.get(url, params={"since": "later"}, headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "since"


def test_health_profile_and_models_as_colibris_ui_reads_them(gateway, client):
    msgs = [{"role": "user", "content": PROMPTS[6]}]
    done = client.chat.completions.create(model="m", messages=msgs, max_tokens=5, temperature=0)
    h = httpx.get(gateway.url + "/health", headers=gateway.headers).json()
    assert h["status"] == "ok" and h["kv_slots"] == 16
    sched = h["scheduler"]
    assert sched["capacity"] == 16 and sched["active"] >= 0 and sched["queued"] >= 0
    assert sched["completed"] >= 1 and sched["admitted"] >= sched["completed"]
    assert sched["rejected"] + sched["timed_out"] + sched["cancelled"] >= 0  # App.tsx's sum
    assert set(h["tiers"]) == {"vram", "ram", "disk", "vram_gb", "ram_gb"}
    hw = h["hwinfo"]
    assert set(hw) == {
        "cores",
        "ram_total_gb",
        "ram_avail_gb",
        "gpus",
        "vram_total_gb",
        "cpu",
        "gpu",
    }
    assert hw["cores"] >= 1 and hw["ram_total_gb"] > 0
    public = gateway.health().json()  # without the key: liveness only
    assert public["status"] == "ok" and "scheduler" not in public and "hwinfo" not in public

    p = httpx.get(gateway.url + "/profile", headers=gateway.headers).json()
    assert p["seq"] >= 1 and p["turns"]
    keys = {"wall_s", "prompt_tokens", "completion_tokens", "expert_disk_s", "expert_wait_s"}
    keys |= {"expert_matmul_s", "attention_s", "lm_head_s", "forwards"}
    assert all(set(t) == keys for t in p["turns"])
    mine = [t for t in p["turns"] if t["prompt_tokens"] == done.usage.prompt_tokens]
    assert any(t["completion_tokens"] == done.usage.completion_tokens for t in mine)
    assert httpx.get(gateway.url + "/profile").status_code == 401  # the key is needed

    card = httpx.get(gateway.url + "/v1/models/tiny-chat", headers=gateway.headers)
    assert card.status_code == 200 and card.json()["id"] == "tiny-chat"
    assert client.models.retrieve("tiny-chat").id == "tiny-chat"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-5")


def test_every_response_carries_a_request_id(gateway):
    for r in (
        gateway.health(),
        httpx.get(gateway.url + "/v1/models"),  # a 401
        gateway.post("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
        httpx.get(gateway.url + "/"),
    ):
        assert r.headers["x-request-id"].startswith("req_"), r.url
    mine = gateway.post(
        "/v1/completions", {"prompt": "hi", "max_tokens": 1}, headers={"x-request-id": "abc-1"}
    )
    assert mine.headers["x-request-id"] == "abc-1"
    body = {"prompt": "hi", "max_tokens": 2, "stream": True}
    with httpx.stream(
        "POST", gateway.url + "/v1/completions", json=body, headers=gateway.headers
    ) as r:
        assert r.headers["x-request-id"].startswith("req_")
        assert "[DONE]" in r.read().decode()


def test_a_chat_request_as_colibris_ui_sends_it(gateway, ref):
    body = {  # api.ts streamChat's body
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": PROMPTS[7]}],
        "temperature": 0,
        "max_completion_tokens": 6,
        "enable_thinking": False,
        "cache_slot": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    want, _ = expect(ref, render(body["messages"]), 6)
    with httpx.stream(
        "POST", gateway.url + "/v1/chat/completions", json=body, headers=gateway.headers
    ) as r:
        assert r.status_code == 200
        frames = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    events = [json.loads(f) for f in frames[:-1]]
    text = "".join(c["delta"].get("content", "") for e in events for c in e["choices"])
    assert text == want and events[-1]["usage"]["completion_tokens"] >= 1


def test_response_format_reaches_the_engine_and_changes_no_token(gateway, client, ref):
    msgs = [{"role": "user", "content": PROMPTS[8]}]
    want, _ = expect(ref, render(msgs), 6)
    schema = {"type": "object", "properties": {"name": {"type": "string"}}}
    formats = [
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        {"type": "gbnf", "grammar": 'root ::= "{" "}"'},
    ]
    for fmt in formats:  # sent as SUBMIT's grammar field, which the engine keeps, unused
        r = client.chat.completions.create(
            model="m", messages=msgs, max_tokens=6, temperature=0, response_format=fmt
        )
        assert r.choices[0].message.content == want, fmt
    for bad in ({"type": "xml"}, {"type": "json_schema", "json_schema": {}}, {"type": "gbnf"}):
        r = gateway.post("/v1/chat/completions", {"messages": msgs, "response_format": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def test_the_atlas_in_colibris_keyed_form():
    from colibri.atlas import ATLAS, load_atlas, upstream_view

    atlas = load_atlas(ATLAS)
    view = upstream_view(atlas)
    assert len(view["experts"]) == atlas["layers"] * atlas["experts_per_layer"]
    for x in atlas["experts"]:
        v = view["experts"][f"{x['layer']}:{x['expert']}"]
        assert list(v["affinity"]) == atlas["categories"]
        assert abs(sum(v["affinity"].values()) - 1) < 1e-4
        assert max(v["affinity"], key=v["affinity"].get) == v["top"] == x["top"]
        assert v["label"] == ("specialist" if x["spec"] >= 0.25 else "generalist")
        assert 0 <= v["entropy"] <= 3.46  # log2(11 categories)
    mini = upstream_view(MINI_ATLAS)["experts"]
    assert set(mini) == {"1:0", "1:3"} and mini["1:3"]["entropy"] == 0.544
    assert mini["1:3"]["label"] == "specialist" and mini["1:0"]["entropy"] == 1.0


# ---------------------------------------------------------------------------- own processes


def test_non_loopback_bind_needs_a_key(model_dir):
    cmd = gateway_command(model_dir, "--host", "0.0.0.0", "--port", "9")
    r = subprocess.run(cmd, capture_output=True, timeout=60, env=gateway_env())
    assert r.returncode == 2
    assert b"refusing to bind 0.0.0.0" in r.stderr and b"--api-key" in r.stderr


def test_queue_full_is_429_and_a_dead_engine_is_503_then_restarted(model_dir, tmp_path):
    gw = Gateway(
        model_dir, "--kv-slots", "1", "--max-queue", "1", "--ctx", "32768", log=tmp_path / "log"
    )
    try:
        url = gw.url + "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "jumps over the lazy"}], "temperature": 0}
        queued: list[httpx.Response] = []
        # Long enough to still be decoding when the engine is killed (the tiny model decodes
        # over a thousand tokens a second).
        long = {**body, "max_tokens": 30000, "stream": True}
        with httpx.stream("POST", url, json=long, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if '"content"' in line)  # running in slot 0
            with pytest.raises(httpx.ReadTimeout):  # a queued client that gives up ...
                httpx.post(url, json=body, timeout=1.5)
            wait_for(lambda: gw.health().json()["waiting"] == 0, timeout=10)  # ... leaves the queue
            t = threading.Thread(
                target=lambda: queued.append(httpx.post(url, json=body, timeout=60))
            )
            t.start()
            wait_for(lambda: gw.health().json()["waiting"] == 1, timeout=20)
            full = httpx.post(url, json=body, timeout=30)
            assert full.status_code == 429 and full.json()["error"]["type"] == "rate_limit_error"

            (engine,) = psutil.Process(gw.proc.pid).children()
            engine.kill()
            rest = "\n".join(lines)  # the stream ends with an error frame, then [DONE]
        assert '"engine_unavailable"' in rest and rest.strip().endswith("data: [DONE]")
        t.join(timeout=30)
        assert queued[0].status_code == 503
        health = gw.health()
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
        assert "exit status -9" in health.json()["reason"]  # also once the next one is starting
        assert httpx.post(url, json=body, timeout=30).status_code == 503
        # the gateway starts a new engine (after a second) and serves again
        back = wait_for(lambda: (h := gw.health()).status_code == 200 and h.json(), timeout=180)
        assert back["restarts"] == 1 and back["busy"] == 0
        again = httpx.post(url, json={**body, "max_tokens": 3}, timeout=60)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] >= 1
    finally:
        gw.close()
    assert "Traceback" not in gw.logs(), gw.logs()


# ---------------------------------------------------------------------------- hardening


def post_raw(gateway, path: str, body: bytes, **headers: str) -> httpx.Response:
    return httpx.post(gateway.url + path, content=body, headers={**JSON_HEADERS, **headers})


def test_lone_surrogates_never_hold_a_slot(gateway):
    """A prompt, a user field or a message that is not encodable as UTF-8 is a 400 before any
    slot is taken; more of them than there are slots leave every slot free."""
    bad = [
        {"prompt": "a\ud800b", "max_tokens": 2},
        {"prompt": "hi", "max_tokens": 2, "user": "\udfff"},
    ]
    chat = {"messages": [{"role": "user", "content": "x\ud83d"}], "max_tokens": 2}
    for i in range(20):
        body = json.dumps(bad[i % 2]).encode()
        r = post_raw(gateway, "/v1/completions", body)
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]
    r = post_raw(gateway, "/v1/chat/completions", json.dumps(chat).encode())
    assert r.status_code == 400
    health = gateway.health().json()
    assert health["busy"] == 0 and health["waiting"] == 0
    ok = gateway.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200


def test_a_huge_max_tokens_is_capped_by_the_context(gateway):
    body = {"prompt": PROMPTS[9], "max_tokens": 10**20, "temperature": 0}
    r = httpx.post(gateway.url + "/v1/completions", json=body, headers=gateway.headers, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    assert r.json()["usage"]["prompt_tokens"] + r.json()["usage"]["completion_tokens"] <= CTX


def test_foreign_hosts_origins_and_content_types_are_refused(gateway):
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    assert post_raw(gateway, "/v1/completions", body, Host="evil.example").status_code == 403
    assert post_raw(gateway, "/v1/completions", body, Host="evil.example:80").status_code == 403
    for origin in ("http://evil.example", "http://127.0.0.1.evil.example:8000", "null"):
        r = post_raw(gateway, "/v1/completions", body, Origin=origin)
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", origin
    same = post_raw(gateway, "/v1/completions", body, Origin=f"http://localhost:{gateway.port}")
    assert same.status_code == 200
    assert post_raw(gateway, "/v1/completions", body, Host="LOCALHOST").status_code == 200
    assert httpx.get(gateway.url + "/", headers={"Host": "evil.example"}).status_code == 403
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        r = post_raw(gateway, "/v1/completions", body, **{"Content-Type": kind})
        assert r.status_code == 415, kind


def test_tiny_temperatures_and_deep_json(gateway, ref):
    body = {"prompt": PROMPTS[10], "max_tokens": 4}
    greedy = gateway.post("/v1/completions", {**body, "temperature": 0}).json()
    tiny = gateway.post("/v1/completions", {**body, "temperature": 5e-324})
    assert tiny.status_code == 200
    assert tiny.json()["choices"][0]["text"] == greedy["choices"][0]["text"]  # the limit: greedy
    deep = b"[" * 100_000 + b"]" * 100_000
    r = post_raw(gateway, "/v1/completions", deep)
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"]


def test_the_key_from_a_file(tmp_path, monkeypatch):
    import argparse

    from colibri.gateway.server import _api_key

    key = tmp_path / "key"
    key.write_text("sk-from-file\n")
    monkeypatch.delenv("COLIBRI_API_KEY", raising=False)
    args = argparse.Namespace(api_key=None, api_key_file=str(key))
    assert _api_key(args) == "sk-from-file"
    assert _api_key(argparse.Namespace(api_key="sk-flag", api_key_file=str(key))) == "sk-flag"
    monkeypatch.setenv("COLIBRI_API_KEY", "sk-env")
    assert _api_key(argparse.Namespace(api_key=None, api_key_file=None)) == "sk-env"


_text = st.text(st.characters(exclude_categories=()), max_size=12)  # lone surrogates too
_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**30), 10**30),
    st.floats(allow_nan=False, allow_infinity=False, width=64),
    _text,
    st.lists(_text, max_size=3),
)
_bodies = st.fixed_dictionaries(
    {},
    optional={
        "prompt": st.one_of(_text, _values),
        "messages": st.one_of(
            st.lists(
                st.fixed_dictionaries(
                    {"role": st.sampled_from(["user", "x"])}, optional={"content": _values}
                ),
                max_size=2,
            ),
            _values,
        ),
        "max_tokens": _values,
        "temperature": _values,
        "top_p": _values,
        "stop": _values,
        "user": _values,
        "stream": _values,
        "response_format": st.one_of(_values, st.fixed_dictionaries({"type": _values})),
    },
)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@example(path="/v1/completions", body={"prompt": "a\ud800", "max_tokens": 10**20}, headers={})
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    body=_bodies,
    headers=st.fixed_dictionaries(
        {},
        optional={
            "Host": st.sampled_from(["evil.example", "localhost", "127.0.0.1"]),
            "Origin": st.sampled_from(["null", "http://evil.example", "http://localhost"]),
            "Content-Type": st.sampled_from(["text/plain", "application/json"]),
        },
    ),
)
def test_fuzzed_requests_get_a_clean_answer_and_hold_no_slot(gateway, path, body, headers):
    """Random bodies (lone surrogates, huge integers, wrong types) and headers: never a 500,
    and once answered no slot stays taken."""
    data = json.dumps(body).encode()  # lone surrogates travel as \\udXXX escapes
    base = {"Content-Type": "application/json", "Host": f"127.0.0.1:{gateway.port}"}
    merged = {**JSON_HEADERS, **base, **headers}
    r = httpx.post(gateway.url + path, content=data, headers=merged, timeout=120)
    assert r.status_code in (200, 400, 403, 404, 415, 429), (r.status_code, r.text[:200])
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    health = wait_for(lambda: (h := gateway.health().json())["busy"] == 0 and h, timeout=60)
    assert health["waiting"] == 0
