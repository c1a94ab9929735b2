"""Runner control: liveness, status, model switching, sampling defaults, exit."""

from __future__ import annotations

import logging
import os

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from runner.backends import ALBATROSS_STRATEGY_WORDS, default_strategy, first_word
from runner.context import AppContext, context
from runner.errors import ApiError
from runner.model_manager import SwitchInProgress
from runner.schemas import SwitchModelRequest, UpdateConfigRequest, parse_body

log = logging.getLogger("runner.routes.control")
router = APIRouter()


def device_name(ctx: AppContext, effective: dict[str, object]) -> str:
    reported = effective.get("device_name")
    if isinstance(reported, str) and reported:
        return reported
    strategy = ctx.manager.strategy or ""
    if first_word(strategy) in ("cuda", *ALBATROSS_STRATEGY_WORDS) and "cpu" not in strategy.split()[1:2]:
        import torch  # lazy: /status must stay fast to import and cheap without a GPU

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    return "CPU"


def refuse_in_deploy_mode(ctx: AppContext, what: str) -> None:
    if ctx.deploy_mode:
        raise ApiError(403, f"{what} is disabled in deploy mode")


@router.get("/healthz")
async def healthz(request: Request) -> dict[str, object]:
    return {"ok": True, "status": int(context(request).manager.status)}


@router.get("/status")
async def status(request: Request) -> dict[str, object]:
    ctx = context(request)
    manager = ctx.manager
    backend = manager.backend
    effective: dict[str, object] = dict(backend.status()) if backend is not None else {}
    return {
        "status": int(manager.status),
        "pid": os.getpid(),
        "device_name": device_name(ctx, effective),
        "backend": backend.backend_name if backend is not None else None,
        "strategy": manager.strategy,
        "model": backend.name if backend is not None else None,
        "model_path": manager.model_path,
        "deploy": ctx.deploy_mode,
        "effective": effective,
    }


@router.post("/switch-model")
async def switch_model(request: Request) -> Response:
    ctx = context(request)
    refuse_in_deploy_mode(ctx, "/switch-model")
    body = await parse_body(request, SwitchModelRequest)
    if body.tokenizer:
        log.info("/switch-model: ignoring tokenizer %r (RWKV-7 models use the built-in World tokenizer)", body.tokenizer)
    strategy = body.strategy.strip() or default_strategy(ctx.manager.registry)
    try:
        await ctx.manager.switch(body.model, strategy)
    except SwitchInProgress:
        return Response(status_code=304)  # the runner's answer while a load is in progress (no body)
    if body.deploy and body.model:
        ctx.deploy_mode = True
        log.info("deploy mode on: /switch-model and /exit are now refused")
    return JSONResponse("success")


@router.post("/update-config")
async def update_config(request: Request) -> JSONResponse:
    ctx = context(request)
    body = await parse_body(request, UpdateConfigRequest)
    if body.global_penalty:
        raise ApiError(400, "global_penalty is not supported: penalties count generated tokens only", "global_penalty")
    if body.state:
        raise ApiError(400, "loading a state file through /update-config is not supported; use the state-session routes", "state")
    try:
        ctx.manager.update_config(body.sampling_values())
    except ValueError as exc:
        raise ApiError(422, str(exc)) from exc
    return JSONResponse("success")


@router.post("/exit")
async def exit_server(request: Request) -> JSONResponse:
    ctx = context(request)
    refuse_in_deploy_mode(ctx, "/exit")
    log.info("/exit: shutting down")
    await ctx.manager.shutdown()
    if ctx.request_exit is not None:
        ctx.request_exit()
    return JSONResponse("success")
