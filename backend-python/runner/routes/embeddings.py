"""`POST /v1/embeddings` (and RWKV-Runner's aliases): one clear 400 on every backend.

RWKV-7 language models have no embedding output that means anything for similarity search: no
published RWKV-7 checkpoint is trained for it, and neither the recurrent state nor a hidden state
of a next-token predictor is (docs/api.md, "Embeddings", says why). Serving such vectors would
let retrieval pipelines run on numbers that only look like embeddings, so the route refuses,
after validating the body like every other route (an invalid body is still a 422).
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from runner.errors import ApiError
from runner.schemas import EmbeddingsRequest, parse_body

router = APIRouter()

EMBEDDINGS_UNSUPPORTED = (
    "embeddings are not supported: RWKV-7 language models have no trained embedding output "
    "(use a dedicated embedding model; see docs/api.md)"
)


async def embeddings(request: Request) -> None:
    await parse_body(request, EmbeddingsRequest)
    raise ApiError(400, EMBEDDINGS_UNSUPPORTED, "input")


for _path in (
    "/v1/embeddings",
    "/embeddings",
    "/openai/v1/embeddings",
    "/v1/engines/text-embedding-ada-002/embeddings",
    "/engines/text-embedding-ada-002/embeddings",
):
    router.add_api_route(_path, embeddings, methods=["POST"])
