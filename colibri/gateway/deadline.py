"""Half-sent requests time out: uvicorn's h11 protocol with a deadline on what the client owes.

uvicorn bounds an idle keep-alive connection (`timeout_keep_alive`, after a response) and the
size of a header block (h11's limit), but not the time a request takes to arrive: a client that
opens a connection and sends nothing, half its headers, or headers and part of a declared body,
then stays silent, held its connection (and, for a body, a handler waiting on it) forever.

`deadline_protocol(seconds)` is `H11Protocol` with one timer. It runs while the client owes
bytes: from the moment the connection opens, and again from the first byte of each request; it
stops once the request has arrived whole (h11 reads the client as DONE). When it passes:

- a request begun and not answered gets `408 Request Timeout` (`Connection: close`), and the
  connection is closed; a handler still reading the body sees the client leave (the gateway's
  `ClientGone`), so nothing it took stays taken, though no slot is taken before a whole body;
- a connection that sent nothing, or whose response has already started (a handler that
  answered without reading the body), is closed without a word.

It relies on what `H11Protocol` keeps per connection (`conn`, `cycle`, `transport`), stable
across uvicorn's releases; it is the gateway's only HTTP/1.1 implementation (h11, which
uvicorn always installs: no httptools needed).
"""

from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("colibri.gateway")

OWED = (h11.IDLE, h11.SEND_BODY)  # the client's h11 states in which it owes us bytes


def deadline_protocol(seconds: float, body: dict | None = None) -> type[H11Protocol]:
    """An `H11Protocol` class whose requests must arrive whole within `seconds` (see the
    module's doc); `body`: the JSON of the 408 response."""
    if not seconds > 0:
        raise ValueError(f"request timeout {seconds}: expected > 0 seconds")
    payload = json.dumps(body or {"error": "request timeout"}).encode()
    response = (
        b"HTTP/1.1 408 Request Timeout\r\n"
        b"content-type: application/json\r\n"
        b"content-length: %d\r\n"
        b"connection: close\r\n\r\n" % len(payload)
    ) + payload

    class DeadlineProtocol(H11Protocol):
        timeout = seconds

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._deadline: asyncio.TimerHandle | None = None
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE and not self.conn.trailing_data[0]:
                self._disarm()  # the first byte of a request: its time starts now
            super().data_received(data)  # (ends in handle_events, which watches)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state in OWED and not self.transport.is_closing():
                if self._deadline is None:
                    self._arm()
            else:
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._deadline = self.loop.call_later(self.timeout, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            body = self.conn.their_state is h11.SEND_BODY  # (else `cycle` is an earlier one's)
            answered = body and self.cycle is not None and self.cycle.response_started
            begun = body or bool(self.conn.trailing_data[0])
            if begun and not answered:
                self.transport.write(response)
            log.debug(
                "closing a connection from %s: no whole request in %g s%s",
                self.client,
                self.timeout,
                " (408)" if begun and not answered else "",
            )
            self.transport.close()  # connection_lost tells a running handler the client left

    return DeadlineProtocol
