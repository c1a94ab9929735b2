"""`POST /v1/embeddings` (and aliases): the loaded backend's embeddings, when it has them."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from runner.context import context
from runner.errors import ApiError
from runner.schemas import EmbeddingsRequest, parse_body

router = APIRouter()


async def embeddings(request: Request) -> dict[str, object]:
    ctx = context(request)
    body = await parse_body(request, EmbeddingsRequest)
    if body.dimensions is not None:
        raise ApiError(400, "dimensions is not supported", "dimensions")
    inputs = [body.input] if isinstance(body.input, str) else list(body.input)
    if not inputs:
        raise ApiError(422, "input: at least one text is required", "input")
    if len(inputs) > ctx.settings.max_batch_items:
        raise ApiError(400, f"{len(inputs)} inputs exceed the server cap of {ctx.settings.max_batch_items} (--max-batch-items)", "input")
    backend = ctx.manager.require_backend()
    data: list[dict[str, object]] = []
    prompt_tokens = 0
    async with ctx.manager.generation_turn(backend, request.is_disconnected):
        for index, text in enumerate(inputs):
            try:
                vector = await asyncio.to_thread(backend.get_embedding, text)
            except NotImplementedError as exc:
                raise ApiError(400, str(exc) or f"embeddings are not supported by the {backend.backend_name} backend") from exc
            prompt_tokens += len(backend.encode(text))
            data.append({"object": "embedding", "index": index, "embedding": vector})
    return {
        "object": "list",
        "data": data,
        "model": body.model or backend.name,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


for _path in ("/v1/embeddings", "/embeddings", "/openai/v1/embeddings"):
    router.add_api_route(_path, embeddings, methods=["POST"])
