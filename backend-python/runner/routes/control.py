"""Runner control: liveness, status, model switching, sampling defaults, exit."""

from __future__ import annotations

import logging
import os

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from runner.backends import default_strategy
from runner.context import AppContext, context
from runner.errors import ApiError
from runner.model_manager import SwitchInProgress
from runner.schemas import SwitchModelRequest, UpdateConfigRequest, parse_body

log = logging.getLogger("runner.routes.control")
router = APIRouter()


def device_name(effective: dict[str, object]) -> str:
    """The device the loaded backend reports it runs on (its `device_name`, else its `device`:
    `cpu`, `cuda`, `cuda:1`, or a list of them), never a guess from the strategy string."""
    reported = effective.get("device_name")
    if isinstance(reported, str) and reported:
        return reported
    devices = [d.strip() for d in str(effective.get("device") or "cpu").split(",") if d.strip()]
    names: list[str] = []
    for device in devices:
        names.append(_cuda_device_name(device) if device.startswith("cuda") else "CPU")
    return ", ".join(dict.fromkeys(names)) or "CPU"


def _cuda_device_name(device: str) -> str:
    import torch  # lazy: /status must stay fast to import and cheap without a GPU

    if not torch.cuda.is_available():
        return device
    index = int(device.partition(":")[2] or 0)
    return torch.cuda.get_device_name(index)


def gpu_available() -> bool:
    """Whether this server can run the CUDA strategies at all (the web GUI's device choice)."""
    import torch

    return torch.cuda.is_available()


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
        "device_name": device_name(effective),
        "gpu_available": gpu_available(),
        "backend": backend.backend_name if backend is not None else None,
        "strategy": manager.strategy,
        "model": backend.name if backend is not None else None,
        "model_path": manager.model_path,
        "deploy": ctx.deploy_mode,
        "state": manager.initial_state.path if manager.initial_state is not None else None,
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
    try:
        ctx.manager.update_config(body.sampling_values())
    except ValueError as exc:
        raise ApiError(422, str(exc)) from exc
    if body.state is not None:  # after the values, as the Runner: a refused state file keeps them
        await ctx.manager.set_state_file(body.state)
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
