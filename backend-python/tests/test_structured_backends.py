"""Constrained output end to end on both backends (the classic one, and the Albatross engine on
the CPU): a random-weight model, so only the constraint can make its answers valid. Each answer
is parsed and validated with jsonschema."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from fastapi.testclient import TestClient

from albatross.tokenizer import get_tokenizer
from runner.app import create_app
from runner_fakes import settings_with, sse_payloads
from structured_cases import BACKENDS, GREEDY, PARAMETERS, SAMPLED, SCHEMAS, TOOLS, USER, json_schema_format


@pytest.fixture(scope="module", params=list(BACKENDS))
def client(request: pytest.FixtureRequest, tiny_checkpoint: Path) -> Iterator[TestClient]:
    settings = settings_with(model_path=str(tiny_checkpoint), strategy=BACKENDS[request.param], models_dir=tiny_checkpoint.parent)
    with TestClient(create_app(settings)) as test_client:
        assert test_client.get("/status").json()["backend"] == request.param
        yield test_client


def chat(client: TestClient, **fields: Any) -> dict[str, Any]:
    response = client.post("/v1/chat/completions", json={"messages": USER, **fields})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def assert_valid_calls(choice: dict[str, Any], names: set[str], may_be_cut: bool = False) -> list[dict[str, Any]]:
    """Every call names a tool and its arguments validate; with `may_be_cut`, a last call that
    max_tokens cut short (finish_reason "length") is the only exception."""
    assert choice["finish_reason"] == "tool_calls" or (may_be_cut and choice["finish_reason"] == "length"), choice
    calls = choice["message"]["tool_calls"]
    assert calls and choice["message"]["content"] is None
    complete = calls if choice["finish_reason"] == "tool_calls" else calls[:-1]
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
        assert call["function"]["name"] in names
    for call in complete:
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[call["function"]["name"]])
    return calls


@pytest.mark.parametrize("schema_name", list(SCHEMAS))
@pytest.mark.parametrize("seed", range(4))
def test_every_sampled_answer_validates_against_its_schema(client: TestClient, schema_name: str, seed: int) -> None:
    choice = chat(client, response_format=json_schema_format(SCHEMAS[schema_name]), seed=seed, **SAMPLED)
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMAS[schema_name])


def test_the_model_alone_does_not_write_json(client: TestClient) -> None:
    """The control: without the constraint the same greedy request is not valid JSON."""
    with pytest.raises(ValueError):
        json.loads(chat(client, **GREEDY)["message"]["content"])
    json.loads(chat(client, response_format=json_schema_format(SCHEMAS["flat"]), **GREEDY)["message"]["content"])


@pytest.mark.parametrize("seed", range(2))
def test_json_object_mode_gives_one_object(client: TestClient, seed: int) -> None:
    choice = chat(client, response_format={"type": "json_object"}, seed=seed, temperature=1.0, top_p=0.2, max_tokens=120)
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:  # an unbounded object may run out of tokens; what there is must still start one
        assert choice["finish_reason"] == "length" and choice["message"]["content"].lstrip().startswith("{")


def test_completions_take_response_format_too(client: TestClient) -> None:
    body = {"prompt": "Data:", "response_format": json_schema_format(SCHEMAS["enum-and-array"]), "seed": 4, **SAMPLED}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["text"]), SCHEMAS["enum-and-array"])


@pytest.mark.parametrize("seed", range(4))
def test_required_tool_calls_name_a_tool_and_carry_valid_arguments(client: TestClient, seed: int) -> None:
    choice = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=seed, **SAMPLED)
    assert len(assert_valid_calls(choice, {"get_weather", "get_time"})) == 1, "parallel_tool_calls false allows one call"


def test_parallel_calls_are_several_valid_calls(client: TestClient) -> None:
    # This random model rarely ends a run of parallel calls, so max_tokens may cut the last one.
    calls = assert_valid_calls(chat(client, tools=TOOLS, tool_choice="required", seed=1, **SAMPLED), {"get_weather", "get_time"}, may_be_cut=True)
    assert len(calls) >= 2
    assert len({call["id"] for call in calls}) == len(calls)


@pytest.mark.parametrize("seed", range(3))
def test_a_named_tool_choice_calls_exactly_that_function_once(client: TestClient, seed: int) -> None:
    choice = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}, seed=seed, **SAMPLED)
    calls = assert_valid_calls(choice, {"get_time"})
    assert len(calls) == 1


@pytest.mark.parametrize("seed", range(4))
def test_auto_answers_are_either_text_or_valid_calls(client: TestClient, seed: int) -> None:
    choice = chat(client, tools=TOOLS, parallel_tool_calls=False, seed=seed, **{**SAMPLED, "max_tokens": 80})
    if "tool_calls" in choice["message"]:
        assert_valid_calls(choice, {"get_weather", "get_time"})
    else:
        assert choice["finish_reason"] in ("stop", "length") and isinstance(choice["message"]["content"], str)


@pytest.mark.parametrize("seed", range(2))
def test_streamed_tool_call_deltas_reassemble_to_the_non_streamed_answer(client: TestClient, seed: int) -> None:
    fields = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "seed": seed, **SAMPLED}
    whole = chat(client, **fields)
    response = client.post("/v1/chat/completions", json={"messages": USER, "stream": True, **fields})
    assert response.status_code == 200
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for payload in sse_payloads(response.text)[:-1]:
        choice = json.loads(payload)["choices"][0]
        for entry in choice["delta"].get("tool_calls", []):
            call = calls.setdefault(entry["index"], {"name": "", "arguments": ""})
            call["name"] += entry.get("function", {}).get("name") or ""
            call["arguments"] += entry.get("function", {}).get("arguments") or ""
        finish = choice["finish_reason"] or finish
    assert finish == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [c["function"] for c in whole["message"]["tool_calls"]]


def test_logit_bias_steers_the_greedy_choice(client: TestClient) -> None:
    tokenizer = get_tokenizer()
    plain = client.post("/v1/completions", json={"prompt": "Hello", **GREEDY, "max_tokens": 1}).json()["choices"][0]["text"]
    first = tokenizer.encode(plain)[0]
    banned = client.post("/v1/completions", json={"prompt": "Hello", **GREEDY, "max_tokens": 1, "logit_bias": {str(first): -100}}).json()
    assert banned["choices"][0]["text"] != plain
    forced = client.post("/v1/completions", json={"prompt": "Hello", **GREEDY, "max_tokens": 1, "logit_bias": {"33": 100}}).json()
    assert forced["choices"][0]["text"] == tokenizer.decode([33])


def test_the_same_constrained_greedy_request_gives_the_same_answer(client: TestClient) -> None:
    fields = {"response_format": json_schema_format(SCHEMAS["nested-ref-anyof"]), **GREEDY, "max_tokens": 200}
    assert chat(client, **fields) == chat(client, **fields)


def test_a_bad_schema_is_a_400_and_the_backend_keeps_serving(client: TestClient) -> None:
    response = client.post("/v1/chat/completions", json={"messages": USER, "response_format": json_schema_format({"type": "object", "if": {}})})
    assert response.status_code == 400 and "keyword if" in response.json()["error"]["message"]
    chat(client, response_format=json_schema_format(SCHEMAS["flat"]), **GREEDY)


# A const of 200,000 characters: valid JSON Schema, but llguidance's lexer gives up ("too many
# expressions") once the output reaches it, after the request has started.
TOO_COMPLEX = {"type": "object", "properties": {"a": {"const": "x y " * 50_000}}, "required": ["a"]}


def test_a_schema_past_the_grammar_engines_limits_is_a_400_and_the_backend_keeps_serving(client: TestClient) -> None:
    body = {"messages": USER, "response_format": json_schema_format(TOO_COMPLEX), "max_tokens": 40}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "output constraint could not be followed" in message and "lexer" in message, message
    assert len(message) < 300, "the schema or the parser's state was dumped into the reply"
    # A stream that fails before its first token has sent nothing yet: the same 400, as JSON.
    streamed = client.post("/v1/chat/completions", json={**body, "stream": True})
    assert streamed.status_code == 400 and "output constraint could not be followed" in streamed.json()["error"]["message"]
    json.loads(chat(client, response_format=json_schema_format(SCHEMAS["flat"]), **GREEDY)["message"]["content"])
