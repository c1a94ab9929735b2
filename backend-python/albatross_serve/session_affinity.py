"""Sending a session's requests to the replica that holds its state in memory.

Serve's proxy routes on the `X-Session-Id` header by consistent hashing (deployment.py). Clients of
the rwkv_lightning state routes name the session only in the body (`session_id`), which the proxy
never reads. So a replica that receives a state-route request without the header reads the body and
hands the request, through a deployment handle carrying that session id (the same consistent-hash
router), to the session's replica, and relays its ASGI messages back. A forwarded request is marked,
so it is never forwarded twice. Correctness never depends on this: any replica can serve any session
from the shared Redis tier; it only saves the state load from Redis.

The session's replica may be the one that received the request. Then the handle call comes back to
this process, and the replica serves the request itself instead of relaying its own reply through
Ray: a stream that a replica both runs and consumes loses its last message now and then (Ray 2.60:
the message's object is ready, the await on it never wakes), which left the client waiting. The mark
carries a token of the request, so the session's replica recognises a request that came from it.

A forward to another replica is bounded: that replica sends a heartbeat while its app is silent, and
a forward that hears nothing for `SILENCE_S` (or whose replica fails) ends with a 503, or with an
error event closing a stream that had started.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

from ray import serve
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runner.limits import send_json_error
from runner.sse import DONE_EVENT, error_event

log = logging.getLogger("albatross_serve")

STATE_ROUTES = frozenset({"/state/chat/completions", "/multi_state/chat/completions", "/state/delete"})
SESSION_HEADER = os.environ.get("RAY_SERVE_SESSION_ID_HEADER_KEY", "x-session-id").lower().encode()
FORWARDED_HEADER = b"x-albatross-forwarded"  # its value: the token of the forwarding request
MAX_READ_BYTES = 4 * 1024 * 1024  # a larger body is not inspected: the app's own size limit answers it
HEARTBEAT = "albatross.forward.alive"  # a message type between replicas, never sent to a client
HEARTBEAT_S = 5.0  # the session's replica says it is alive this often while its app sends nothing
SILENCE_S = 30.0  # six heartbeats missed: the session's replica is stuck, or the call was lost
_SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "query_string", "root_path", "headers", "client", "server")

# The forwards this process has in flight, by token: a forward that arrives here from here resolves
# its future instead of running (the router chose this replica as the session's).
_SENT_FROM_HERE: dict[str, asyncio.Future[None]] = {}


class Relayed(enum.Enum):
    """How a forward ended."""

    ANSWERED = enum.auto()  # the client has its whole reply: the session's replica's, or an error
    CLIENT_LEFT = enum.auto()
    HOME_IS_HERE = enum.auto()  # nothing was sent: the session's replica is this one, which serves it


def body_session_id(body: bytes) -> str | None:
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    session_id = payload.get("session_id") if isinstance(payload, dict) else None
    return session_id if isinstance(session_id, str) and session_id else None


def _replayed(chunks: list[bytes], more: bool, receive: Receive) -> Receive:
    """A receive that gives back what was read, then the rest of the original."""
    pending = list(chunks)

    async def replay() -> Message:
        if pending:
            chunk = pending.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(pending) or more}
        return await receive()

    return replay


def _forwarded_scope(scope: Scope, token: str) -> dict[str, Any]:
    forwarded = {key: scope[key] for key in _SCOPE_KEYS if key in scope}
    forwarded["headers"] = [*scope.get("headers", ()), (FORWARDED_HEADER, token.encode())]
    return forwarded


class SessionAffinityMiddleware:
    def __init__(self, app: ASGIApp, deployment_name: str, app_name: str) -> None:
        self.app = app
        self.deployment_name = deployment_name
        self.app_name = app_name
        self._handle: Any = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._needs_forwarding(scope):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size, more = 0, True
        while more and size <= MAX_READ_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body arrived
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
        session_id = None if more else body_session_id(b"".join(chunks))
        if session_id is None:
            await self.app(scope, _replayed(chunks, more, receive), send)
            return
        body = b"".join(chunks)
        if await self._forward(scope, body, session_id, receive, send) is Relayed.HOME_IS_HERE:
            await self.app(scope, _replayed([body], False, receive), send)

    @staticmethod
    def _needs_forwarding(scope: Scope) -> bool:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in STATE_ROUTES:
            return False
        return not any(name in (SESSION_HEADER, FORWARDED_HEADER) for name, _ in scope.get("headers", ()))

    async def _forward(self, scope: Scope, body: bytes, session_id: str, receive: Receive, send: Send) -> Relayed:
        if self._handle is None:
            self._handle = serve.get_deployment_handle(self.deployment_name, app_name=self.app_name)
        token = uuid.uuid4().hex
        _SENT_FROM_HERE[token] = came_back = asyncio.get_running_loop().create_future()
        try:
            response = self._handle.options(stream=True, session_id=session_id).forward.remote(_forwarded_scope(scope, token), body)
            return await relay(response, came_back, receive, send, session_id)
        finally:
            del _SENT_FROM_HERE[token]


class _Reply:
    """What has gone to the client of a forward, so that a failure can still end it properly."""

    __slots__ = ("started", "streaming")

    def __init__(self) -> None:
        self.started = False
        self.streaming = False  # an SSE reply: ended with an error event and [DONE], not cut off

    def observe(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.streaming = dict(message.get("headers", ())).get(b"content-type", b"").startswith(b"text/event-stream")

    async def fail(self, send: Send, message: str) -> None:
        if not self.started:
            await send_json_error(send, 503, message)
            return
        tail = error_event(503, message) + DONE_EVENT if self.streaming else b""
        await send({"type": "http.response.body", "body": tail, "more_body": False})


async def _disconnected(receive: Receive) -> None:
    """Returns once the client is gone: its disconnect, or a receive that raised (Serve's receive
    raises what went wrong fetching the request's messages from its proxy)."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:
        return


def _is_last(message: Message) -> bool:
    return message["type"] == "http.response.body" and not message.get("more_body", False)


def _ignore_outcome(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: asyncio would log it as never retrieved


class ForwardStream(Protocol):
    """What relay needs of the handle's DeploymentResponseGenerator."""

    def __aiter__(self) -> AsyncIterator[Message]: ...

    def cancel(self) -> None: ...


async def relay(response: ForwardStream, came_back: asyncio.Future[None], receive: Receive, send: Send, session_id: str, silence_s: float = SILENCE_S) -> Relayed:
    """Sends the messages of a forward on to the client, until its last one, the client leaving,
    the forward coming back to this replica (`came_back`), or `silence_s` without a message."""
    reply = _Reply()
    client_left = asyncio.ensure_future(_disconnected(receive))
    messages = response.__aiter__()
    running = True  # the forward has not ended: leaving early cancels it on its replica
    waiting: asyncio.Future[Message] | None = None
    try:
        while True:
            waiting = asyncio.ensure_future(messages.__anext__())
            watched: set[asyncio.Future[Any]] = {waiting, came_back, client_left}
            done, _ = await asyncio.wait(watched, timeout=silence_s, return_when=asyncio.FIRST_COMPLETED)
            if client_left.done():
                return Relayed.CLIENT_LEFT
            if came_back.done():
                return Relayed.HOME_IS_HERE
            if not done:
                log.warning("session %r: its replica sent nothing for %g s; answering 503", session_id, silence_s)
                await reply.fail(send, f"the replica of session {session_id!r} did not answer for {silence_s:g} s; retry the request")
                return Relayed.ANSWERED
            try:
                message = waiting.result()
            except Exception as error:  # its replica died, or Ray lost the call; StopAsyncIteration: it ended early
                running = False
                log.warning("session %r: the forward to its replica failed: %r", session_id, error)
                await reply.fail(send, f"the replica of session {session_id!r} failed ({type(error).__name__}); retry the request")
                return Relayed.ANSWERED
            if message["type"] == HEARTBEAT:
                continue
            reply.observe(message)
            await send(message)
            if _is_last(message):
                running = False
                return Relayed.ANSWERED
    finally:
        if running:
            if waiting is not None:
                waiting.cancel()
                waiting.add_done_callback(_ignore_outcome)  # it ends with RequestCancelledError
            response.cancel()
        client_left.cancel()
        await asyncio.wait({client_left})  # gone before the app may call receive (HOME_IS_HERE)


def _came_from_here(scope: dict[str, Any]) -> asyncio.Future[None] | None:
    token = dict(scope.get("headers", ())).get(FORWARDED_HEADER, b"")
    return _SENT_FROM_HERE.get(token.decode("latin-1"))


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def run_forwarded(app: ASGIApp, scope: dict[str, Any], body: bytes, heartbeat_s: float = HEARTBEAT_S) -> AsyncIterator[Message]:
    """Runs a forwarded request through `app`, yielding what it sends, and a HEARTBEAT message each
    `heartbeat_s` it sends nothing. Closing the iterator (the original client left, or the caller's
    replica died) tells the app its client disconnected. A request forwarded by this very replica
    yields nothing: its forward serves it (module docstring)."""
    came_back = _came_from_here(scope)
    if came_back is not None:
        came_back.get_loop().call_soon_threadsafe(_resolve, came_back)
        return
    sent: asyncio.Queue[Message] = asyncio.Queue()
    left = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    task = asyncio.ensure_future(app(scope, receive, sent.put))
    getting: asyncio.Future[Message] | None = None
    try:
        while True:
            if getting is None:  # one get spans the heartbeats until the app sends
                getting = asyncio.ensure_future(sent.get())
            watched: set[asyncio.Future[Any]] = {getting, task}
            done, _ = await asyncio.wait(watched, timeout=heartbeat_s, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                yield {"type": HEARTBEAT}
                continue
            if not getting.done():  # the app returned: what it sent is all there is
                while not sent.empty():
                    yield sent.get_nowait()
                break
            message, getting = getting.result(), None
            yield message
            if _is_last(message):
                break
        await task
    finally:
        if getting is not None:
            getting.cancel()
        left.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, timeout=5.0)
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
                task.cancel()
