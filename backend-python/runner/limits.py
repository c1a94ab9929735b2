"""Request-size limits: the body's size before any route reads it, and what one request may ask of
the generation loop (stop strings, numeric ranges).

`BodySizeLimitMiddleware` refuses a declared Content-Length over the cap at once and counts the
bytes of a streamed (chunked) body as they arrive, so an oversized body is never held in memory.

The per-request bounds below are checked where the body is validated (runner/schemas.py,
runner/native_schemas.py): a value outside a range is a 422 naming the field, a list over a cap a
400 naming the cap. They keep one request from costing the engine more than its own row: every
generated token of a request is matched against its stops and stop ids on the worker thread that
serves the whole batch, and every sampling value becomes a device tensor shared by the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runner.errors import ApiError, error_bytes

MAX_STOP_STRINGS = 32  # per request (OpenAI allows 4)
MAX_STOP_LENGTH = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 256  # per request
MAX_TOP_K = 2**31 - 1  # any value >= the vocabulary keeps every token
MAX_PENALTY = 100.0  # |presence|, |frequency|: the penalty a token accumulates stays finite in fp32
SEED_RANGE = (-(2**63), 2**64 - 1)  # signed or unsigned 64-bit
MAX_INDEX = 2**63 - 1  # dialogue node numbers and other counters stored as 64-bit integers


def check_stop_strings(stops: Sequence[str], field_name: str) -> None:
    """400 naming the cap; emptiness is a validation error (422) checked by the schemas."""
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"{field_name}: at most {MAX_STOP_STRINGS} stop strings per request (got {len(stops)})", field_name)
    longest = max((len(stop) for stop in stops), default=0)
    if longest > MAX_STOP_LENGTH:
        raise ApiError(400, f"{field_name}: a stop string may hold at most {MAX_STOP_LENGTH} characters (got {longest})", field_name)


def check_stop_token_ids(token_ids: Sequence[int], field_name: str) -> None:
    if len(token_ids) > MAX_STOP_TOKEN_IDS:
        raise ApiError(400, f"{field_name}: at most {MAX_STOP_TOKEN_IDS} stop token ids per request (got {len(token_ids)})", field_name)


class BodyTooLarge(StarletteHTTPException):
    """Raised from `receive` once the running count passes the cap. It is an HTTPException so that
    FastAPI's body parsing re-raises it untouched (it wraps other exceptions into a 400)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds the limit of {limit} bytes (--max-body-bytes)")
        self.limit = limit


async def send_json_error(send: Send, status_code: int, message: str, headers: list[tuple[bytes, bytes]] | None = None, param: str | None = None) -> None:
    body = error_bytes(status_code, message, param)
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
