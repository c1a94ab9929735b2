"""What routes share: settings, the model manager, counters, and hooks other modules fill in."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from runner.admission import Admission
from runner.metrics import ServerMetrics
from runner.model_manager import ModelManager
from runner.profile import RouteProfile
from runner.settings import ServerSettings

# (request, already-parsed JSON body) -> response; serves `/v1/chat/completions` bodies that carry
# `contents` and no `messages` (the rwkv_lightning batch API).
NativeBatchHandler = Callable[[Request, dict[str, Any]], Awaitable[Response]]


@dataclass(slots=True)
class AppContext:
    settings: ServerSettings
    manager: ModelManager
    profile: RouteProfile
    metrics: ServerMetrics
    admission: Admission = field(default_factory=Admission)
    deploy_mode: bool = False
    native_batch_handler: NativeBatchHandler | None = None
    request_exit: Callable[[], None] | None = None  # set by main.py: stops uvicorn


def app_context(app: FastAPI) -> AppContext:
    return app.state.context


def context(request: Request) -> AppContext:
    return request.app.state.context


def register_native_batch_handler(app: FastAPI, handler: NativeBatchHandler) -> None:
    app_context(app).native_batch_handler = handler
