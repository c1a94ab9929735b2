"""Password protection: one ASGI middleware in front of every route, so no route can forget it.

With `--password` set, a request passes when `Authorization: Bearer <pw>` matches, or when its JSON
body carries a matching `password` field (rwkv_lightning clients send it there). Open without it:
`GET /`, `GET /healthz`, CORS preflights, and GET/HEAD paths that no API route serves (the web GUI's
static files). Comparisons run in constant time.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable, Sequence
from typing import Any

from starlette.routing import BaseRoute, Match, Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runner.limits import send_json_error

OPEN_PATHS = frozenset({"/", "/healthz", "/readyz"})
JSON_BODY_STATE_KEY = "json_body"  # request.state.json_body: the body the middleware already parsed
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def password_matches(candidate: str | bytes | None, password: str) -> bool:
    if candidate is None:
        return False
    given = candidate if isinstance(candidate, bytes) else candidate.encode("utf-8", "surrogatepass")
    return hmac.compare_digest(given, password.encode("utf-8"))


def bearer_token(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer":
                return token.strip()
    return None


def _is_json(scope: Scope) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            return b"json" in value.lower()
    return True  # clients that omit the header still send JSON here


class PasswordMiddleware:
    def __init__(self, app: ASGIApp, password: str, routes: Callable[[], Sequence[BaseRoute]]) -> None:
        self.app = app
        self.password = password
        self.routes = routes  # read per request: routers included after start are covered too

    def _is_open(self, scope: Scope) -> bool:
        method = scope["method"]
        if method == "OPTIONS":
            return any(name == b"access-control-request-method" for name, _ in scope.get("headers", ()))
        if method not in ("GET", "HEAD"):
            return False
        if scope["path"] in OPEN_PATHS:
            return True
        for route in self.routes():
            if isinstance(route, Mount):
                continue
            match, _ = route.matches(scope)
            if match is not Match.NONE:
                return False
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._is_open(scope):
            await self.app(scope, receive, send)
            return
        if password_matches(bearer_token(scope), self.password):
            await self.app(scope, receive, send)
            return
        if scope["method"] in _BODY_METHODS and _is_json(scope):
            body, more = await _read_body(receive)
            parsed = _parse_json(body)
            if isinstance(parsed, dict) and isinstance(parsed.get("password"), str) and password_matches(parsed["password"], self.password):
                scope.setdefault("state", {})[JSON_BODY_STATE_KEY] = parsed
                await self.app(scope, _replay(body, more, receive), send)
                return
        await send_json_error(send, 401, "a valid password is required (Authorization: Bearer <password> or a \"password\" body field)", [(b"www-authenticate", b"Bearer")])


async def _read_body(receive: Receive) -> tuple[bytes, list[Message]]:
    """The whole body (the size middleware outside bounds it) and any non-body message seen."""
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


def _parse_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None


def _replay(body: bytes, extra: list[Message], receive: Receive) -> Receive:
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}, *extra]

    async def replay_receive() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay_receive
