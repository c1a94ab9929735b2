"""Readiness: whether this process should be sent requests now (`GET /readyz`, Ray Serve's health
check). Liveness is `GET /healthz`: the process answers at all.

Ready means a model is loaded, every worker of its backend is alive, and the server is not
draining. Not ready while a model loads or switches, with no model, after a worker died, and from
SIGTERM on.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI

from runner.context import app_context
from runner.model_manager import ModelStatus


@dataclass(frozen=True, slots=True)
class Readiness:
    ready: bool
    reason: str  # why not ("" when ready)


def readiness(app: FastAPI) -> Readiness:
    drain = getattr(app.state, "drain", None)
    if drain is not None and drain.draining:
        return Readiness(False, "the server is draining (shutting down)")
    manager = app_context(app).manager
    if manager.status is ModelStatus.LOADING:
        return Readiness(False, "a model is loading")
    backend = manager.backend
    if backend is None or manager.status is not ModelStatus.WORKING:
        return Readiness(False, "no model is loaded")
    problem = backend.health()
    if problem is not None:
        return Readiness(False, problem)
    return Readiness(True, "")
