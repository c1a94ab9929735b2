"""The OpenAPI document publishes the real request bodies, so generated clients and fuzzers see them."""

from __future__ import annotations

from typing import Any

from fastapi.routing import iter_route_contexts
from fastapi.testclient import TestClient

from runner.openapi import REQUEST_BODIES
from runner_fakes import ScriptedBackend, make_app


def document() -> dict[str, Any]:
    with TestClient(make_app(backend=ScriptedBackend(["ok"]))) as client:
        reply = client.get("/openapi.json")
        assert reply.status_code == 200
        return reply.json()  # type: ignore[no-any-return]


def resolve(doc: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    return doc["components"]["schemas"][ref.rsplit("/", 1)[1]] if ref else schema


def test_every_post_route_is_listed_with_its_bodies() -> None:
    app = make_app()
    posts = {route.path for route in iter_route_contexts(app.routes) if "POST" in (route.methods or ())}
    assert posts == set(REQUEST_BODIES), f"routes without an entry: {posts - set(REQUEST_BODIES)}; stale entries: {set(REQUEST_BODIES) - posts}"


def test_completion_bodies_carry_their_fields_ranges_and_requirements() -> None:
    doc = document()
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]
    assert body["required"] is True
    schema = resolve(doc, body["content"]["application/json"]["schema"])
    assert "prompt" in schema["required"]
    top_p = schema["properties"]["top_p"]["anyOf"][0]
    assert (top_p["minimum"], top_p["maximum"]) == (0, 1)
    assert schema["properties"]["top_k"]["anyOf"][0]["maximum"] == 2**31 - 1


def test_the_chat_route_accepts_openai_chat_or_a_native_batch() -> None:
    doc = document()
    schema = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    names = {resolve(doc, option)["title"] for option in schema["anyOf"]}
    assert names == {"ChatCompletionRequest", "NativeBatchRequest"}
    chat = resolve(doc, schema["anyOf"][0])
    message = resolve(doc, chat["properties"]["messages"]["items"])
    assert set(message["properties"]["role"]["enum"]) >= {"system", "user", "assistant"}


def test_native_and_state_routes_publish_their_bodies() -> None:
    doc = document()
    for path, field in (("/v2/chat/completions", "contents"), ("/state/chat/completions", "session_id"), ("/translate/v1/batch-translate", "text_list"), ("/switch-model", "model")):
        schema = resolve(doc, doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"])
        assert field in schema["properties"], (path, sorted(schema["properties"]))
