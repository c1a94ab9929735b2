"""`GET /metrics`: Prometheus text format."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from runner.context import context
from runner.metrics import render

router = APIRouter()


@router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    ctx = context(request)
    backend = ctx.manager.backend
    status = dict(backend.status()) if backend is not None else {}
    labels = [("backend", backend.backend_name), ("model", backend.name)] if backend is not None else []
    admission = (ctx.admission.in_flight, ctx.admission.limit(backend.generation_slots())) if backend is not None else None
    text = render(ctx.metrics, int(ctx.manager.status), status, labels, admission)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")
