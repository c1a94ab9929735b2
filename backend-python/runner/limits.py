"""Request-size limits enforced before any route reads a body.

`BodySizeLimitMiddleware` refuses a declared Content-Length over the cap at once and counts the
bytes of a streamed (chunked) body as they arrive, so an oversized body is never held in memory.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runner.errors import error_bytes


class BodyTooLarge(StarletteHTTPException):
    """Raised from `receive` once the running count passes the cap. It is an HTTPException so that
    FastAPI's body parsing re-raises it untouched (it wraps other exceptions into a 400)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds the limit of {limit} bytes (--max-body-bytes)")
        self.limit = limit


async def send_json_error(send: Send, status_code: int, message: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = error_bytes(status_code, message)
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status_code, "headers": raw_headers + (headers or [])})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        declared = declared_length(scope)
        if declared is not None and declared > limit:
            await send_json_error(send, 413, BodyTooLarge(limit).detail, [(b"connection", b"close")])
            return

        received = 0
        response_started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge as exc:
            if response_started:
                raise
            await send_json_error(send, 413, str(exc.detail), [(b"connection", b"close")])
