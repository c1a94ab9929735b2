"""A deadline for a request's headers, which uvicorn does not have.

uvicorn closes a keep-alive connection that stays idle, but a client that opens a connection and
sends nothing, or trickles its request line and headers a byte at a time, holds the connection
(and a file descriptor) for as long as it likes, and needs no password to do it: headers come
before any route. `header_deadline_protocol(base, seconds)` subclasses uvicorn's HTTP protocol
(httptools or h11): from the moment a connection opens, or a response completes and the
connection waits for its next request, the next request's headers must be complete within
`seconds`, else the server answers 408 (a JSON error, as every route answers) and closes the
connection. The body has its own deadline in runner/json_body.py.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from runner.errors import error_bytes

log = logging.getLogger("runner.read_timeout")


def _timeout_response(seconds: float) -> bytes:
    body = error_bytes(408, f"the request headers did not arrive within {seconds:g} s (--request-read-timeout)")
    head = (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n"
    )
    return head + body


class _HeaderDeadline:
    """Mixed into a uvicorn HTTP protocol (an asyncio.Protocol with `cycle`, `transport`, `loop`)."""

    header_timeout_s: float = 30.0
    cycle: Any
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        cycle_before = self.cycle
        super().data_received(data)  # type: ignore[misc]
        if self.cycle is not cycle_before:  # the parser completed a request's headers
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing():
            self._arm_header_timer()  # uvicorn's keep-alive timer covers silence; this covers a trickle

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _cancel_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            return  # a request is being served; its headers came in time
        client = self.transport.get_extra_info("peername")
        log.info("closing a connection from %s: no complete request headers within %g s", client, self.header_timeout_s)
        self.transport.write(_timeout_response(self.header_timeout_s))
        self.transport.close()


def header_deadline_protocol(seconds: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (httptools when installed, as uvicorn's "auto" picks) with the
    header deadline mixed in."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:  # httptools missing: uvicorn falls back to h11, and so do we
        from uvicorn.protocols.http.h11_impl import H11Protocol as base  # type: ignore[assignment]
    return type(f"HeaderDeadline{base.__name__}", (_HeaderDeadline, base), {"header_timeout_s": seconds})
