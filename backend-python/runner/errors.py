"""The error policy: every error body is `{"error": {"message", "type", "code", "param"?, "request_id"?}}`.

`code` is the HTTP status; `type` names the class of error; `param` names the offending field where
there is one; `request_id` is present on 500s and matches the server log line with the traceback.
One exception, so that OpenAI clients recognise it and back off: a 429 is OpenAI's rate-limit shape,
`{"error": {"message", "type": "requests", "param": null, "code": "rate_limit_exceeded"}}`.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from runner.interface import BackendError

log = logging.getLogger("runner.errors")

ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "request_timeout",
    409: "conflict_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "requests",
    499: "client_closed_request",
    500: "server_error",
    503: "service_unavailable",
}
RATE_LIMIT_CODE = "rate_limit_exceeded"


class ApiError(Exception):
    """Raised anywhere below a route; becomes a JSON error response with `status_code`."""

    def __init__(self, status_code: int, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.headers = headers  # e.g. Retry-After on a 429


class ClientGone(ApiError):
    """The client disconnected before the reply was ready (499, which nobody reads)."""

    def __init__(self) -> None:
        super().__init__(499, "the client closed the request before the reply was ready")


def error_payload(status_code: int, message: str, param: str | None = None, request_id: str | None = None) -> dict[str, Any]:
    error: dict[str, Any] = {"message": message, "type": ERROR_TYPES.get(status_code, "error"), "code": status_code}
    if status_code == 429:
        error["code"], error["param"] = RATE_LIMIT_CODE, param
    if param is not None:
        error["param"] = param
    if request_id is not None:
        error["request_id"] = request_id
    return {"error": error}


def error_response(status_code: int, message: str, param: str | None = None, request_id: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_payload(status_code, message, param, request_id), status_code=status_code, headers=headers)


def error_bytes(status_code: int, message: str, param: str | None = None) -> bytes:
    """A whole error response body, for raw ASGI middleware that answers before FastAPI."""
    return json.dumps(error_payload(status_code, message, param), separators=(",", ":")).encode()


def new_request_id() -> str:
    return uuid.uuid4().hex


def _field_name(location: Sequence[int | str]) -> str:
    parts = [str(p) for p in location if p not in ("body", "query", "path")]
    return ".".join(parts) or "body"


def validation_api_error(errors: Sequence[Any]) -> ApiError:
    """Pydantic errors -> 422 naming each field and why (invalid JSON -> 400)."""
    if any(e.get("type") == "json_invalid" for e in errors):
        return ApiError(400, "invalid JSON in the request body")
    described = [f"{_field_name(e.get('loc', ()))}: {e.get('msg', 'invalid')}" for e in errors]
    first = _field_name(errors[0].get("loc", ())) if errors else None
    return ApiError(422, "; ".join(described) or "invalid request", param=first)


def from_pydantic(exc: ValidationError) -> ApiError:
    return validation_api_error(exc.errors(include_url=False, include_input=False))


def internal_error(exc: BaseException, context: str) -> tuple[str, str]:
    """Log the traceback under a fresh request id; return (request_id, client message)."""
    request_id = new_request_id()
    log.error("internal error in %s [request_id=%s]", context, request_id, exc_info=exc)
    return request_id, f"internal error (request_id {request_id})"


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return error_response(exc.status_code, exc.message, exc.param, headers=exc.headers)

    async def on_backend_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, BackendError)
        return error_response(exc.status_code, exc.message)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        api_error = validation_api_error(list(exc.errors()))
        return error_response(api_error.status_code, api_error.message, api_error.param)

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return JSONResponse(error_payload(exc.status_code, message), status_code=exc.status_code, headers=exc.headers)

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        request_id, message = internal_error(exc, f"{request.method} {request.url.path}")
        return error_response(500, message, request_id=request_id)

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(BackendError, on_backend_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
