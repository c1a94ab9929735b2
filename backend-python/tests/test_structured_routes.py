"""The routes' side of tools, response_format and logit_bias, on a scripted backend: what reaches
the backend, the 4xx for what cannot be enforced, and the OpenAI reply shapes of tool calls
(streamed as index, id and name, then argument fragments, whatever the token boundaries)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from runner_fakes import ScriptedBackend, make_app, settings_with, sse_payloads

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris {\\"x\\"}", "days": 2}}</tool_call>'
SECOND = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
USER = [{"role": "user", "content": "Weather in Paris?"}]


def pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.fixture
def backend() -> ScriptedBackend:
    return ScriptedBackend([" ", CALL])


@pytest.fixture
def client(backend: ScriptedBackend) -> Iterator[TestClient]:
    with TestClient(make_app(settings_with(max_tokens=8192), backend)) as test_client:
        yield test_client


def post(client: TestClient, path: str = "/v1/chat/completions", **fields: Any) -> Any:
    body = {"messages": USER, **fields} if "chat" in path else fields
    return client.post(path, json=body)


def streamed_choice(response: Any) -> tuple[dict[str, Any], str | None, list[dict[str, Any]]]:
    """Reassemble a streamed chat choice as a client does: (message, finish_reason, tool deltas)."""
    assert response.status_code == 200, response.text
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    deltas: list[dict[str, Any]] = []
    finish = None
    for payload in sse_payloads(response.text):
        if payload == "[DONE]":
            continue
        choice = json.loads(payload)["choices"][0]
        delta = choice["delta"]
        content.append(delta.get("content") or "")
        for entry in delta.get("tool_calls", []):
            deltas.append(entry)
            call = calls.setdefault(entry["index"], {"id": None, "type": None, "function": {"name": "", "arguments": ""}})
            call["id"] = call["id"] or entry.get("id")
            call["type"] = call["type"] or entry.get("type")
            function = entry.get("function", {})
            call["function"]["name"] += function.get("name") or ""
            call["function"]["arguments"] += function.get("arguments") or ""
        finish = choice["finish_reason"] or finish
    message = {"content": "".join(content), "tool_calls": [calls[i] for i in sorted(calls)]}
    return message, finish, deltas


# ---------------------------------------------------------------------------- what reaches the backend


def test_tools_reach_the_backend_as_a_grammar_of_their_calls_and_a_system_turn(client: TestClient, backend: ScriptedBackend) -> None:
    assert post(client, tools=[WEATHER, TIME]).status_code == 200
    request = backend.requests[-1]
    assert request.constraint is not None and request.constraint.label == "tools"
    assert '\\"get_weather\\"' in request.constraint.grammar and '\\"get_time\\"' in request.constraint.grammar
    assert "TEXT | calls" in request.constraint.grammar, "tool_choice defaults to auto"
    prompt = bytes(request.prompt_tokens).decode()
    assert prompt.startswith("System: You can call functions.") and '{"name": "get_weather", "description": "The weather in a city."' in prompt
    assert "\n\n" not in prompt.split("\n\nUser:")[0], "the tools turn holds no blank line"


@pytest.mark.parametrize(
    ("choice", "parallel", "expected"),
    [
        ("required", None, ["start: calls", "(NEXT call CLOSE)*", "f1"]),
        ("required", False, ["start: calls", "calls: OPEN call CLOSE\n", "f1"]),
        ({"type": "function", "function": {"name": "get_time"}}, None, ["start: calls", "calls: OPEN call CLOSE\n", "get_time"]),
    ],
)
def test_tool_choice_and_parallel_tool_calls_shape_the_grammar(client: TestClient, backend: ScriptedBackend, choice: Any, parallel: Any, expected: list[str]) -> None:
    fields = {"tools": [WEATHER, TIME], "tool_choice": choice} | ({} if parallel is None else {"parallel_tool_calls": parallel})
    assert post(client, **fields).status_code == 200
    grammar = backend.requests[-1].constraint.grammar  # type: ignore[union-attr]
    assert all(piece in grammar for piece in expected), grammar
    if isinstance(choice, dict):
        assert "get_weather" not in grammar, "a named choice allows only that function"
        assert "You must call get_time now." in bytes(backend.requests[-1].prompt_tokens).decode()


def test_tool_choice_none_sends_neither_grammar_nor_tools_turn(client: TestClient, backend: ScriptedBackend) -> None:
    assert post(client, tools=[WEATHER], tool_choice="none").status_code == 200
    assert backend.requests[-1].constraint is None
    assert not bytes(backend.requests[-1].prompt_tokens).decode().startswith("System:")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/chat/completions", "/openai/v1/chat/completions", "/v1/completions"])
def test_response_format_reaches_the_backend_on_every_route(client: TestClient, backend: ScriptedBackend, path: str) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    extra = {} if "chat" in path else {"prompt": "x"}
    response = post(client, path, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}, **extra)
    assert response.status_code == 200, response.text
    constraint = backend.requests[-1].constraint
    assert constraint is not None and constraint.label == "response_format json_schema" and '"a":{"type":"integer"}' in constraint.grammar


def test_json_object_mode_and_text_mode(client: TestClient, backend: ScriptedBackend) -> None:
    assert post(client, response_format={"type": "json_object"}).status_code == 200
    assert backend.requests[-1].constraint.label == "response_format json_object"  # type: ignore[union-attr]
    assert post(client, response_format={"type": "text"}).status_code == 200
    assert backend.requests[-1].constraint is None


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/openai/v1/chat/completions", "/v1/completions"])
def test_logit_bias_reaches_the_sampler_as_sorted_id_pairs(client: TestClient, backend: ScriptedBackend, path: str) -> None:
    extra = {} if "chat" in path else {"prompt": "x"}
    assert post(client, path, logit_bias={"300": 5, "7": -100}, **extra).status_code == 200
    assert backend.requests[-1].sampling.logit_bias == ((7, -100.0), (300, 5.0))


# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("bias", "named"),
    [({"abc": 1}, "'abc' is not a token id"), ({"70000": 1}, "'70000' is not a token id"), ({"5": 100.5}, "outside [-100, 100]"), ({str(i): 1 for i in range(1025)}, "at most 1024")],
)
def test_a_bad_logit_bias_is_a_422_naming_it(client: TestClient, bias: dict[str, float], named: str) -> None:
    for path, extra in (("/v1/chat/completions", {}), ("/v1/completions", {"prompt": "x"})):
        response = post(client, path, logit_bias=bias, **extra)
        assert response.status_code == 422, response.text
        assert response.json()["error"]["param"] == "logit_bias" and named in response.json()["error"]["message"]


def _nested(levels: int) -> dict[str, Any]:
    """An object schema `levels` objects deep (two levels of JSON each)."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize(
    ("fields", "param", "named"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools.0.function.parameters", "parameters is required"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope', which is not among the tools"),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools.0.type", "only function tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "repeated: get_weather"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools.0.function.parameters", "must describe an object"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "if": {}}}}]}, "tools.0.function.parameters", "keyword if"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema", "keyword uniqueItems"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema", "is required"),
        ({"response_format": {"type": "json_object"}, "tools": [WEATHER]}, "response_format", "together with callable tools"),
        # Nested past llguidance's JSON reader (two depths apart: the two places it refuses).
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested(62)}}}, "response_format.json_schema.schema", "nested too deeply"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested(100)}}}, "response_format.json_schema.schema", "nested too deeply"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": _nested(100)}}]}, "tools.0.function.parameters", "nested too deeply"),
    ],
)
def test_what_cannot_be_enforced_is_a_400_naming_the_problem(client: TestClient, backend: ScriptedBackend, fields: dict[str, Any], param: str, named: str) -> None:
    before = len(backend.requests)
    response = post(client, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and named in error["message"], error
    assert len(backend.requests) == before, "nothing reached the backend"
    assert post(client).status_code == 200, "the server keeps serving"


def test_more_tools_than_openai_allows_are_a_422_naming_tools(client: TestClient, backend: ScriptedBackend) -> None:
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(129)]
    response = post(client, tools=tools)
    assert response.status_code == 422 and response.json()["error"]["param"] == "tools", response.text
    assert post(client, tools=tools[:128]).status_code == 200
    assert post(client).status_code == 200, "the server keeps serving"


def test_a_grammar_engine_panic_reaches_the_client_as_one_line() -> None:
    """llguidance reports a failed internal assertion with a native backtrace after it; the client
    gets the first line (a grammar of 70,000 alternatives passes its u16 symbol table)."""
    from albatross.constraints import ConstraintCompiler, ConstraintError
    from albatross.tokenizer import get_tokenizer

    alternatives = " | ".join(f'"w{i}"' for i in range(70_000))
    with pytest.raises(ConstraintError) as raised:
        ConstraintCompiler(get_tokenizer()).compile(f"start: {alternatives}")
    message = str(raised.value)
    assert "\n" not in message and "backtrace" not in message and len(message) < 300, message


def test_schemas_are_read_on_a_thread_not_on_the_event_loop() -> None:
    """A large schema takes llguidance seconds to read (GIL released): the routes read it on a
    worker thread, so the loop's other streams go on; a body without a schema stays on the loop."""
    from runner.schemas import ChatCompletionRequest
    from runner.structured_output import StructuredOutput, chat_output, read_off_loop

    readers: list[threading.Thread] = []

    def reading(body: ChatCompletionRequest) -> StructuredOutput:
        readers.append(threading.current_thread())
        return chat_output(body)

    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
    constrained = ChatCompletionRequest.model_validate({"messages": USER, "response_format": schema})
    with_tools = ChatCompletionRequest.model_validate({"messages": USER, "tools": [WEATHER]})
    plain = ChatCompletionRequest.model_validate({"messages": USER})

    async def run() -> threading.Thread:
        assert (await read_off_loop(reading, constrained)).constraint is not None
        assert (await read_off_loop(reading, with_tools)).tools is not None
        assert (await read_off_loop(reading, plain)).constraint is None
        return threading.current_thread()

    loop_thread = asyncio.run(run())
    assert readers[0] is not loop_thread and readers[1] is not loop_thread and readers[2] is loop_thread


def test_enable_think_with_a_constraint_is_refused_on_the_native_route(client: TestClient) -> None:
    response = post(client, "/openai/v1/chat/completions", enable_think=True, response_format={"type": "json_object"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "enable_think"


def test_an_unknown_response_format_type_is_a_422(client: TestClient) -> None:
    assert post(client, response_format={"type": "yaml"}).status_code == 422


# ---------------------------------------------------------------------------- reply shapes


def test_a_call_becomes_message_tool_calls_with_finish_reason_tool_calls(client: TestClient) -> None:
    reply = post(client, tools=[WEATHER]).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and len(call["id"]) == 29 and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris {\\"x\\"}", "days": 2}'}
    assert json.loads(call["function"]["arguments"]) == {"city": 'Paris {"x"}', "days": 2}


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_tool_calls_reassemble_to_the_non_streamed_ones_whatever_the_boundaries(client: TestClient, backend: ScriptedBackend, size: int) -> None:
    answer = " " + CALL + "\n" + SECOND
    backend.script = lambda request: pieces(answer, size)
    whole = post(client, tools=[WEATHER, TIME]).json()["choices"][0]
    message, finish, deltas = streamed_choice(post(client, tools=[WEATHER, TIME], stream=True))
    assert finish == whole["finish_reason"] == "tool_calls"
    assert message["content"] == ""
    assert [c["function"] for c in message["tool_calls"]] == [c["function"] for c in whole["message"]["tool_calls"]]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
    firsts = [d for d in deltas if "id" in d]
    assert [d["index"] for d in firsts] == [0, 1] and all(d["function"]["arguments"] == "" and d["type"] == "function" for d in firsts)
    assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in deltas if "id" not in d), "later deltas carry fragments only"


@pytest.mark.parametrize("answer", [" The weather is fine.", " <toolbox> is a word", "<tool", ""])
def test_an_auto_text_answer_is_content_even_when_it_starts_like_a_call(client: TestClient, backend: ScriptedBackend, answer: str) -> None:
    backend.script = lambda request: pieces(answer, 2)
    whole = post(client, tools=[WEATHER]).json()["choices"][0]
    assert whole["message"]["content"] == answer and "tool_calls" not in whole["message"] and whole["finish_reason"] == "stop"
    message, finish, deltas = streamed_choice(post(client, tools=[WEATHER], stream=True))
    assert message["content"] == answer and not deltas and finish == "stop"


def test_a_call_cut_by_max_tokens_keeps_finish_reason_length(client: TestClient, backend: ScriptedBackend) -> None:
    backend.script = lambda request: pieces(" " + CALL, 4)
    choice = post(client, tools=[WEATHER], max_tokens=14).json()["choices"][0]  # 56 characters: the name and a piece of the arguments
    assert choice["finish_reason"] == "length"
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_earlier_calls_and_tool_results_are_rendered_into_the_prompt(client: TestClient, backend: ScriptedBackend) -> None:
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    assert client.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER]}).status_code == 200
    prompt = bytes(backend.requests[-1].prompt_tokens).decode()
    assert 'Assistant: <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n\nObservation: sunny, 21 C\n\nAssistant:' in prompt
