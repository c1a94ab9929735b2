"""Real clients' structured output and tools against a live server on each backend (the classic
one and the Albatross engine on the CPU; random weights: only the constraint makes the answers parse): the official openai client's
`response_format`, `chat.completions.parse` with a pydantic model and tools, and LangChain's
`with_structured_output` and `bind_tools`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

openai = pytest.importorskip("openai")  # requirements-test.txt; absent on the GPU image

from runner.app import create_app
from runner_fakes import live_server, settings_with
from structured_cases import BACKENDS

SAMPLED = {"temperature": 1.0, "top_p": 0.9, "max_tokens": 200}


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)


class Owner(BaseModel):
    name: str = Field(min_length=1, max_length=10)
    pets: list[Pet] = Field(max_length=2)
    vip: bool


class GetWeather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=12)
    unit: Literal["C", "F"]


@pytest.fixture(scope="module", params=list(BACKENDS))
def base_url(request: pytest.FixtureRequest, tiny_checkpoint: Path) -> Iterator[str]:
    with live_server(create_app(settings_with(model_path=str(tiny_checkpoint), strategy=BACKENDS[request.param]))) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


MESSAGES = [{"role": "user", "content": "Describe an owner."}]


def test_openai_response_format_json_schema(client: openai.OpenAI) -> None:
    schema = Owner.model_json_schema()
    reply = client.chat.completions.create(
        model="rwkv", messages=MESSAGES, response_format={"type": "json_schema", "json_schema": {"name": "owner", "schema": schema}}, seed=3, **SAMPLED
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), schema)


@pytest.mark.parametrize("seed", range(3))
def test_openai_parse_with_a_pydantic_model(client: openai.OpenAI, seed: int) -> None:
    completion = client.chat.completions.parse(model="rwkv", messages=MESSAGES, response_format=Owner, seed=seed, **SAMPLED)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Owner) and len(parsed.pets) <= 2


def test_openai_tools_required_and_streamed(client: openai.OpenAI) -> None:
    tool = openai.pydantic_function_tool(GetWeather)
    reply = client.chat.completions.create(model="rwkv", messages=MESSAGES, tools=[tool], tool_choice="required", parallel_tool_calls=False, seed=2, **SAMPLED)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.function.name == "GetWeather" and call.id.startswith("call_")
    GetWeather.model_validate_json(call.function.arguments)

    with client.chat.completions.stream(model="rwkv", messages=MESSAGES, tools=[tool], tool_choice="required", parallel_tool_calls=False, seed=2, **SAMPLED) as stream:
        final = stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls
    assert streamed and streamed[0].function.name == call.function.name and streamed[0].function.arguments == call.function.arguments
    assert isinstance(streamed[0].function.parsed_arguments, GetWeather), "strict pydantic tools are parsed by the client"


def test_openai_bad_schema_is_a_400_naming_the_keyword(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):
        client.chat.completions.create(
            model="rwkv", messages=MESSAGES, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}
        )


langchain_openai = pytest.importorskip("langchain_openai")


@pytest.fixture
def chat_model(base_url: str) -> object:
    return langchain_openai.ChatOpenAI(base_url=base_url + "/v1", api_key="unused", model="rwkv", temperature=1.0, max_tokens=200, seed=5, max_retries=0, timeout=120)


def test_langchain_with_structured_output(chat_model: object) -> None:
    structured = chat_model.with_structured_output(Owner)  # type: ignore[attr-defined]
    assert isinstance(structured.invoke("Describe an owner."), Owner)


def test_langchain_bind_tools(chat_model: object) -> None:
    # strict: LangChain then sends additionalProperties false; without it the schema allows any
    # extra property, which a random model fills until max_tokens.
    bound = chat_model.bind_tools([GetWeather], tool_choice="GetWeather", strict=True)  # type: ignore[attr-defined]
    message = bound.invoke("Weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "GetWeather"
    GetWeather.model_validate(call["args"])
