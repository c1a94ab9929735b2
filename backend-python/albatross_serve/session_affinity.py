"""Sending a session's requests to the replica that holds its state in memory.

Serve's proxy routes on the `X-Session-Id` header by consistent hashing (deployment.py). Clients of
the rwkv_lightning state routes name the session only in the body (`session_id`), which the proxy
never reads. So a replica that receives a state-route request without the header reads the body and
hands the request, through a deployment handle carrying that session id (the same consistent-hash
router), to the session's replica, and relays its ASGI messages back. The replica of the session
may be this one. A forwarded request is marked, so it is never forwarded twice. Correctness never
depends on this: any replica can serve any session from the shared Redis tier; it only saves the
state load from Redis.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from starlette.types import ASGIApp, Message, Receive, Scope, Send

STATE_ROUTES = frozenset({"/state/chat/completions", "/multi_state/chat/completions", "/state/delete"})
SESSION_HEADER = os.environ.get("RAY_SERVE_SESSION_ID_HEADER_KEY", "x-session-id").lower().encode()
FORWARDED_HEADER = b"x-albatross-forwarded"
MAX_READ_BYTES = 4 * 1024 * 1024  # a larger body is not inspected: the app's own size limit answers it
_SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "query_string", "root_path", "headers", "client", "server")


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
        await self._forward(scope, b"".join(chunks), session_id, receive, send)

    @staticmethod
    def _needs_forwarding(scope: Scope) -> bool:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in STATE_ROUTES:
            return False
        return not any(name in (SESSION_HEADER, FORWARDED_HEADER) for name, _ in scope.get("headers", ()))

    async def _forward(self, scope: Scope, body: bytes, session_id: str, receive: Receive, send: Send) -> None:
        if self._handle is None:
            self._handle = serve.get_deployment_handle(self.deployment_name, app_name=self.app_name)
        forwarded = {key: scope[key] for key in _SCOPE_KEYS if key in scope}
        forwarded["headers"] = [*scope.get("headers", ()), (FORWARDED_HEADER, b"1")]
        response = self._handle.options(stream=True, session_id=session_id).forward.remote(forwarded, body)

        async def cancel_when_the_client_leaves() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            response.cancel()

        watcher = asyncio.ensure_future(cancel_when_the_client_leaves())
        try:
            async for message in response:
                await send(message)
        finally:
            watcher.cancel()


async def run_forwarded(app: ASGIApp, scope: dict[str, Any], body: bytes) -> AsyncIterator[Message]:
    """Runs a forwarded request through `app`, yielding what it sends. Closing the iterator (the
    original client left, or the caller's replica died) tells the app its client disconnected."""
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
    try:
        while True:
            getting = asyncio.ensure_future(sent.get())
            await asyncio.wait({getting, task}, return_when=asyncio.FIRST_COMPLETED)
            if not getting.done():
                getting.cancel()
                while not sent.empty():
                    yield sent.get_nowait()
                break
            message = getting.result()
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                break
        await task
    finally:
        left.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, timeout=5.0)
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
                task.cancel()
