"""End to end: the classic backend (official rwkv package) loaded at start, served over HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from albatross.tokenizer import get_tokenizer
from runner.app import create_app
from runner.classic_backend import rwkv_model_module
from runner.prompts import chat_prompt
from runner_fakes import settings_with, sse_payloads

GREEDY = {"temperature": 0, "presence_penalty": 0, "frequency_penalty": 0, "stop": [], "stop_token_ids": []}


@pytest.fixture(scope="module")
def client(tiny_checkpoint: Path) -> Iterator[TestClient]:
    settings = settings_with(model_path=str(tiny_checkpoint), strategy="cpu fp32", models_dir=tiny_checkpoint.parent)
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def rwkv_package_greedy(checkpoint: Path, prompt: str, steps: int) -> list[int]:
    """The official package's greedy continuation (prompt tokens from albatross.tokenizer, which
    test_tokenizer.py holds equal to the package's World tokenizer; building that one takes ~5 s)."""
    model = rwkv_model_module().RWKV(model=str(checkpoint.with_suffix("")), strategy="cpu fp32")
    logits, state = model.forward(get_tokenizer().encode(prompt), None)
    produced: list[int] = []
    for _ in range(steps):
        token = int(torch.argmax(logits.float()))
        produced.append(token)
        logits, state = model.forward([token], state)
    return produced


def test_the_model_loaded_at_start_is_reported_by_status(client: TestClient) -> None:
    status = client.get("/status").json()
    assert (status["status"], status["backend"], status["strategy"], status["model"]) == (3, "classic", "cpu fp32", "rwkv7-tiny")


def test_greedy_chat_over_http_equals_the_rwkv_package_token_for_token(client: TestClient, tiny_checkpoint: Path) -> None:
    steps = 12
    messages = [{"role": "user", "content": "Tell me about the albatross."}]
    reply = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": steps, **GREEDY}).json()
    prompt = chat_prompt([("user", messages[0]["content"])])
    expected = rwkv_package_greedy(tiny_checkpoint, prompt, steps)
    expected_text = get_tokenizer().decode_bytes(expected).decode("utf-8", errors="replace")
    got = reply["choices"][0]["message"]["content"]
    assert reply["usage"]["completion_tokens"] == steps and reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["prompt_tokens"] == len(get_tokenizer().encode(prompt))
    assert got == expected_text, f"HTTP text {got!r} != rwkv package greedy text {expected_text!r} (ids {expected})"


def test_streamed_greedy_text_equals_the_non_streamed_text(client: TestClient) -> None:
    body = {"prompt": "The quick brown fox", "max_tokens": 10, **GREEDY}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    streamed = client.post("/v1/completions", json={**body, "stream": True})
    pieces = [json.loads(p)["choices"][0]["text"] for p in sse_payloads(streamed.text)[:-1]]
    assert "".join(pieces) == whole
