"""OpenAI request bodies as validated models, and errors as OpenAI-style JSON.

Unknown fields are accepted and ignored (clients send many); values the engine cannot honour
(n > 1, temperature outside [0, 2], top_p outside (0, 1]) are 400s here, before any slot is used.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_STOPS = 16
MAX_GRAMMAR = 1 << 20  # response_format grammar or schema cap, bytes (the engine's)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """An HTTP error answered as `{"error": {message, type, param, code}}`."""

    def __init__(
        self, status: int, message: str, code: str | None = None, param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict:
        kind = _ERROR_TYPES.get(self.status, "server_error")
        err = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return {"error": err}


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = Field(1, ge=1, le=1)
    user: str | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        return v

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def grammar(self) -> str:
        """The SUBMIT grammar for `response_format` ("" for none or text): a json_schema's
        schema as JSON, `{"type": "object"}` for json_object, a `gbnf` grammar as given. The
        engine keeps it on the request; it does not constrain decoding (yet)."""
        fmt = self.response_format
        kind = None if fmt is None else fmt.get("type")
        if kind in (None, "text"):
            return ""
        if kind == "json_object":
            grammar = '{"type": "object"}'
        elif kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise ApiError(
                    400,
                    "response_format.json_schema.schema must be an object",
                    param="response_format",
                )
            grammar = json.dumps(schema, ensure_ascii=False)
        elif kind == "gbnf":
            grammar = fmt.get("grammar")
            if not isinstance(grammar, str) or not grammar.strip():
                raise ApiError(
                    400, "response_format.grammar must be a GBNF string", param="response_format"
                )
        else:
            raise ApiError(
                400,
                f"response_format.type {kind!r}: expected text, json_object, json_schema or gbnf",
                param="response_format",
            )
        if "\0" in grammar or len(grammar.encode()) > MAX_GRAMMAR:
            raise ApiError(
                400,
                f"response_format: a NUL byte, or over {MAX_GRAMMAR} bytes",
                param="response_format",
            )
        return grammar

    def sampling(self) -> tuple[float, float]:
        """(temperature, top_p) with OpenAI's defaults."""
        t = 1.0 if self.temperature is None else self.temperature
        return t, 1.0 if self.top_p is None else self.top_p


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def to_template(self) -> dict:
        """The message as a chat template sees it: content as one string."""
        m = self.model_dump(exclude_none=True)
        m["content"] = _text_content(self.content)
        return m


class ChatRequest(_Body):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> list[dict]:
        return [m.to_template() for m in self.messages]


class CompletionRequest(_Body):
    prompt: str | list[str]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions

    def text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ApiError(400, "exactly one prompt per request is supported", param="prompt")
        return self.prompt[0]


def parse(model: type[_Body], data: object) -> Any:
    """The validated body, or a 400 naming the first bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or None
        message = f"{where}: {first['msg']}" if where else first["msg"]
        raise ApiError(400, message, param=where) from None


def conversation_key(messages: list[dict]) -> str:
    """A stable hash of a message list (the key its slot is remembered by)."""
    blob = json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()


def _text_content(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, "only text content parts are supported", param="messages")
        parts.append(part["text"])
    return "".join(parts)
