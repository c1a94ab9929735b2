"""The app factory: settings in, a FastAPI app out.

Routes live in modules listed in ROUTE_MODULES. Each exposes `router` (an APIRouter) and may expose
`install(app)` for hooks (e.g. the native batch handler). A listed module that does not exist yet
is skipped; one that exists but fails to import is an error. Password checking, body parsing, the
body-size limit and CORS are middleware, so they cover every route, including ones added later.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from runner.admission import Admission
from runner.auth import PasswordMiddleware
from runner.backends import BACKENDS, BackendEntry, UnknownStrategy, default_strategy, find_backend
from runner.context import AppContext, app_context
from runner.cors import OriginGuard, OriginPolicy, cors_middleware_options
from runner.drain import Drain, DrainMiddleware
from runner.errors import ApiError, install_error_handlers
from runner.heap import IdleTrim
from runner.json_body import JsonBodyMiddleware
from runner.limits import BodySizeLimitMiddleware
from runner.metrics import ServerMetrics
from runner.model_manager import RANDOM_MODEL_PREFIX, ModelManager
from runner.profile import RouteProfile, profiling_requested
from runner.request_log import RequestLogMiddleware
from runner import openapi
from runner.routes import static
from runner.settings import ServerSettings

log = logging.getLogger("runner.app")

ROUTE_MODULES: tuple[str, ...] = (
    "runner.routes.control",
    "runner.routes.models",
    "runner.routes.openai",
    "runner.routes.embeddings",
    "runner.routes.profile",
    "runner.routes.metrics",
    "runner.routes.native",
    "runner.routes.state_sessions",
    "runner.routes.health",
    "runner.routes.files",
    "runner.routes.billing",
)


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


def include_route_modules(app: FastAPI, modules: Sequence[str]) -> list[str]:
    included: list[str] = []
    for name in modules:
        if not _module_exists(name):
            continue
        module = importlib.import_module(name)
        app.include_router(module.router)
        install = getattr(module, "install", None)
        if callable(install):
            install(app)
        included.append(name)
    return included


def startup_model_problem(ctx: AppContext) -> str | None:
    """Why --model-path with --strategy cannot load, where that shows without loading anything (an
    unknown strategy, a missing file, an unsupported format): main.py reports it as one line
    instead of starting a server whose startup fails with a traceback."""
    settings = ctx.settings
    if not settings.model_path:
        return None
    strategy = settings.strategy or default_strategy(ctx.manager.registry)
    try:
        find_backend(strategy, ctx.manager.registry)
    except UnknownStrategy as exc:
        return f"--strategy: {exc}"
    if settings.model_path.startswith(RANDOM_MODEL_PREFIX):
        return None
    try:
        ctx.manager.resolve_model_path(settings.model_path)
    except ApiError as exc:
        return f"--model-path {settings.model_path}: {exc.message}"
    return None


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    ctx = app_context(app)
    settings = ctx.settings
    if settings.model_path:
        strategy = settings.strategy or default_strategy(ctx.manager.registry)
        await ctx.manager.switch(settings.model_path, strategy)  # a failure stops the server: fail loudly
    log.info("serving on http://%s:%d", settings.host, settings.port)
    try:
        yield
    finally:
        await ctx.manager.shutdown()


def create_app(
    settings: ServerSettings,
    registry: Sequence[BackendEntry] = BACKENDS,
    route_modules: Sequence[str] = ROUTE_MODULES,
) -> FastAPI:
    app = FastAPI(title="RWKV-7 runner + Albatross", version="0.1.0", lifespan=lifespan)
    app.state.context = AppContext(
        settings=settings,
        manager=ModelManager(settings, registry),
        profile=RouteProfile(enabled=profiling_requested()),
        metrics=ServerMetrics(),
        admission=Admission(settings.max_queued_requests, on_idle=IdleTrim()),
        deploy_mode=settings.deploy,
    )
    app.state.drain = Drain(settings.drain_timeout)
    install_error_handlers(app)
    app.state.route_modules = include_route_modules(app, route_modules)
    static.install(app, settings)  # last: the GUI mount at / must not shadow API routes
    openapi.install(app)

    # add_middleware wraps from the inside out: the last added runs first. The body is parsed (and
    # hostile JSON refused) before the password is checked, and counted against the cap as it arrives.
    if settings.password:
        app.add_middleware(PasswordMiddleware, password=settings.password, routes=lambda: app.router.routes)
    app.add_middleware(JsonBodyMiddleware, read_timeout_s=settings.request_read_timeout or None)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    # CORS outside the origin guard: preflights are answered, refusals from inside carry its headers.
    origins = OriginPolicy(settings.cors_origins)
    app.add_middleware(OriginGuard, policy=origins)
    app.add_middleware(CORSMiddleware, **cors_middleware_options(origins))  # type: ignore[arg-type]
    app.add_middleware(DrainMiddleware, drain=app.state.drain)  # outside everything but the request log
    app.add_middleware(RequestLogMiddleware, metrics=app_context(app).metrics)  # outermost: sees every answer
    return app
