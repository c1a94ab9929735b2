"""Request bodies are read and parsed once, as JSON whatever the Content-Type, before the password
is checked.

`JsonBodyMiddleware` reads the whole body of a POST/PUT/PATCH/DELETE request (the size middleware
outside it bounds the bytes, `read_timeout_s` the time they may take), parses it and leaves the
result in the request's state (`parsed_body`) for the password check and the routes, so a
`password` field counts whatever the Content-Type says and no layer parses twice.

Refused here, for every path and before authentication, each with a 400 JSON error and no
traceback: a body that is not JSON, one nested deeper than the parser can follow (the parser's
RecursionError was a 500), and one holding a lone UTF-16 surrogate such as `"\\ud800"` (no
character: echoing or storing it failed to encode, a 500), named by its field. A body that did
not arrive within the read timeout is a 408. A `multipart/form-data` body (the one multipart route,
`/file-to-text`) is read and bounded the same way but left to its route to parse; with
`--password` such a request authenticates with its Authorization header.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runner.limits import send_json_error

JSON_BODY_STATE_KEY = "json_body"  # scope["state"][...]: the parsed body, when there was one
BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# A lone surrogate can only enter through a \u escape of d800-dfff (raw UTF-8 cannot encode one).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class BodyError(Exception):
    def __init__(self, status_code: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param


def parse_json_body(raw: bytes) -> Any:
    """The body's JSON value; BodyError(400) for what the module docstring lists."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise BodyError(400, "the JSON body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BodyError(400, f"invalid JSON in the request body: {exc}") from None
    if _SURROGATE_ESCAPE.search(raw):
        field = lone_surrogate_field(value)
        if field is not None:
            raise BodyError(400, f"{field}: holds a lone UTF-16 surrogate, which is not a character", field)
    return value


def _is_unencodable(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _printable(key: str) -> str:
    return key.encode("utf-8", "backslashreplace").decode("utf-8")


def lone_surrogate_field(value: Any) -> str | None:
    """The dotted path of the first string (key or value) that cannot be encoded as UTF-8; walked
    iteratively, as the value may be nested as deep as the parser allows."""
    pending: list[tuple[Any, tuple[str, ...]]] = [(value, ())]
    while pending:
        item, path = pending.pop()
        if isinstance(item, str):
            if _is_unencodable(item):
                return ".".join(path) or "body"
        elif isinstance(item, dict):
            for key, child in reversed(list(item.items())):
                if _is_unencodable(key):
                    return ".".join((*path, _printable(key)))
                pending.append((child, (*path, key)))
        elif isinstance(item, list):
            pending.extend((child, (*path, str(index))) for index, child in reversed(list(enumerate(item))))
    return None


class JsonBodyMiddleware:
    def __init__(self, app: ASGIApp, read_timeout_s: float | None) -> None:
        self.app = app
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        try:
            async with asyncio.timeout(self.read_timeout_s):
                body, extra = await read_body(receive)
        except TimeoutError:
            message = f"the request body did not arrive within {self.read_timeout_s:g} s (--request-read-timeout)"
            await send_json_error(send, 408, message, [(b"connection", b"close")])
            return
        if body.strip() and not _is_multipart(scope):  # /file-to-text's upload: the route parses it
            try:
                scope.setdefault("state", {})[JSON_BODY_STATE_KEY] = parse_json_body(body)
            except BodyError as error:
                await send_json_error(send, error.status_code, error.message, param=error.param)
                return
        await self.app(scope, replay(body, extra, receive), send)


def _is_multipart(scope: Scope) -> bool:
    return any(name == b"content-type" and value.lower().startswith(b"multipart/form-data") for name, value in scope.get("headers", ()))


async def read_body(receive: Receive) -> tuple[bytes, list[Message]]:
    """The whole body and any non-body message seen (a disconnect)."""
    chunks: list[bytes] = []
    extra: list[Message] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            extra.append(message)
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks), extra


def replay(body: bytes, extra: list[Message], receive: Receive) -> Receive:
    """`receive` for the app inside: the body already read, then the connection's own messages."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}, *extra]

    async def replay_receive() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay_receive
