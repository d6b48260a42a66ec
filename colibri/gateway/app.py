"""The HTTP surface: OpenAI chat and text completions, models, health, the expert map, the site.

A completion request is authorised, read within the body cap, validated, rendered to one prompt,
then waits for a KV slot (bounded queue) and is submitted; the response starts only once the
engine accepted it, so a refusal (context overflow, a bad value) is still an HTTP status. A
client that leaves at any point gets its request cancelled, which frees the slot.

Streams end with one chunk whose `choices` is empty, carrying `usage` and the `colibri` object
(`{stats, perf, topk, entropy, gpus, repin}`, numbers from the engine's DONE), then
`data: [DONE]`; a non-streaming body carries the same `colibri` field. A client can name its
conversation with the `X-Colibri-Conversation` header (or `user`) to keep its KV slot.

The telemetry routes (`/health`, `/experts`, `/profile`, `/experts.json`) answer in the shapes
colibrì's own gateway gives, so that its web UI runs over this gateway; what this project's own
page needs besides comes under other names. Every response carries `x-request-id`.

With several engines (`--replicas`, `colibri.gateway.replicas`) a request runs on the replica
whose slot holds its prefix, else on the least loaded one; `/health` sums their slots and
queues, `/experts` and `/profile` show the first running replica's telemetry, and each adds
`replicas`, one entry per replica. With one engine they are the lone engine's. `colibri.stats`
names the `replica` and `slot` that served the request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from colibri.atlas import upstream_view
from colibri.gateway.engine_client import EngineClient, EngineGone, EngineRequest
from colibri.gateway.replicas import Replica, Replicas, Unavailable
from colibri.gateway.replies import Reply
from colibri.gateway.schema import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    conversation_key,
    parse,
)
from colibri.gateway.settings import GatewaySettings, allowed_hosts
from colibri.gateway.slots import Affinity, QueueFull
from colibri.gateway.static import StaticSite
from colibri.gateway.telemetry import experts_json, hwinfo_json, profile_json, tiers_json
from colibri.gateway.templates import ChatTemplateError, load_chat_template
from colibri.protocol.codec import Error

CONVERSATION_HEADER = "x-colibri-conversation"  # names a conversation explicitly (slot affinity)
REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID = 128  # a client's own x-request-id is echoed up to this length
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its response started."""


@dataclass(frozen=True)
class Job:
    """One generation as the engine will run it."""

    prompt: str
    max_tokens: int | None
    temperature: float
    top_p: float
    stops: list[str]
    affinity: Affinity
    grammar: str = ""  # from response_format, sent as SUBMIT's 7th field


def create_app(engines: Sequence[EngineClient], settings: GatewaySettings) -> FastAPI:
    """The FastAPI app over started engines, one per replica."""
    gw = Gateway(engines, settings)
    app = FastAPI(title="colibri gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gw
    app.add_middleware(HostGuard, hosts=allowed_hosts(settings))
    app.add_middleware(RequestId)
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(ClientGone, _on_client_gone)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        gw.authorize(request)
        body: ChatRequest = parse(ChatRequest, await gw.read_json(request))
        messages = body.template_messages()
        try:
            prompt = gw.template.render(messages)
        except ChatTemplateError as e:
            raise ApiError(400, str(e), param="messages") from None
        named = request.headers.get(CONVERSATION_HEADER) or body.user
        affinity = chat_affinity(messages, named)
        job = Job(prompt, body.limit(), *body.sampling(), body.stops(), affinity, body.grammar())
        return await gw.answer(request, job, ChatShape(gw.model_id), body.stream)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        gw.authorize(request)
        body: CompletionRequest = parse(CompletionRequest, await gw.read_json(request))
        named = request.headers.get(CONVERSATION_HEADER) or body.user
        affinity = Affinity(named, named)
        job = Job(
            body.text(), body.max_tokens, *body.sampling(), body.stops(), affinity, body.grammar()
        )
        return await gw.answer(request, job, CompletionShape(gw.model_id), body.stream)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        gw.authorize(request)
        return {"object": "list", "data": [gw.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> dict:
        gw.authorize(request)
        if model_id != gw.model_id:
            msg = f"the model {model_id!r} does not exist"
            raise ApiError(404, msg, code="model_not_found", param="model")
        return gw.model_card()

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        """Liveness for anyone; the scheduler, tiers and host only with the key (if one is set).
        200 while any replica serves (`status` "degraded" while only some do), else 503."""
        body = gw.health_json(gw.authorized(request))
        return JSONResponse(body, status_code=503 if body["status"] == "unavailable" else 200)

    @app.get("/experts")
    async def experts(request: Request, since: str | None = None) -> Response:
        """The expert map; 304 when `since` names the current `seq` (nothing new)."""
        gw.authorize(request)
        if since is not None:
            if not since.isdigit():
                raise ApiError(400, f"since={since!r}: expected a sequence number", param="since")
            if int(since) == gw.experts_seq():
                return Response(status_code=304)
        return JSONResponse(gw.experts_json())

    @app.get("/profile")
    async def profile(request: Request) -> dict:
        gw.authorize(request)
        return gw.profile_json()

    @app.get("/experts.json")
    async def atlas(request: Request) -> Response:
        if gw.atlas is None:
            return PlainTextResponse("Not Found", status_code=404)
        return Response(gw.atlas, media_type="application/json")

    @app.api_route("/{path:path}", methods=["GET", "HEAD"], include_in_schema=False)
    async def site(request: Request) -> Response:
        path = request.scope["path"]
        if path == "/v1" or path.startswith("/v1/"):
            raise ApiError(404, f"no such endpoint: {path}")
        found = gw.site.lookup(path)
        if found is None:
            return PlainTextResponse("Not Found", status_code=404)
        return FileResponse(found, headers={"X-Content-Type-Options": "nosniff"})

    return app


class Gateway:
    """What the routes share: the replicas (engines and their slot pools), the chat template,
    the static site."""

    def __init__(self, engines: Sequence[EngineClient], settings: GatewaySettings):
        self.settings = settings
        self.replicas = Replicas(engines, settings.kv_slots, settings.max_waiting)
        self.model_id = settings.model_id
        self.created = int(time.time())
        self.template = load_chat_template(settings.model_dir)
        self.site = StaticSite(settings.web_root)
        self.atlas = atlas_bytes(settings.experts_json)

    def model_card(self) -> dict:
        return {
            "id": self.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "colibri",
        }

    @property
    def shown(self) -> Replica:
        """The replica whose telemetry stands for all where one map or host is shown: the first
        running one, else the first."""
        return next(iter(self.replicas.alive), self.replicas[0])

    def health_json(self, authorized: bool) -> dict:
        """`/health`: liveness, slots and queue summed over the replicas; with `authorized`,
        the scheduler, and the tiers and host of the replica shown. With several replicas,
        `replicas` gives each one's (its engine's pid too, with `authorized`)."""
        reps = self.replicas
        alive = [r.engine.alive for r in reps]  # once: an engine can exit while this is built
        up = sum(alive)
        body: dict[str, Any] = {
            "status": "ok" if up == len(reps) else "degraded" if up else "unavailable",
            "kv_slots": self.settings.kv_slots,
            "slots": self.settings.kv_slots * len(reps),
            "busy": sum(r.pool.busy for r in reps),
            "waiting": sum(r.pool.waiting for r in reps),
            "cancelled": sum(r.engine.cancelled for r in reps),
            "restarts": sum(r.engine.restarts for r in reps),
        }
        if not up:
            body["reason"] = reps.why_down()
        if authorized:
            body["scheduler"] = scheduler_json(reps)
            t = self.shown.engine.telemetry
            extras = {"tiers": tiers_json(t.tiers), "hwinfo": hwinfo_json(t.hwinfo)}
            body.update({k: v for k, v in extras.items() if v is not None})
        if len(reps) > 1:
            each = zip(reps, alive, strict=True)
            body["replicas"] = [replica_json(r, a, authorized) for r, a in each]
        return body

    def experts_seq(self) -> int:
        """The `seq` of `/experts`: the engine's; with several replicas their sum, which
        changes whenever any replica's map does."""
        reps = self.replicas
        if len(reps) == 1:
            return reps[0].engine.telemetry.seq
        return sum(r.engine.telemetry.seq for r in reps)

    def experts_json(self) -> dict:
        """`/experts`: the map of the replica shown; with several, `replicas` holds each
        one's map, and `seq` is `experts_seq`."""
        reps = self.replicas
        body = experts_json(self.shown.engine.telemetry)
        if len(reps) > 1:
            each = [{"replica": r.index, **experts_json(r.engine.telemetry)} for r in reps]
            body.update(seq=self.experts_seq(), replicas=each)
        return body

    def profile_json(self) -> dict:
        """`/profile`: the recent turns of the replica shown; with several, `replicas` holds
        each one's."""
        reps = self.replicas
        body = profile_json(self.shown.engine.telemetry)
        if len(reps) > 1:
            body["replicas"] = [
                {"replica": r.index, **profile_json(r.engine.telemetry)} for r in reps
            ]
        return body

    def authorized(self, request: Request) -> bool:
        """Whether the request carries the key, or none is set; constant-time compare."""
        key = self.settings.api_key
        if key is None:
            return True
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), key.encode()
        )

    def authorize(self, request: Request) -> None:
        """401 unless the request is authorized."""
        if not self.authorized(request):
            raise ApiError(401, "missing or invalid API key", code="invalid_api_key")

    async def read_json(self, request: Request) -> object:
        """The JSON body; 415 unless it says it is JSON, 413 past the cap (checked before and
        while reading), 400 if not JSON or not encodable as UTF-8 (a lone surrogate)."""
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            raise ApiError(415, f"expected Content-Type application/json, got {kind or 'none'}")
        cap = self.settings.max_body
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cap:
            raise ApiError(413, f"request body over {cap} bytes")
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > cap:
                    raise ApiError(413, f"request body over {cap} bytes")
        except ClientDisconnect:  # left (or timed out: `deadline`) before the body was whole
            raise ClientGone() from None
        try:
            data = json.loads(body)
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except RecursionError:
            raise ApiError(400, "request body is nested too deeply") from None
        except UnicodeEncodeError:
            raise ApiError(400, "request body holds a lone UTF-16 surrogate") from None
        except ValueError:
            raise ApiError(400, "request body is not valid JSON") from None
        return data

    async def answer(self, request: Request, job: Job, shape: Shape, stream: bool) -> Response:
        turn = await until_disconnect(request, self.start(job))
        reply = Reply(turn, job.stops)
        if stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return EventStream(
                self.events(reply, shape),
                on_close=reply.abandon,
                media_type="text/event-stream",
                headers=headers,
            )
        try:
            await until_disconnect(request, reply.read())
        finally:
            reply.abandon()
        if reply.done is None:
            raise end_error(reply.end)
        return JSONResponse(shape.body(reply))

    async def start(self, job: Job) -> EngineRequest:
        """Wait for a replica's slot, submit, and wait for its engine to accept (or refuse) the
        request."""
        try:
            replica, slot = await self.replicas.acquire(job.affinity, job.prompt)
        except Unavailable as e:
            raise ApiError(503, f"engine unavailable: {e}") from None
        except QueueFull as e:
            raise ApiError(429, f"server busy: {e}", code="queue_full") from None
        engine, pool = replica.engine, replica.pool
        sampling = (job.temperature, job.top_p)
        try:
            turn = engine.submit(slot, job.prompt, job.max_tokens, *sampling, job.grammar)
        except BaseException:
            pool.release(slot)  # nothing was sent: the slot is free again
            raise
        turn.replica, turn.own_cache = replica.index, pool.own(slot)
        turn.ended.add_done_callback(lambda _: pool.release(slot))
        try:
            first = await asyncio.shield(turn.started)
        except asyncio.CancelledError:
            turn.cancel()
            raise
        if isinstance(first, Error | EngineGone):
            raise end_error(first)
        return turn

    async def events(self, reply: Reply, shape: Shape) -> AsyncIterator[bytes]:
        """SSE frames: deltas, the finish, the colibri frame, then [DONE]."""
        try:
            for first in shape.opening():
                yield sse(first)
            async for piece in reply.deltas():
                yield sse(shape.chunk(piece, None))
            if reply.done is not None:
                yield sse(shape.chunk(None, reply.finish_reason))
                final = {**shape.head(), "choices": [], "usage": reply.usage()}
                yield sse({**final, "colibri": reply.colibri()})
            else:
                yield sse(end_error(reply.end).body())
            yield b"data: [DONE]\n\n"
        finally:
            reply.abandon()


class EventStream(StreamingResponse):
    """A streaming response that, however the stream ends, closes its generator and calls
    `on_close`: a client that disconnects (even before the first byte) has its request
    cancelled at once, not when the generator happens to be collected."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], **kw: Any):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self.on_close()


# ---------------------------------------------------------------------------- response shapes


class Shape:
    """The OpenAI objects of one endpoint: chunks while streaming, the body otherwise."""

    prefix = ""
    chunk_object = ""
    body_object = ""

    def __init__(self, model: str):
        self.model = model
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def head(self, obj: str | None = None) -> dict:
        return {
            "id": self.id,
            "object": obj or self.chunk_object,
            "created": self.created,
            "model": self.model,
        }

    def opening(self) -> list[dict]:
        return []

    def chunk(self, text: str | None, finish: str | None) -> dict:
        return {**self.head(), "choices": [self.chunk_choice(text, finish)]}

    def body(self, reply: Reply) -> dict:
        return {
            **self.head(self.body_object),
            "choices": [self.body_choice(reply)],
            "usage": reply.usage(),
            "colibri": reply.colibri(),
        }

    def chunk_choice(self, text: str | None, finish: str | None) -> dict:
        raise NotImplementedError

    def body_choice(self, reply: Reply) -> dict:
        raise NotImplementedError


class ChatShape(Shape):
    prefix, chunk_object, body_object = "chatcmpl", "chat.completion.chunk", "chat.completion"

    def opening(self) -> list[dict]:
        delta = {"role": "assistant", "content": ""}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        return [{**self.head(), "choices": [choice]}]

    def chunk_choice(self, text: str | None, finish: str | None) -> dict:
        delta = {} if text is None else {"content": text}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def body_choice(self, reply: Reply) -> dict:
        message = {"role": "assistant", "content": reply.text}
        return {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": reply.finish_reason,
        }


class CompletionShape(Shape):
    prefix, chunk_object, body_object = "cmpl", "text_completion", "text_completion"

    def chunk_choice(self, text: str | None, finish: str | None) -> dict:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    def body_choice(self, reply: Reply) -> dict:
        return {
            "index": 0,
            "text": reply.text,
            "logprobs": None,
            "finish_reason": reply.finish_reason,
        }


# ---------------------------------------------------------------------------- helpers


class RequestId:
    """ASGI middleware: every HTTP response carries `x-request-id`, the client's own when it
    sent a short printable one, else a new `req_<hex>`."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(REQUEST_ID_HEADER.encode(), b"")
        ok = 0 < len(given) <= MAX_REQUEST_ID and given.isascii() and given.decode().isprintable()
        rid = given if ok else f"req_{uuid.uuid4().hex}".encode()

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (REQUEST_ID_HEADER.encode(), rid)]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


class HostGuard:
    """ASGI middleware: on a loopback gateway, a request whose Host is not one of its names, or
    whose Origin names another host, gets 403: a web page cannot drive it through a name it
    controls (DNS rebinding) or from another site. `hosts` None: no check."""

    def __init__(self, app: Any, hosts: frozenset[str] | None):
        self.app, self.hosts = app, hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.hosts is not None:
            headers = dict(scope["headers"])
            host = _hostname(headers.get(b"host", b"").decode("latin-1"))
            origin = headers.get(b"origin", b"").decode("latin-1")
            foreign = origin and _hostname(origin.split("://")[-1])  # "null" is foreign too
            if host not in self.hosts or (foreign and foreign not in self.hosts):
                what = f"Origin {origin!r}" if host in self.hosts else f"Host {host!r}"
                body = ApiError(403, f"{what} is not this gateway's", code="forbidden").body()
                await JSONResponse(body, status_code=403)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _hostname(netloc: str) -> str:
    """`[::1]:8000` -> `::1`, `Localhost:80` -> `localhost`, `a.b` -> `a.b`."""
    netloc = netloc.split("/")[0].strip().lower()
    if netloc.startswith("["):
        return netloc[1:].split("]")[0]
    return netloc.rsplit(":", 1)[0] if netloc.count(":") == 1 else netloc


def scheduler_json(replicas: Iterable[Replica]) -> dict:
    """The queue as colibrì's gateway reports it (this queue has no time limit), summed over
    the replicas."""
    reps = list(replicas)
    pools = [r.pool for r in reps]
    return {
        "active": sum(p.busy for p in pools),
        "queued": sum(p.waiting for p in pools),
        "capacity": sum(len(p.slots) for p in pools),
        "max_queue": sum(p.max_waiting for p in pools),
        "admitted": sum(p.admitted for p in pools),
        "completed": sum(p.completed for p in pools),
        "rejected": sum(p.rejected for p in pools),
        "timed_out": 0,
        "cancelled": sum(r.engine.cancelled for r in reps),
    }


def replica_json(r: Replica, alive: bool, authorized: bool) -> dict:
    """One replica in `/health`: its liveness (`alive`, as the summary counted it), slots and
    queue; with `authorized`, also its engine's pid, its scheduler and its tiers."""
    engine = r.engine
    body: dict[str, Any] = {
        "replica": r.index,
        "status": "ok" if alive else "unavailable",
        "busy": r.pool.busy,
        "waiting": r.pool.waiting,
        "cancelled": engine.cancelled,
        "restarts": engine.restarts,
    }
    if not alive:
        body["reason"] = engine.why_down
    if authorized:
        body["pid"] = engine.proc.pid if engine.proc is not None else None
        body["scheduler"] = scheduler_json([r])
        if (tiers := tiers_json(engine.telemetry.tiers)) is not None:
            body["tiers"] = tiers
    return body


def atlas_bytes(path: Path | None) -> bytes | None:
    """What `/experts.json` serves: the file, with colibrì's keyed view of the experts when it
    is colibri's own atlas (`colibri.atlas.upstream_view`); None when there is no file."""
    if path is None or not path.is_file():
        return None
    data = path.read_bytes()
    try:
        atlas = json.loads(data)
    except ValueError:
        return data
    if isinstance(atlas, dict) and isinstance(atlas.get("experts"), list):
        return json.dumps(upstream_view(atlas), ensure_ascii=False).encode()
    return data


def chat_affinity(messages: list[dict], named: str | None) -> Affinity:
    """A named conversation keeps its name; otherwise the slot is found by the messages before
    the last assistant turn (what the previous request sent) and left keyed by all of them."""
    if named:
        return Affinity(find=named, keep=named)
    assistant = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    find = conversation_key(messages[: assistant[-1]]) if assistant else None
    return Affinity(find=find, keep=conversation_key(messages))


def end_error(ev: object) -> ApiError:
    """The HTTP error for a request the engine refused or could not finish."""
    if isinstance(ev, Error):
        if ev.code == "CONTEXT_EXCEEDED":
            n, cap = (ev.detail + ("?", "?"))[:2]
            msg = f"the prompt has {n} tokens; this model's context holds {cap} positions"
            return ApiError(400, msg, code="context_length_exceeded", param="messages")
        if ev.code in ("BAD_REQUEST", "EMPTY_PROMPT"):
            return ApiError(400, f"the engine refused the request ({ev.code})", code=ev.code)
        return ApiError(500, f"the engine failed the request ({ev.code})", code=ev.code)
    reason = ev.reason if isinstance(ev, EngineGone) else "no answer"
    return ApiError(503, f"engine unavailable: {reason}", code="engine_unavailable")


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await work unless the client disconnects first (then work is cancelled: ClientGone)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client goes (the body has been read, so only a disconnect can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    return await _on_api_error(request, ApiError(exc.status_code, str(exc.detail)))


async def _on_client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nobody reads it; nginx's code for "client closed"
