"""Model listings as RWKV-Runner answers them, and the checkpoints under --models-dir.

The Runner lists the loaded model (`rwkv` when none is loaded) and two OpenAI model names,
`gpt-3.5-turbo` and `text-davinci-003`, so that clients configured for OpenAI's names find a
model; requests naming them are served by the loaded model like any other `model` value.
"""

from __future__ import annotations

import time
from pathlib import Path

from fastapi import APIRouter, Request

from runner.context import context
from runner.errors import ApiError

router = APIRouter()
_STARTED = int(time.time())
OFFLINE_MODEL_ID = "rwkv"


def _openai_alias(model_id: str, created: int, owned_by: str, permission_id: str) -> dict[str, object]:
    permission = {
        "id": permission_id,
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    return {"id": model_id, "object": "model", "created": created, "owned_by": owned_by, "permission": [permission], "root": model_id, "parent": None}


OPENAI_ALIASES: tuple[dict[str, object], ...] = (
    _openai_alias("gpt-3.5-turbo", 1677610602, "openai", "modelperm-rwkv-gpt-3.5-turbo"),
    _openai_alias("text-davinci-003", 1669599635, "openai-internal", "modelperm-rwkv-text-davinci-003"),
)


def _loaded_model(request: Request) -> dict[str, object]:
    manager = context(request).manager
    backend = manager.backend
    name = backend.name if backend is not None else OFFLINE_MODEL_ID
    created = _STARTED
    if backend is not None and manager.model_path:
        try:
            created = int(Path(manager.model_path).stat().st_mtime)
        except OSError:
            pass
    return {"id": name, "object": "model", "created": created, "owned_by": "rwkv", "root": name, "parent": None}


async def list_models(request: Request) -> dict[str, object]:
    return {"object": "list", "data": [_loaded_model(request), *OPENAI_ALIASES]}


async def get_model(request: Request, model_id: str) -> dict[str, object]:
    for alias in OPENAI_ALIASES:
        if alias["id"] == model_id:
            return alias
    loaded = _loaded_model(request)
    if model_id == loaded["id"] or "rwkv" in model_id.lower():  # the Runner answers any *rwkv* id
        return loaded
    raise ApiError(404, f"The model {model_id!r} does not exist", "model")


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

