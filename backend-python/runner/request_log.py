"""One log line per finished request, and the server's log format.

`RequestLogMiddleware` (outermost, so it sees every answer, 401s, 413s and 429s included) gives
each request a `RequestRecord`: an id (the client's `X-Request-Id` when it is a sane token, else a
fresh one; echoed in the response's `X-Request-Id` header), the route, the status. The generation
driver fills in prompt and generated tokens, time to first token and finish reasons. When the
response has been sent (or the client left) the record becomes one line:

    request 3f2a... POST /v1/chat/completions 200 prompt=12 completion=40 ttft=0.051s duration=1.203s finish=stop

and one observation of `rwkv_request_duration_seconds`. Polls (`GET /status`, `/healthz`,
`/metrics`, `/readyz`: the GUI polls /status every 2 s) are logged at debug level only.

`configure_logging(level, "json")` writes one JSON object per line instead, with the record's
fields as keys, for log collectors.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from fastapi.routing import iter_route_contexts
from starlette.requests import Request
from starlette.routing import Match, Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runner.metrics import ServerMetrics

log = logging.getLogger("runner.requests")

RECORD_STATE_KEY = "request_record"
QUIET_PATHS = frozenset({"/status", "/healthz", "/readyz", "/metrics"})
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
UNMATCHED_ROUTE = "unmatched"  # the metrics label of paths no route serves (their number is unbounded)


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    method: str
    path: str
    route: str = UNMATCHED_ROUTE
    status: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    duration_s: float = 0.0
    finish_reasons: list[str] = field(default_factory=list)
    client_gone: bool = False

    def finish_summary(self) -> str:
        if self.client_gone and not self.finish_reasons:
            return "client_gone"
        counts: dict[str, int] = {}
        for reason in self.finish_reasons:
            counts[reason] = counts.get(reason, 0) + 1
        return ",".join(reason if n == 1 else f"{reason}x{n}" for reason, n in counts.items()) or "-"

    def line(self) -> str:
        ttft = "-" if self.ttft_s is None else f"{self.ttft_s:.3f}s"
        return (
            f"request {self.request_id} {self.method} {self.path} {self.status} prompt={self.prompt_tokens} "
            f"completion={self.completion_tokens} ttft={ttft} duration={self.duration_s:.3f}s finish={self.finish_summary()}"
        )

    def fields(self) -> dict[str, Any]:
        fields = asdict(self)
        fields["finish_reason"] = self.finish_summary()
        del fields["finish_reasons"]
        return fields


def request_record(request: Request) -> RequestRecord | None:
    """The record of the request being served (None outside the middleware, e.g. in unit tests)."""
    record = request.scope.get("state", {}).get(RECORD_STATE_KEY)
    return record if isinstance(record, RequestRecord) else None


def _request_id(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            given = value.decode("latin-1")
            if _CLIENT_REQUEST_ID.fullmatch(given):
                return given
    return uuid.uuid4().hex


def route_template(scope: Scope) -> str:
    """The path template of the route that served (or would have served) the request: a bounded
    label for metrics, also for requests refused before routing (401, 413, 429, ...)."""
    route = scope.get("route")
    if isinstance(getattr(route, "path", None), str):
        return route.path  # type: ignore[union-attr]
    app = scope.get("app")
    for candidate in iter_route_contexts(getattr(app, "routes", ())):  # included routers are nested
        if isinstance(candidate.original_route, Mount) or candidate.path is None:
            continue
        match, _ = candidate.matches(scope)
        if match is Match.FULL:
            return candidate.path
    return UNMATCHED_ROUTE


def _printable_path(path: str) -> str:
    shown = path if len(path) <= 200 else path[:200] + "..."
    return shown.encode("unicode_escape").decode("ascii")  # no control characters in a log line


class RequestLogMiddleware:
    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        record = RequestRecord(_request_id(scope), scope["method"], _printable_path(scope["path"]))
        scope.setdefault("state", {})[RECORD_STATE_KEY] = record
        completed = False

        async def logging_send(message: Message) -> None:
            nonlocal completed
            if message["type"] == "http.response.start":
                record.status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", record.request_id.encode())]}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                completed = True
            await send(message)

        failed = False
        try:
            await self.app(scope, receive, logging_send)
        except BaseException:
            failed = True
            record.status = record.status or 500
            raise
        finally:
            # A response that started and never finished: the client left (a stream cut short).
            record.client_gone = record.client_gone or (not failed and record.status != 0 and not completed)
            record.duration_s = time.perf_counter() - started
            record.route = route_template(scope)
            self.metrics.observe_response(record.route, record.status, record.duration_s)
            quiet = record.path in QUIET_PATHS and record.status < 400
            level = logging.DEBUG if quiet else logging.WARNING if record.status >= 500 else logging.INFO
            log.log(level, "%s", record.line(), extra={"fields": record.fields()})


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and a record's `fields` if any."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure_logging(level: str, log_format: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
