"""Password protection: one ASGI middleware in front of every route, so no route can forget it.

With `--password` set, a request passes when `Authorization: Bearer <pw>` matches, or when its JSON
body carries a matching `password` field (rwkv_lightning clients send it there), whatever the
Content-Type: runner.json_body, outside this middleware, has parsed the body already. Open without it:
`GET /`, `GET /healthz`, CORS preflights, and GET/HEAD paths that no API route serves (the web GUI's
static files). Comparisons run in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Sequence

from starlette.routing import BaseRoute, Match, Mount
from starlette.types import ASGIApp, Receive, Scope, Send

from runner.json_body import JSON_BODY_STATE_KEY
from runner.limits import send_json_error

OPEN_PATHS = frozenset({"/", "/healthz", "/readyz"})


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
        parsed = scope.get("state", {}).get(JSON_BODY_STATE_KEY)
        if isinstance(parsed, dict) and isinstance(parsed.get("password"), str) and password_matches(parsed["password"], self.password):
            await self.app(scope, receive, send)
            return
        await send_json_error(send, 401, "a valid password is required (Authorization: Bearer <password> or a \"password\" body field)", [(b"www-authenticate", b"Bearer")])
