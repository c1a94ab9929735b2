"""The official openai Python client against a live uvicorn server serving the classic backend."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

# Installed by requirements-test.txt (CI); the GPU image lacks it, where this module is skipped.
openai = pytest.importorskip("openai")

from runner.app import create_app
from runner_fakes import live_server, settings_with

PASSWORD = "client-test-password"
GREEDY = {"temperature": 0, "presence_penalty": 0, "frequency_penalty": 0, "max_tokens": 8}


@pytest.fixture(scope="module", params=[None, PASSWORD], ids=["open", "password"])
def server(request: pytest.FixtureRequest, tiny_checkpoint: Path) -> Iterator[tuple[str, str | None]]:
    settings = settings_with(model_path=str(tiny_checkpoint), strategy="cpu fp32", password=request.param)
    with live_server(create_app(settings)) as base_url:
        yield base_url, request.param


@pytest.fixture
def client(server: tuple[str, str | None]) -> openai.OpenAI:
    base_url, password = server
    return openai.OpenAI(base_url=base_url + "/v1", api_key=password or "unused", max_retries=0, timeout=60)


def test_chat_completion(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="rwkv", messages=[{"role": "user", "content": "Hello"}], **GREEDY)
    assert reply.object == "chat.completion" and reply.model == "rwkv"
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.completion_tokens >= 1


def test_streamed_chat_equals_the_non_streamed_one(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    whole = client.chat.completions.create(model="rwkv", messages=messages, **GREEDY).choices[0].message.content
    stream = client.chat.completions.create(model="rwkv", messages=messages, stream=True, stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage is not None and chunks[-1].choices == []


def test_text_completion_stream_and_not(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="rwkv", prompt="Once upon a time", **GREEDY)
    assert whole.object == "text_completion" and whole.usage is not None
    streamed = "".join(c.choices[0].text for c in client.completions.create(model="rwkv", prompt="Once upon a time", stream=True, **GREEDY))
    assert streamed == whole.choices[0].text


def test_models_list(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["rwkv7-tiny", "gpt-3.5-turbo", "text-davinci-003"]


def test_a_wrong_key_is_refused_only_when_a_password_is_set(server: tuple[str, str | None]) -> None:
    base_url, password = server
    wrong = openai.OpenAI(base_url=base_url + "/v1", api_key="wrong", max_retries=0)
    messages = [{"role": "user", "content": "Hi"}]
    if password is None:
        assert wrong.chat.completions.create(model="rwkv", messages=messages, max_tokens=2).choices
        return
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="rwkv", messages=messages, max_tokens=2)


def test_an_invalid_field_is_a_client_error_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.UnprocessableEntityError, match="top_p"):
        client.chat.completions.create(model="rwkv", messages=[{"role": "user", "content": "Hi"}], top_p=2)
