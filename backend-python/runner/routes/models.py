"""Model listings: the loaded model in OpenAI form, and the checkpoints under --models-dir."""

from __future__ import annotations

import time
from pathlib import Path

from fastapi import APIRouter, Request

from runner.context import context
from runner.errors import ApiError

router = APIRouter()
_STARTED = int(time.time())


def _loaded_models(request: Request) -> list[dict[str, object]]:
    manager = context(request).manager
    backend = manager.backend
    if backend is None:
        return []
    created = _STARTED
    if manager.model_path:
        try:
            created = int(Path(manager.model_path).stat().st_mtime)
        except OSError:
            pass
    return [{"id": backend.name, "object": "model", "owned_by": "rwkv", "created": created}]


async def list_models(request: Request) -> dict[str, object]:
    return {"object": "list", "data": _loaded_models(request)}


async def get_model(request: Request, model_id: str) -> dict[str, object]:
    for model in _loaded_models(request):
        if model["id"] == model_id:
            return model
    raise ApiError(404, f"unknown model id {model_id!r}", "model")


for _prefix in ("/v1", "", "/openai/v1"):
    router.add_api_route(f"{_prefix}/models", list_models, methods=["GET"])
    router.add_api_route(f"{_prefix}/models/{{model_id}}", get_model, methods=["GET"])


@router.get("/local-models")
async def local_models(request: Request) -> dict[str, object]:
    """Checkpoints under --models-dir; `path` is what /switch-model accepts as `model`."""
    models_dir = context(request).settings.models_dir
    found: list[dict[str, object]] = []
    if models_dir.is_dir():
        for path in sorted(models_dir.rglob("*.pth")):
            if path.is_file():
                found.append({"name": path.stem, "path": str(path.relative_to(models_dir)), "size_bytes": path.stat().st_size})
    return {"models_dir": str(models_dir.resolve()), "models": found}
