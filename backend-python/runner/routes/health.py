"""`GET /readyz`: 200 when this process should get requests, 503 (with the reason and
`Retry-After`) while it loads, switches, drains, or has a dead worker. `GET /healthz` (liveness)
is in control.py."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from runner.context import context
from runner.drain import RETRY_AFTER_S
from runner.errors import error_payload
from runner.readiness import readiness

router = APIRouter()


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    state = readiness(request.app)
    status = int(context(request).manager.status)
    if state.ready:
        return JSONResponse({"ready": True, "status": status})
    body = {"ready": False, "status": status, **error_payload(503, state.reason)}
    return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
