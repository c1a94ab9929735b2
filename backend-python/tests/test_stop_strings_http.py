"""Stop strings over HTTP on the classic backend: a stop that spans token boundaries is cut
cleanly (stream and non-stream), and a stop that only occurs in the prompt ends nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from runner.app import create_app
from runner_fakes import settings_with, sse_payloads

PROMPT = "The albatross glides over the southern ocean"
GREEDY = {"temperature": 0, "presence_penalty": 0, "frequency_penalty": 0, "stop_token_ids": [], "max_tokens": 24}


@pytest.fixture(scope="module")
def client(tiny_checkpoint: Path) -> Iterator[TestClient]:
    settings = settings_with(model_path=str(tiny_checkpoint), strategy="cpu fp32")
    with TestClient(create_app(settings)) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def reference(client: TestClient) -> tuple[str, list[str]]:
    """The greedy continuation without stops, and its per-token texts (from logprobs)."""
    reply = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPT}], "stop": [], "logprobs": True, **GREEDY}).json()
    tokens = [entry["token"] for entry in reply["choices"][0]["logprobs"]["content"]]
    text = reply["choices"][0]["message"]["content"]
    assert "".join(tokens) == text, "pick a prompt whose greedy tokens are whole UTF-8 characters"
    return text, tokens


def spanning_stop(tokens: list[str], span: int) -> tuple[str, int]:
    """A stop made of the last character of one token, `span - 2` whole tokens, and the first
    character of the token after: it starts and ends inside tokens. Returns (stop, start offset)."""
    offset = 0
    for i in range(len(tokens) - span + 1):
        window = tokens[i : i + span]
        if all(len(t) >= 2 for t in (window[0], window[-1])) and all(window):
            stop = window[0][-1] + "".join(window[1:-1]) + window[-1][0]
            return stop, offset + len(window[0]) - 1
        offset += len(tokens[i])
    pytest.fail(f"no {span}-token window with multi-character ends in {tokens!r}")


def chat(client: TestClient, stop: list[str], stream: bool) -> tuple[str, str | None]:
    body = {"messages": [{"role": "user", "content": PROMPT}], "stop": stop, "stream": stream, **GREEDY}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    if not stream:
        choice = response.json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]
    chunks = [json.loads(p) for p in sse_payloads(response.text)[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    return text, chunks[-1]["choices"][0]["finish_reason"]


@pytest.mark.parametrize("span", [2, 3])
@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_spanning_tokens_cuts_the_text_just_before_it(client: TestClient, reference: tuple[str, list[str]], span: int, stream: bool) -> None:
    text, tokens = reference
    stop, _ = spanning_stop(tokens, span)
    expected = text[: text.index(stop)]
    got, finish = chat(client, [stop], stream)
    assert got == expected, f"stop {stop!r}: got {got!r}, expected {expected!r}"
    assert finish == "stop"


def test_a_stop_that_occurs_only_in_the_prompt_does_not_end_generation(client: TestClient, reference: tuple[str, list[str]]) -> None:
    text, _ = reference
    in_prompt = ["albatross glides", "\n\nUser"]  # both are in the templated prompt
    assert not any(stop in text for stop in in_prompt), "the reference reply must not contain the stops"
    for stream in (False, True):
        got, finish = chat(client, in_prompt, stream)
        assert (got, finish) == (text, "length"), f"stream={stream}: generation ended early: {got!r}"


def test_default_chat_stops_match_the_templates_turn_headers_only_in_the_reply(client: TestClient, reference: tuple[str, list[str]]) -> None:
    """The chat prompt is full of "\\n\\nUser"-like headers; with the default stops the reply is
    the same as without stops, cut at the first header the model itself writes."""
    from runner.prompts import DEFAULT_CHAT_STOPS

    text, _ = reference
    body = {"messages": [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "Yes."}, {"role": "user", "content": PROMPT}], **GREEDY}
    with_defaults = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    without = client.post("/v1/chat/completions", json={**body, "stop": []}).json()["choices"][0]["message"]["content"]
    cut = min((without.index(s) for s in DEFAULT_CHAT_STOPS if s in without), default=len(without))
    assert with_defaults == without[:cut]
