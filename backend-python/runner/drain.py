"""Graceful drain on SIGTERM: readiness goes false, new requests get 503 with `Retry-After`,
requests already running get up to `--drain-timeout` seconds to finish, and whatever still runs
then is ended (a stream with an error event and `[DONE]`, a request whose reply has not started
with a 503). Cached states are flushed meanwhile, and once more when the model shuts down.

`DrainMiddleware` is the outermost layer of the app, so it sees every request; probes and status
(ALWAYS_OPEN) keep answering while the server drains and do not count as work. `DrainingServer` is
uvicorn's server with SIGTERM routed here instead of straight to uvicorn's shutdown (which closes the
listener at once and waits for streams without bound). A second SIGTERM or a SIGINT during the
drain stops at once, as uvicorn does.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runner.context import app_context
from runner.errors import error_bytes
from runner.sse import DONE_EVENT, error_event

log = logging.getLogger("runner.drain")

ALWAYS_OPEN = frozenset({"/healthz", "/readyz", "/status", "/metrics"})
RETRY_AFTER_S = 5  # a client (or its balancer) should try another replica soon
ENDING_GRACE_S = 5.0  # how long ended requests get to send their last bytes


class _Flight:
    """One request in progress: what its response has sent so far, and how to end it."""

    __slots__ = ("expired", "started", "streaming", "finished")

    def __init__(self) -> None:
        self.expired = asyncio.Event()
        self.started = False
        self.streaming = False  # an SSE reply: ended with an error event, not cut off
        self.finished = False

    def observe(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            headers = dict(message.get("headers", ()))
            self.streaming = headers.get(b"content-type", b"").startswith(b"text/event-stream")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.finished = True


class Drain:
    """The drain state of one app. All methods run on the app's event loop."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.draining = False
        self.deadline: float | None = None
        self._flights: set[_Flight] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.ended_requests = 0

    @property
    def in_flight(self) -> int:
        return len(self._flights)

    def begin(self) -> None:
        if not self.draining:
            self.draining = True
            self.deadline = time.monotonic() + self.timeout_s
            log.info("draining: refusing new requests; %d running get up to %.0f s", len(self._flights), self.timeout_s)

    async def run(self, flush: Callable[[], Awaitable[object]] | None = None) -> None:
        """Begin, let running requests finish until the deadline, end the rest, flush states."""
        self.begin()
        flushing = asyncio.ensure_future(flush()) if flush is not None else None
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=self.timeout_s)
        except asyncio.TimeoutError:
            self.ended_requests = len(self._flights)
            log.warning("drain timeout (%.0f s): ending %d running request(s)", self.timeout_s, len(self._flights))
            for flight in list(self._flights):
                flight.expired.set()
            try:
                await asyncio.wait_for(self._idle.wait(), timeout=ENDING_GRACE_S)
            except asyncio.TimeoutError:
                log.error("%d request(s) did not end within %.0f s of being told to", len(self._flights), ENDING_GRACE_S)
        if flushing is not None:
            try:
                await flushing
            except Exception:
                log.exception("flushing cached states during the drain failed")
        log.info("drained")

    def _enter(self) -> _Flight:
        flight = _Flight()
        self._flights.add(flight)
        self._idle.clear()
        return flight

    def _leave(self, flight: _Flight) -> None:
        self._flights.discard(flight)
        if not self._flights:
            self._idle.set()


REFUSAL = "the server is shutting down (draining); retry on another replica"


class DrainMiddleware:
    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in ALWAYS_OPEN:
            await self.app(scope, receive, send)
            return
        drain = self.drain
        if drain.draining:
            await _send_503(send, REFUSAL)
            return
        flight = drain._enter()
        try:
            await self._serve(flight, scope, receive, send)
        finally:
            drain._leave(flight)

    async def _serve(self, flight: _Flight, scope: Scope, receive: Receive, send: Send) -> None:
        async def observed_send(message: Message) -> None:
            flight.observe(message)
            await send(message)

        # The request runs in its own task, so the drain can end it at the deadline and still
        # answer on its connection.
        task = asyncio.ensure_future(self.app(scope, receive, observed_send))
        expired = asyncio.ensure_future(flight.expired.wait())
        try:
            await asyncio.wait({task, expired}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # The server cancelled the request (its client left, or shutdown): the app's own cleanup
            # (aborting its generation, releasing its session) finishes before the request ends.
            # (A cancel scope, as in anyio's, cancels again at every await: wait through those.)
            task.cancel()
            while not task.done():
                try:
                    await asyncio.wait({task})
                except asyncio.CancelledError:
                    pass
            raise
        finally:
            expired.cancel()
        if task.done():
            task.result()  # re-raises what the app raised
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("a request ended by the drain failed while ending")
        await _end(flight, send, self.drain.timeout_s)


async def _send_503(send: Send, message: str) -> None:
    body = error_bytes(503, message)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"retry-after", str(RETRY_AFTER_S).encode())]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _end(flight: _Flight, send: Send, timeout_s: float) -> None:
    message = f"the server shut down: this request ran past the {timeout_s:.0f} s drain timeout (--drain-timeout); retry it"
    try:
        if not flight.started:
            await _send_503(send, message)
        elif not flight.finished:
            tail = error_event(503, message) + DONE_EVENT if flight.streaming else b""
            await send({"type": "http.response.body", "body": tail, "more_body": False})
    except OSError:
        pass  # the client is gone as well


def state_flusher(app: FastAPI) -> Callable[[], Awaitable[None]]:
    """Writes the loaded backend's cached states during the drain, so that a stop keeps the prefix
    cache; the model's shutdown afterwards flushes what the last requests added."""

    async def flush() -> None:
        ctx = app_context(app)
        store = getattr(ctx.manager.backend, "state_store", None)
        if callable(getattr(store, "flush", None)):
            await asyncio.to_thread(store.flush, ctx.settings.drain_timeout)  # type: ignore[union-attr]

    return flush


class DrainingServer(uvicorn.Server):
    """uvicorn's server; the first SIGTERM drains the app (`Drain.run`) before uvicorn shuts down."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.drain: Drain = app.state.drain
        self._flush = state_flusher(app)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_requested = False
        self._drain_task: asyncio.Future[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        loop = self._loop
        if sig == signal.SIGTERM and not self._drain_requested and loop is not None and self.started and not self.should_exit:
            self._drain_requested = True
            self._captured_signals.append(sig)  # re-raised after shutdown, as uvicorn does
            loop.call_soon_threadsafe(self._start_drain)
            return
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        async def drain_then_exit() -> None:
            try:
                await self.drain.run(self._flush)
            finally:
                self.should_exit = True

        self._drain_task = asyncio.ensure_future(drain_then_exit())
