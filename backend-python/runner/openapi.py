"""The request bodies in the OpenAPI document (`/openapi.json`, `/docs`).

Routes read their bodies themselves (runner.json_body parses them whatever the Content-Type, the
route validates them with its pydantic model), so FastAPI cannot see which model a route takes.
`REQUEST_BODIES` says it, per path; `install(app)` publishes each model's JSON schema (ranges,
defaults and all) as the operation's request body, so generated clients and fuzzers see what the
server accepts. tests/test_openapi.py fails for a POST route missing from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from runner.native_schemas import (
    BigBatchRequest,
    FimRequest,
    NativeBatchRequest,
    NativeBatchRequestV2,
    StateChatRequest,
    StateDeleteRequest,
    StateStatusRequest,
    TranslateRequest,
)
from runner.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingsRequest,
    FileToTextForm,
    SwitchModelRequest,
    UpdateConfigRequest,
)

# path -> the bodies it accepts (more than one: any of them); () for a POST route without a body.
REQUEST_BODIES: Mapping[str, tuple[type[BaseModel], ...]] = {
    "/switch-model": (SwitchModelRequest,),
    "/update-config": (UpdateConfigRequest,),
    "/exit": (),
    "/v1/chat/completions": (ChatCompletionRequest, NativeBatchRequest),
    "/chat/completions": (ChatCompletionRequest, NativeBatchRequest),
    "/v1/completions": (CompletionRequest,),
    "/completions": (CompletionRequest,),
    "/openai/v1/completions": (CompletionRequest,),
    "/v1/embeddings": (EmbeddingsRequest,),
    "/embeddings": (EmbeddingsRequest,),
    "/openai/v1/embeddings": (EmbeddingsRequest,),
    "/v1/engines/text-embedding-ada-002/embeddings": (EmbeddingsRequest,),
    "/engines/text-embedding-ada-002/embeddings": (EmbeddingsRequest,),
    "/file-to-text": (FileToTextForm,),
    "/albatross/profile/reset": (),
    "/v2/chat/completions": (NativeBatchRequestV2,),
    "/big_batch/completions": (BigBatchRequest,),
    "/FIM/v1/batch-FIM": (FimRequest,),
    "/translate/v1/batch-translate": (TranslateRequest,),
    "/openai/v1/chat/completions": (ChatCompletionRequest,),
    "/state/chat/completions": (StateChatRequest,),
    "/multi_state/chat/completions": (StateChatRequest,),
    "/state/status": (StateStatusRequest,),
    "/state/delete": (StateDeleteRequest,),
}
MULTIPART_PATHS = frozenset({"/file-to-text"})  # the one route whose body is a form, not JSON
_REF = "#/components/schemas/{model}"


def _schema_ref(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template=_REF)
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    return {"$ref": _REF.format(model=model.__name__)}


def with_request_bodies(document: dict[str, Any], bodies: Mapping[str, tuple[type[BaseModel], ...]] = REQUEST_BODIES) -> dict[str, Any]:
    components: dict[str, Any] = document.setdefault("components", {}).setdefault("schemas", {})
    for path, operations in document.get("paths", {}).items():
        operation = operations.get("post")
        models = bodies.get(path)
        if operation is None or not models:
            continue
        refs = [_schema_ref(model, components) for model in models]
        schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
        media_type = "multipart/form-data" if path in MULTIPART_PATHS else "application/json"
        operation["requestBody"] = {"required": True, "content": {media_type: {"schema": schema}}}
    return document


def install(app: FastAPI) -> None:
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = with_request_bodies(build())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
