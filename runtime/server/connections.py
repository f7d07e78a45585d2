"""Connections (`serve`): uvicorn's h11 protocol with a header timeout and a limit on open connections.

uvicorn times out a connection only while it is idle between requests (timeout_keep_alive), so one that
trickles its request line and headers a byte at a time (slowloris), or sends nothing at all, stays open as
long as its client likes, and enough of them exhaust the server's sockets. Here:
- a connection's request line and headers must arrive within `header_timeout_s` of its first byte (of the
  connection, for its first request); past it the server answers 408 and closes it. The body has its own
  timeout, enforced while the app reads it (protocol.py).
- a request that arrives while more than `max_connections` connections are open gets a 503 (OpenAI's error
  body) and its connection is closed; uvicorn's own limit (limit_concurrency) would answer in plain text.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from llmc.runtime.server.errors import error_body, error_response


def _raw_response(status: int, reason: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + data


_HEADER_TIMEOUT = _raw_response(
    408,
    "Request Timeout",
    error_body("the request line and headers did not arrive in time", 408, code="request_timeout"),
)


class GuardedH11Protocol(H11Protocol):
    """H11Protocol with the header timeout and the connection limit; `protocol_class` sets both."""

    header_timeout_s: float = 10.0
    max_connections: int = 512

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._served_app = self.app
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()  # a connection that sends nothing at all times out too

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # the first bytes of the next request on a kept-alive connection
        over = len(self.connections) > self.max_connections
        self.app = _too_many_connections if over else self._served_app
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request line and headers are in
            self._cancel_header_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.write(_HEADER_TIMEOUT)
            self.transport.close()


async def _too_many_connections(scope, receive, send) -> None:
    response = error_response(
        "the server has too many open connections; retry later",
        503,
        code="too_many_connections",
        headers={"Connection": "close", "Retry-After": "1"},
    )
    await response(scope, receive, send)


def protocol_class(header_timeout_s: float, max_connections: int) -> type[GuardedH11Protocol]:
    """The protocol for uvicorn.Config(http=...), with these bounds."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"header_timeout_s": header_timeout_s, "max_connections": max_connections},
    )
