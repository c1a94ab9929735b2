"""The native batch routes over HTTP (rwkv_lightning API): shapes, defaults, streams, errors.

`HistoryBackend` is a concurrent, stateful test double: its "RNN state" is the list of every token
it has consumed (one token per character), and its greedy next token is a hash of that history, so
a continued state and a replayed conversation give the same text exactly, as with a real RWKV.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient

from albatross_engine.state_cache import StateCache
from runner.interface import AbstractRWKV, BackendError, GenerationEvent, GenerationRequest
from runner_fakes import make_app, settings_with, sse_payloads

ALPHABET = "abcdefghijklmnopqrstuvwxyz ,."


@dataclass(slots=True)
class HistoryState:
    tokens: torch.Tensor  # int64 [T]: every token consumed so far

    def to_bytes(self) -> bytes:
        return self.tokens.numpy().tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> HistoryState:
        return cls(torch.frombuffer(bytearray(data), dtype=torch.int64).clone())


def next_token(history: list[int]) -> int:
    digest = hashlib.sha256(json.dumps(history[-64:]).encode()).digest()
    return ord(ALPHABET[digest[0] % len(ALPHABET)])


class HistoryBackend(AbstractRWKV):
    backend_name = "history"
    concurrent = True

    def __init__(self, store: StateCache | None, name: str = "history-model", step_delay_s: float = 0.0) -> None:
        self.name = name
        self.state_store = store
        self.step_delay_s = step_delay_s
        self.requests: list[GenerationRequest] = []
        self.aborted = 0

    def encode(self, text: str) -> list[int]:
        return [ord(ch) for ch in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids)

    def generate(self, request: GenerationRequest) -> Iterator[GenerationEvent]:
        raise NotImplementedError("the test double is async only")

    async def async_generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        self.requests.append(request)
        history: list[int] = []
        ref = request.state
        if ref is not None and ref.load_key is not None:
            if self.state_store is None:
                raise BackendError(400, "no state cache")
            loaded = self.state_store.get(ref.load_key)
            if loaded is None:
                raise BackendError(404, f"no saved state {ref.load_key!r}")
            history = loaded.tokens.tolist()
        history += request.prompt_tokens
        prompt_tokens = len(request.prompt_tokens)
        finished = False
        try:
            for produced in range(1, request.sampling.max_tokens + 1):
                token = next_token(history)
                history.append(token)
                await asyncio.sleep(self.step_delay_s)
                yield GenerationEvent(text=chr(token), token_ids=[token], prompt_tokens=prompt_tokens, completion_tokens=produced)
            if ref is not None and ref.save_key is not None and self.state_store is not None:
                self.state_store.put(ref.save_key, HistoryState(torch.tensor(history, dtype=torch.int64)))
            finished = True
            yield GenerationEvent(finish_reason="length", prompt_tokens=prompt_tokens, completion_tokens=request.sampling.max_tokens)
        finally:
            if not finished:
                self.aborted += 1

    def shutdown(self) -> None:
        if self.state_store is not None:
            self.state_store.close()


def greedy_continuation(prompt: str, max_tokens: int) -> str:
    history = [ord(ch) for ch in prompt]
    out = []
    for _ in range(max_tokens):
        token = next_token(history)
        history.append(token)
        out.append(chr(token))
    return "".join(out)


def history_cache(path: Path, l1: int = 1 << 20, l2: int = 1 << 20) -> StateCache:
    return StateCache(path, "history-model", l1_bytes=l1, l2_bytes=l2, l3_bytes=1 << 26, state_type=HistoryState)


@pytest.fixture
def backend(tmp_path: Path) -> HistoryBackend:
    return HistoryBackend(history_cache(tmp_path / "states.sqlite3"))


@pytest.fixture
def app(backend: HistoryBackend) -> FastAPI:
    return make_app(settings_with(max_batch_items=8, max_tokens=64, max_prompt_tokens=200), backend)


@pytest.fixture
def client(app: FastAPI, backend: HistoryBackend) -> Iterator[TestClient]:
    with TestClient(app) as test_client:
        yield test_client
    backend.shutdown()


def native_chunks(response_text: str) -> tuple[list[dict], list[str]]:
    """(the JSON chunks, the raw payloads) of a native stream, checking it ends with [DONE]."""
    payloads = sse_payloads(response_text)
    assert payloads[-1] == "[DONE]", f"the stream must end with [DONE], got {payloads[-1]!r}"
    return [json.loads(p) for p in payloads[:-1]], payloads


def test_contents_on_v1_chat_completions_gives_one_choice_per_prompt_in_order(client: TestClient, backend: HistoryBackend) -> None:
    prompts = ["first prompt", "second", "third one here"]
    response = client.post("/v1/chat/completions", json={"contents": prompts, "max_tokens": 7})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"] == "rwkv7-batch" and body["object"] == "chat.completion" and body["model"] == "rwkv7"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for choice, prompt in zip(body["choices"], prompts, strict=True):
        assert choice["message"] == {"role": "assistant", "content": greedy_continuation(prompt, 7)}, f"prompt {prompt!r} was not used verbatim"
        assert choice["finish_reason"] == "length"
    assert len(backend.requests) == 3, "each prompt is its own generation request"


def test_native_defaults_map_onto_sampling_params(client: TestClient, backend: HistoryBackend) -> None:
    assert client.post("/v1/chat/completions", json={"contents": ["x"], "max_tokens": 1}).status_code == 200
    sampling = backend.requests[-1].sampling
    assert (sampling.temperature, sampling.top_k, sampling.top_p) == (1.0, 50, 0.6)
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.penalty_decay) == (2.0, 0.2, 0.996)
    assert sampling.stop == ("\nUser:",)
    client.post("/v2/chat/completions", json={"contents": ["x"], "max_tokens": 1, "alpha_presence": 0.5, "stop_tokens": ["END"]})
    v2 = backend.requests[-1].sampling
    assert (v2.top_k, v2.top_p, v2.presence_penalty, v2.frequency_penalty, v2.penalty_decay) == (500, 0.5, 0.5, 0.1, 0.99)
    assert v2.stop == ("END",)


def test_v2_reply_has_its_own_id(client: TestClient) -> None:
    body = client.post("/v2/chat/completions", json={"contents": ["abc"], "max_tokens": 3}).json()
    assert body["id"] == "rwkv7-batch-v2"
    assert body["choices"][0]["message"]["content"] == greedy_continuation("abc", 3)


def test_native_stream_flushes_chunk_size_tokens_per_row_and_reports_each_finish(client: TestClient) -> None:
    prompts = ["alpha", "beta"]
    with client.stream("POST", "/v1/chat/completions", json={"contents": prompts, "max_tokens": 10, "stream": True, "chunk_size": 4}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache" and response.headers["x-accel-buffering"] == "no"
        chunks, _ = native_chunks(response.read().decode())
    texts = {0: "", 1: ""}
    finishes: dict[int, str] = {}
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk"
        assert len(chunk["choices"]) >= 1, "a chunk holds only rows with news"
        for choice in chunk["choices"]:
            delta = choice["delta"]["content"]
            if choice["finish_reason"] is None:
                assert len(delta) == 4, f"row {choice['index']} flushed {len(delta)} tokens, expected chunk_size 4"
            else:
                finishes[choice["index"]] = choice["finish_reason"]
            texts[choice["index"]] += delta
    assert finishes == {0: "length", 1: "length"}
    assert texts == {i: greedy_continuation(p, 10) for i, p in enumerate(prompts)}


def test_big_batch_always_streams_and_uses_plain_temperature_sampling(client: TestClient, backend: HistoryBackend) -> None:
    response = client.post("/big_batch/completions", json={"contents": ["a", "b", "c"], "max_tokens": 5, "temperature": 0.7, "top_k": 3, "stream": False})
    chunks, _ = native_chunks(response.text)
    rows = {choice["index"] for chunk in chunks for choice in chunk["choices"]}
    assert rows == {0, 1, 2}
    sampling = backend.requests[-1].sampling
    assert sampling.temperature == 0.7 and sampling.top_k == 0 and sampling.top_p == 1.0, "only temperature applies"
    assert sampling.presence_penalty == 0.0 and sampling.frequency_penalty == 0.0


def test_fim_builds_the_fim_prompt_and_ignores_stop_strings(client: TestClient, backend: HistoryBackend) -> None:
    response = client.post("/FIM/v1/batch-FIM", json={"prefix": ["def f(", "x = "], "suffix": [")\n", "\n"], "max_tokens": 6, "stop_tokens": ["a"]})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "FIM.completion"
    expected_prompt = "✿prefix✿✿suffix✿)\n✿middle✿def f("
    assert backend.requests[0].prompt_tokens == [ord(ch) for ch in expected_prompt]
    assert body["choices"][0]["message"]["content"] == greedy_continuation(expected_prompt, 6)
    assert backend.requests[0].sampling.stop == (), "FIM stops only at end-of-text or max_tokens"


def test_fim_with_unequal_prefix_and_suffix_lists_is_400(client: TestClient) -> None:
    response = client.post("/FIM/v1/batch-FIM", json={"prefix": ["a", "b"], "suffix": ["c"]})
    assert response.status_code == 400
    assert "same length" in response.json()["error"]["message"]


def test_translate_is_greedy_with_the_language_prompt(client: TestClient, backend: HistoryBackend) -> None:
    response = client.post("/translate/v1/batch-translate", json={"source_lang": "auto", "target_lang": "ja", "text_list": ["hello", "你好"], "max_tokens": 5})
    assert response.status_code == 200, response.text
    translations = response.json()["translations"]
    assert [t["detected_source_lang"] for t in translations] == ["en", "zh-CN"]
    assert translations[0]["text"] == greedy_continuation("English: hello\n\nJapanese:", 5).strip()
    assert backend.requests[0].sampling.temperature == 0.0
    assert backend.requests[1].prompt_tokens == [ord(ch) for ch in "Chinese: 你好\n\nJapanese:"]


def test_batch_over_the_item_cap_is_400_naming_the_cap(client: TestClient) -> None:
    response = client.post("/v1/chat/completions", json={"contents": ["x"] * 9})
    assert response.status_code == 400
    assert "--max-batch-items" in response.json()["error"]["message"] and "8" in response.json()["error"]["message"]


def test_max_tokens_and_prompt_length_over_their_caps_are_400(client: TestClient) -> None:
    too_many = client.post("/v2/chat/completions", json={"contents": ["x"], "max_tokens": 65})
    assert too_many.status_code == 400 and "--max-tokens" in too_many.json()["error"]["message"]
    too_long = client.post("/v2/chat/completions", json={"contents": ["y" * 201], "max_tokens": 1})
    assert too_long.status_code == 400 and "--max-prompt-tokens" in too_long.json()["error"]["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -1), ("top_p", 2), ("max_tokens", -3), ("chunk_size", 0), ("contents", 5), ("stop_tokens", [""])],
)
def test_invalid_native_fields_are_422_naming_the_field(client: TestClient, field: str, value: object) -> None:
    response = client.post("/v2/chat/completions", json={"contents": ["x"], field: value})
    assert response.status_code == 422, response.text
    assert field in response.json()["error"]["message"]


def test_upstream_only_fields_are_accepted_and_ignored(client: TestClient, backend: HistoryBackend) -> None:
    plain = client.post("/v2/chat/completions", json={"contents": ["x"], "max_tokens": 2})
    extra = client.post("/v2/chat/completions", json={"contents": ["x"], "max_tokens": 2, "pad_zero": True, "noise": 1.5, "whatever": 1})
    assert plain.status_code == extra.status_code == 200, extra.text
    assert extra.json()["choices"] == plain.json()["choices"], "the extra fields changed the reply"
    without, with_extra = backend.requests[-2:]
    assert (with_extra.prompt_tokens, with_extra.sampling) == (without.prompt_tokens, without.sampling), "the extra fields reached the backend"


def test_an_empty_contents_list_is_400(client: TestClient) -> None:
    assert client.post("/v2/chat/completions", json={"contents": []}).status_code == 400


def test_no_model_loaded_is_503(backend: HistoryBackend) -> None:
    with TestClient(make_app(settings_with())) as client:
        assert client.post("/v2/chat/completions", json={"contents": ["x"]}).status_code == 503
    backend.shutdown()


def test_openai_native_chat_uses_lightning_defaults_and_prompt(client: TestClient, backend: HistoryBackend) -> None:
    body = {"system": "Be brief.", "messages": [{"role": "developer", "content": "No lists."}, {"role": "user", "content": "Hi there"}], "max_tokens": 6}
    response = client.post("/openai/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    reply = response.json()
    prompt = "System: Be brief.\nNo lists.\n\nUser: Hi there\n\nAssistant: <think>\n</think>\n"
    assert backend.requests[-1].prompt_tokens == [ord(ch) for ch in prompt]
    assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["content"] == greedy_continuation(prompt, 6)
    sampling = backend.requests[-1].sampling
    assert (sampling.top_k, sampling.top_p, sampling.presence_penalty, sampling.frequency_penalty) == (20, 0.6, 1.0, 0.1)
    assert sampling.stop == ("\nUser:",)
    assert backend.requests[-1].state is not None and backend.requests[-1].state.use_prefix_cache, "use_prefix_cache defaults to true"


def test_openai_native_chat_enable_think_and_prefix_cache_off(client: TestClient, backend: HistoryBackend) -> None:
    body = {"messages": [{"role": "user", "content": "Why?"}], "max_tokens": 2, "enable_think": True, "use_prefix_cache": False}
    assert client.post("/openai/v1/chat/completions", json=body).status_code == 200
    assert backend.decode(backend.requests[-1].prompt_tokens).endswith("User: Why?\n\nAssistant: <think")
    assert backend.requests[-1].state is None


def test_openai_native_chat_default_max_tokens_is_4096(client: TestClient) -> None:
    # The test server caps max_tokens at 64, so the route's default of 4096 is over the cap.
    response = client.post("/openai/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert response.status_code == 400 and "4096" in response.json()["error"]["message"]


def test_native_routes_require_the_password(tmp_path: Path) -> None:
    backend = HistoryBackend(history_cache(tmp_path / "pw.sqlite3"))
    app = make_app(settings_with(password="s3cret"), backend)
    paths = ["/v1/chat/completions", "/v2/chat/completions", "/big_batch/completions", "/FIM/v1/batch-FIM", "/translate/v1/batch-translate",
             "/openai/v1/chat/completions", "/state/chat/completions", "/multi_state/chat/completions", "/state/status", "/state/delete"]
    with TestClient(app) as client:
        for path in paths:
            assert client.post(path, json={"contents": ["x"]}).status_code == 401, f"{path} answered without the password"
            assert client.post(path, json={"contents": ["x"], "password": "wrong"}).status_code == 401, f"{path} took a wrong password"
        ok = client.post("/v2/chat/completions", json={"contents": ["x"], "max_tokens": 2, "password": "s3cret"})
        assert ok.status_code == 200, "the password in the body is accepted"
        ok = client.post("/state/status", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200, "the bearer header is accepted"
    backend.shutdown()


def test_leaving_a_native_stream_aborts_its_rows(tmp_path: Path) -> None:
    backend = HistoryBackend(history_cache(tmp_path / "abort.sqlite3"), step_delay_s=0.01)
    app = make_app(settings_with(max_tokens=64), backend)
    with TestClient(app) as client:
        with client.stream("POST", "/v2/chat/completions", json={"contents": ["a", "b"], "max_tokens": 60, "stream": True, "chunk_size": 1}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    break
    assert backend.aborted == 2, f"both rows should be aborted when the client leaves, {backend.aborted} were"
    backend.shutdown()
