"""Which browser origins may call the server, and the middleware that enforces it.

Allowed by default: the RWKV-Runner desktop shell's web view (`http://wails.localhost` on Windows,
`wails://wails` on macOS and Linux) and any page served from this machine's loopback names
(`http(s)://localhost`, `127.0.0.1`, `[::1]`, any port). `--cors-origins` adds others; `*` allows all.

CORS alone only decides whether a page may READ a response: a "simple" cross-origin request
(a POST with a text/plain body, no custom headers) is sent without a preflight, and since this
server reads every body as JSON, such a request could still switch models or stop the server.
So `OriginGuard` answers 403 to any request that carries an `Origin` header which is neither
allowed nor the server's own (same-origin pages, e.g. the web GUI served with `--webui`). Clients
that are not browsers send no `Origin` and are not affected. See docs/deployment.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from runner.limits import send_json_error

DESKTOP_SHELL_ORIGINS: tuple[str, ...] = ("http://wails.localhost", "https://wails.localhost", "wails://wails")
# Pages served from this machine itself, on any port.
LOOPBACK_ORIGIN_PATTERN = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:[0-9]{1,5})?"
ANY_ORIGIN = "*"


@dataclass(frozen=True, slots=True)
class OriginPolicy:
    extra_origins: tuple[str, ...] = ()  # --cors-origins

    @property
    def allows_any(self) -> bool:
        return ANY_ORIGIN in self.extra_origins

    @property
    def origins(self) -> list[str]:
        if self.allows_any:
            return [ANY_ORIGIN]
        return list(dict.fromkeys((*DESKTOP_SHELL_ORIGINS, *(o.rstrip("/") for o in self.extra_origins))))

    @property
    def origin_regex(self) -> str | None:
        return None if self.allows_any else LOOPBACK_ORIGIN_PATTERN

    def allows(self, origin: str) -> bool:
        if self.allows_any or origin in self.origins:
            return True
        return re.fullmatch(LOOPBACK_ORIGIN_PATTERN, origin) is not None


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def is_same_origin(origin: str, host: str | None) -> bool:
    """A page served by this server (its Origin names the Host the request was sent to)."""
    if not host:
        return False
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and parts.netloc.lower() == host.lower()


class OriginGuard:
    """403 for requests from a browser page whose origin is not allowed (see the module doc)."""

    def __init__(self, app: ASGIApp, policy: OriginPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            origin = _header(scope, b"origin")
            if origin is not None and not self.policy.allows(origin) and not is_same_origin(origin, _header(scope, b"host")):
                message = f"requests from the web origin {origin!r} are not allowed; start the server with --cors-origins to allow it"
                await send_json_error(send, 403, message)
                return
        await self.app(scope, receive, send)


def cors_middleware_options(policy: OriginPolicy) -> dict[str, object]:
    """Keyword arguments of starlette's CORSMiddleware for `policy` (preflights and headers)."""
    return {
        "allow_origins": policy.origins,
        "allow_origin_regex": policy.origin_regex,
        "allow_methods": ["*"],
        "allow_headers": ["*"],
        "expose_headers": ["X-Request-Id", "Retry-After"],  # a page may read the request id and the 429 back-off
        "max_age": 600,
    }

