"""Half-sent requests time out: a real `colibri gateway` (tiny checkpoint, real engine) with a
short `--request-timeout`, driven over raw sockets. A client that stops mid-headers or
mid-body gets 408 and its connection closed within the timeout; one that sends nothing is
closed; no slot stays taken, and whole requests are served meanwhile."""

from __future__ import annotations

import argparse
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from gateway_util import HOST, Gateway

from colibri.gateway.deadline import deadline_protocol
from colibri.gateway.server import add_arguments, settings_from_args
from colibri.gateway.settings import GatewaySettings

TIMEOUT = 1.5  # --request-timeout of the gateway under test
SLACK = 3.0  # how much later than TIMEOUT a close may come on a busy 2-core box


@pytest.fixture(scope="module")
def gateway(checkpoints, tmp_path_factory):
    log = tmp_path_factory.mktemp("timeouts") / "gateway.log"
    args = ["--kv-slots", "2", "--ctx", "256", "--request-timeout", str(TIMEOUT), "--web", ""]
    gw = Gateway(checkpoints("qwen3_moe"), *args, log=log)
    yield gw
    status = gw.close()
    assert status == 0, gw.logs()
    assert "Traceback" not in gw.logs(), gw.logs()


def head(length: int, path: str = "/v1/completions", kind: str = "application/json") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: {kind}\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


BODY = json.dumps({"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}).encode()


def until_closed(port: int, *pieces: bytes, pause: float = 0.0) -> tuple[bytes, float]:
    """Send pieces (pause seconds apart), then read until the server closes: (everything it
    sent, seconds from the first piece to the close)."""
    with socket.create_connection((HOST, port), timeout=TIMEOUT + 30) as s:
        t0 = time.monotonic()
        for i, piece in enumerate(pieces):
            if i and pause:
                time.sleep(pause)
            s.sendall(piece)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        return data, time.monotonic() - t0


def status_of(data: bytes) -> int:
    return int(data.split(b" ", 2)[1])


def json_of(data: bytes) -> dict:
    return json.loads(data.partition(b"\r\n\r\n")[2])


def no_slot_held(gateway: Gateway) -> None:
    h = gateway.health().json()
    assert h["status"] == "ok" and h["busy"] == 0 and h["waiting"] == 0, h


def test_half_sent_headers_get_408_and_are_closed(gateway):
    partial = f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}\r\nContent-Ty".encode()
    data, took = until_closed(gateway.port, partial)
    assert status_of(data) == 408 and b"connection: close" in data.lower()
    assert json_of(data)["error"]["code"] == "request_timeout"
    assert TIMEOUT * 0.9 <= took <= TIMEOUT + SLACK
    no_slot_held(gateway)


def test_half_sent_body_gets_408_and_holds_no_slot(gateway):
    data, took = until_closed(gateway.port, head(len(BODY)) + BODY[:10])
    assert status_of(data) == 408 and json_of(data)["error"]["type"] == "invalid_request_error"
    assert TIMEOUT * 0.9 <= took <= TIMEOUT + SLACK
    no_slot_held(gateway)


def test_the_time_runs_from_the_first_byte(gateway):
    """Sending a little now and then does not extend it: a request trickled in over most of
    the timeout is cut when the timeout has passed since its first byte, not its last."""
    pieces = [head(len(BODY))] + [BODY[i : i + 2] for i in range(0, 8, 2)]
    data, took = until_closed(gateway.port, *pieces, pause=TIMEOUT / 5)  # the last at 0.8 T
    assert status_of(data) == 408 and TIMEOUT * 0.9 <= took < TIMEOUT * 1.7


def test_the_second_request_of_a_connection_times_out_too(gateway):
    """On a kept-alive connection, a whole request is answered; the next one, half-sent, is
    answered 408 (not taken for the first one's, already answered)."""
    with socket.create_connection((HOST, gateway.port), timeout=TIMEOUT + 30) as s:
        s.sendall(head(len(BODY)) + BODY)
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        headers, _, rest = data.partition(b"\r\n\r\n")
        length = int(headers.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        while len(rest) < length:
            rest += s.recv(65536)
        assert status_of(headers) == 200 and json.loads(rest)["usage"]["completion_tokens"] >= 1
        time.sleep(TIMEOUT / 2)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: ")
        t0, data = time.monotonic(), b""
        while chunk := s.recv(65536):
            data += chunk
        took = time.monotonic() - t0
    assert status_of(data) == 408 and TIMEOUT * 0.9 <= took <= TIMEOUT + SLACK
    no_slot_held(gateway)


def test_a_silent_connection_is_closed_without_an_answer(gateway):
    data, took = until_closed(gateway.port)
    assert data == b"" and TIMEOUT * 0.9 <= took <= TIMEOUT + SLACK


def test_an_answer_before_the_body_then_the_connection_closes(gateway):
    """A handler that answers before reading the body (415 here) answers at once; the body the
    client still owes is not waited for past the deadline."""
    data, took = until_closed(gateway.port, head(100, kind="text/plain") + b"{")
    assert status_of(data) == 415 and took <= TIMEOUT + SLACK


def test_whole_requests_are_served_while_half_sent_ones_wait(gateway):
    """Many half-sent bodies at once (more than the slots and the queue) and a whole request
    beside them: the whole one is answered; the others all get 408; every slot is free."""
    with ThreadPoolExecutor(8) as pool:
        stuck = [
            pool.submit(until_closed, gateway.port, head(len(BODY)) + BODY[:5]) for _ in range(7)
        ]
        ok = httpx.post(gateway.url + "/v1/completions", json=json.loads(BODY), timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
        assert all(status_of(f.result(timeout=60)[0]) == 408 for f in stuck)
    no_slot_held(gateway)


def test_a_request_sent_in_pieces_within_the_deadline_is_served(gateway):
    pieces = [head(len(BODY))[:20], head(len(BODY))[20:], BODY[:10], BODY[10:]]
    with socket.create_connection((HOST, gateway.port), timeout=60) as s:
        for piece in pieces:
            s.sendall(piece)
            time.sleep(TIMEOUT / 8)
        data = s.recv(65536)
    assert status_of(data) == 200
    # and a keep-alive connection serves a second request as well
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        for _ in range(2):
            assert (
                client.post(
                    "/v1/completions", content=BODY, headers={"Content-Type": "application/json"}
                ).status_code
                == 200
            )
    no_slot_held(gateway)


def test_the_timeout_setting_and_flag(tmp_path: Path):
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--model", str(tmp_path)])
    assert settings_from_args(args).request_timeout == 30.0
    args = p.parse_args(["--model", str(tmp_path), "--request-timeout", "2.5"])
    assert settings_from_args(args).request_timeout == 2.5
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="request_timeout"):
            GatewaySettings(model_dir=tmp_path, model_id="m", request_timeout=bad)
    with pytest.raises(ValueError, match="request timeout"):
        deadline_protocol(0)
