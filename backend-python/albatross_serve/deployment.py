"""The Serve deployment: one replica is one ingress app with its model, sized to a GPU group.

Health is our readiness check (runner.readiness), except while the replica loads or switches a
model: Serve replaces a replica whose health check fails, and that would cut a load short. Serve's
own graceful shutdown (stop routing, wait for running requests up to `--drain-timeout`) drains a
replica, and the app's lifespan shutdown then flushes the cached states.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve.config import RequestRouterConfig
from starlette.types import Message

from albatross_serve.session_affinity import SessionAffinityMiddleware, run_forwarded
from runner.app import create_app
from runner.readiness import readiness
from runner.settings import ServerSettings

DEPLOYMENT_NAME = "albatross"
APP_NAME = "albatross"
# Ray Serve's consistent-hash router keys on the session id the proxy reads from `X-Session-Id`
# (RAY_SERVE_SESSION_ID_HEADER_KEY); a request without one hashes on its own request id, which
# spreads session-less load evenly. One fallback: a busy primary hands over to its ring successor.
ROUTER_CLASS = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"
MAX_ONGOING_REQUESTS = 4096  # per replica; the engine batches internally and refuses overload itself
HEALTH_CHECK_PERIOD_S = 5.0
HEALTH_CHECK_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class ReplicaShape:
    """What one replica asks of Ray."""

    gpus: float  # 0 on a CPU-only cluster
    cpus: float


@serve.ingress()
class AlbatrossReplica:
    app: FastAPI  # Serve's ASGIAppReplicaWrapper property: the app __serve_build_asgi_app__ built

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = create_app(self.settings)
        app.add_middleware(SessionAffinityMiddleware, deployment_name=DEPLOYMENT_NAME, app_name=APP_NAME)
        return app

    async def forward(self, scope: dict[str, Any], body: bytes) -> AsyncIterator[Message]:
        """A request another replica received for a session that lives here, with a heartbeat while
        the app is silent; nothing when the request came from this replica (session_affinity.py)."""
        async for message in run_forwarded(self.app, scope, body):
            yield message

    def check_health(self) -> None:
        state = readiness(self.app)
        if not state.ready and state.reason != "a model is loading":
            raise RuntimeError(f"not ready: {state.reason}")


def build_application(settings: ServerSettings, replicas: int, shape: ReplicaShape) -> serve.Application:
    deployment = serve.deployment(
        AlbatrossReplica,
        name=DEPLOYMENT_NAME,
        num_replicas=replicas,
        ray_actor_options={"num_gpus": shape.gpus, "num_cpus": shape.cpus},
        max_ongoing_requests=MAX_ONGOING_REQUESTS,
        graceful_shutdown_timeout_s=settings.drain_timeout,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
        request_router_config=RequestRouterConfig(
            # Ray declares it `str | Callable` behind a validator mypy cannot follow.
            request_router_class=ROUTER_CLASS,  # type: ignore[arg-type]
            request_router_kwargs={"num_virtual_nodes": 100, "num_fallback_replicas": 1},
        ),
    )
    return deployment.bind(settings)  # type: ignore[attr-defined]  # a Deployment for a class argument
