"""OpenAI chat and text completions through the runner's routes, on a scripted backend."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from runner.app import ROUTE_MODULES
from runner.context import register_native_batch_handler
from runner.interface import BackendError, SamplingDefaults
from runner.prompts import DEFAULT_CHAT_STOPS
from runner_fakes import ScriptedBackend, make_app, settings_with, sse_payloads


@pytest.fixture
def backend() -> ScriptedBackend:
    return ScriptedBackend(["Hel", "lo", " wor", "ld"])


@pytest.fixture
def client(backend: ScriptedBackend) -> Iterator[TestClient]:
    with TestClient(make_app(settings_with(max_tokens=1000, max_prompt_tokens=200, max_batch_items=6), backend)) as test_client:
        yield test_client


def chat(client: TestClient, **fields: object) -> dict:
    body = {"messages": [{"role": "user", "content": "Hi"}], **fields}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_reply_has_the_openai_shape_and_exact_usage(client: TestClient) -> None:
    reply = chat(client, model="my-label")
    assert reply["id"].startswith("chatcmpl-") and len(reply["id"]) == len("chatcmpl-") + 32
    assert reply["object"] == "chat.completion" and reply["model"] == "my-label"
    assert isinstance(reply["created"], int)
    assert reply["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello world"}, "logprobs": None, "finish_reason": "stop"}]
    prompt_tokens = len("User: Hi\n\nAssistant:".encode())
    assert reply["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 4, "total_tokens": prompt_tokens + 4}


def test_chat_prompt_follows_the_runner_template(client: TestClient, backend: ScriptedBackend) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Use English."},
        {"role": "user", "content": [{"type": "text", "text": "Name "}, {"type": "text", "text": "a colour"}]},
        {"role": "assistant", "content": "Red."},
        {"role": "tool", "content": "42"},
        {"role": "user", "content": "Another"},
    ]
    client.post("/chat/completions", json={"messages": messages})
    prompt = backend.decode(backend.requests[-1].prompt_tokens)
    assert prompt == (
        "System: Be brief.\n\nSystem: Use English.\n\nUser: Name a colour\n\nAssistant: Red.\n\n"
        "Observation: 42\n\nUser: Another\n\nAssistant:"
    )


def test_chat_uses_runner_defaults_and_default_stops_when_fields_are_left_out(client: TestClient, backend: ScriptedBackend) -> None:
    chat(client)
    sampling = backend.requests[-1].sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k) == (500, 1.0, 0.3, 0)
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.penalty_decay) == (0.0, 1.0, 0.996)
    # The scripted tokenizer has one token per byte: the names' first tokens are "U" and "A".
    assert sampling.stop == (*DEFAULT_CHAT_STOPS, "\n\nU")
    assert sampling.stop_token_ids == (0,)


def test_body_fields_override_update_config_which_overrides_backend_defaults(client: TestClient, backend: ScriptedBackend) -> None:
    backend.defaults = SamplingDefaults(top_p=0.5, top_k=7)
    assert client.post("/update-config", json={"top_p": 0.9, "temperature": 0.5}).status_code == 200
    chat(client, temperature=0.25, stop="END", stop_token_ids=[5, 6], max_completion_tokens=3, seed=11)
    sampling = backend.requests[-1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.25, 0.9, 7)
    assert sampling.stop == ("END", "\n\nU", "\n\nA") and sampling.stop_token_ids == (5, 6)
    assert (sampling.max_tokens, sampling.seed) == (3, 11)


def test_max_tokens_ends_a_choice_with_finish_reason_length(client: TestClient) -> None:
    reply = chat(client, max_tokens=2)
    assert reply["choices"][0]["message"]["content"] == "Hello"
    assert reply["choices"][0]["finish_reason"] == "length"


def test_completions_prompt_list_gives_one_choice_per_prompt_and_n_samples_use_seed_plus_i(client: TestClient, backend: ScriptedBackend) -> None:
    backend.script = lambda request: [f"seed={request.sampling.seed};", f"len={len(request.prompt_tokens)}"]
    response = client.post("/v1/completions", json={"prompt": ["ab", "abcd"], "n": 2, "seed": 100})
    assert response.status_code == 200, response.text
    reply = response.json()
    assert reply["object"] == "text_completion" and reply["id"].startswith("cmpl-")
    texts = [(c["index"], c["text"]) for c in reply["choices"]]
    assert texts == [(0, "seed=100;len=2"), (1, "seed=101;len=2"), (2, "seed=100;len=4"), (3, "seed=101;len=4")]
    assert reply["usage"]["prompt_tokens"] == 2 + 4, "n samples of one prompt share its prefill"
    assert reply["usage"]["completion_tokens"] == 8


def test_stream_sends_role_chunk_then_deltas_then_finish_then_usage_then_done(client: TestClient) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "stream_options": {"include_usage": True}, "model": "m"}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache" and response.headers["x-accel-buffering"] == "no"
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "m" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"].get("content") for c in chunks[1:5]]
    assert deltas == ["Hel", "lo", " wor", "ld"]
    assert chunks[5]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert chunks[6]["choices"] == [] and chunks[6]["usage"]["completion_tokens"] == 4
    assert len(chunks) == 7


def test_text_stream_chunks_carry_text_and_a_final_finish_reason(client: TestClient) -> None:
    response = client.post("/completions", json={"prompt": "x", "stream": True, "max_tokens": 3})
    chunks = [json.loads(p) for p in sse_payloads(response.text)[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == ["Hel", "lo", " wor", ""]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert all(c["object"] == "text_completion" for c in chunks)


def test_stream_chunks_escape_text_as_json(client: TestClient, backend: ScriptedBackend) -> None:
    tricky = ['quote " and \\ back', "new\nline", "汉字 ✿"]
    backend.script = lambda request: tricky
    response = client.post("/v1/completions", json={"prompt": "x", "stream": True})
    texts = [json.loads(p)["choices"][0]["text"] for p in sse_payloads(response.text)[:-1]]
    assert texts[:3] == tricky


def test_an_error_after_the_stream_started_is_an_error_event_then_done(client: TestClient, backend: ScriptedBackend) -> None:
    backend.fail_after_pieces = 2
    response = client.post("/v1/completions", json={"prompt": "x", "stream": True})
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])["error"]
    assert error["code"] == 500 and "scripted failure" in error["message"]


def test_a_backend_refusal_before_the_first_event_is_an_http_status_even_when_streaming(backend: ScriptedBackend) -> None:
    backend.fail_before_start = BackendError(400, "states are not supported")
    with TestClient(make_app(backend=backend)) as client:
        for stream in (False, True):
            response = client.post("/v1/completions", json={"prompt": "x", "stream": stream})
            assert response.status_code == 400, (stream, response.text)
            assert response.json()["error"]["message"] == "states are not supported"


def test_a_failed_generation_without_stream_is_a_500_json_error(client: TestClient, backend: ScriptedBackend) -> None:
    backend.fail_after_pieces = 1
    response = client.post("/v1/completions", json={"prompt": "x"})
    assert response.status_code == 500 and "scripted failure" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": {"name": "f"}}, "function_call"),
    ],
)
def test_known_but_unsupported_fields_are_refused_with_the_field_named(client: TestClient, fields: dict, named: str) -> None:
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == named and named in response.json()["error"]["message"]


def test_harmless_openai_fields_and_unknown_fields_are_accepted(client: TestClient) -> None:
    reply = chat(client, response_format={"type": "text"}, tool_choice="none", user="u1", some_future_field={"x": 1}, logprobs=False)
    assert reply["choices"][0]["message"]["content"] == "Hello world"


def test_max_tokens_above_the_cap_is_400_naming_the_cap(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1001})
    assert response.status_code == 400
    assert "1000" in response.json()["error"]["message"] and "--max-tokens" in response.json()["error"]["message"]


def test_a_prompt_over_the_token_cap_is_400_naming_the_cap(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"prompt": "y" * 201})
    assert response.status_code == 400
    assert "200" in response.json()["error"]["message"] and "--max-prompt-tokens" in response.json()["error"]["message"]


def test_more_choices_than_the_batch_cap_is_400(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"prompt": ["a", "b"], "n": 4})
    assert response.status_code == 400 and "--max-batch-items" in response.json()["error"]["message"]


def test_no_model_loaded_is_503() -> None:
    with TestClient(make_app()) as client:
        response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"


def test_contents_without_messages_needs_the_native_handler(backend: ScriptedBackend) -> None:
    without_native = [m for m in ROUTE_MODULES if m != "runner.routes.native"]
    with TestClient(make_app(backend=backend, route_modules=without_native)) as client:
        response = client.post("/v1/chat/completions", json={"contents": ["Hi"]})
    assert response.status_code == 400 and "native" in response.json()["error"]["message"]


def test_contents_without_messages_goes_to_the_registered_native_handler(backend: ScriptedBackend) -> None:
    from fastapi.responses import JSONResponse

    app = make_app(backend=backend, route_modules=[m for m in ROUTE_MODULES if m != "runner.routes.native"])
    seen: list[dict] = []

    async def native(request: object, payload: dict) -> JSONResponse:
        seen.append(payload)
        return JSONResponse({"id": "rwkv7-batch"})

    register_native_batch_handler(app, native)
    with TestClient(app) as client:
        assert client.post("/v1/chat/completions", json={"contents": ["a", "b"]}).json() == {"id": "rwkv7-batch"}
        chat(client)  # messages still go to the OpenAI route
    assert seen == [{"contents": ["a", "b"]}]


def test_a_classic_backend_serves_requests_one_at_a_time_and_a_concurrent_one_at_once() -> None:
    import asyncio

    import httpx

    async def run(backend: ScriptedBackend) -> int:
        app = make_app(backend=backend)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            replies = await asyncio.gather(*(http.post("/v1/completions", json={"prompt": "x"}) for _ in range(3)))
        assert all(r.status_code == 200 for r in replies)
        return backend.max_active

    assert asyncio.run(run(ScriptedBackend(["a", "b", "c"], piece_delay_s=0.001))) == 1
    assert asyncio.run(run(ScriptedBackend(["a", "b", "c"], piece_delay_s=0.001, concurrent=True))) == 3


def test_n_choices_on_a_concurrent_backend_run_together_and_keep_their_indices() -> None:
    backend = ScriptedBackend(lambda r: [f"s{r.sampling.seed}", "!"], concurrent=True, piece_delay_s=0.001)
    with TestClient(make_app(backend=backend)) as client:
        response = client.post("/v1/completions", json={"prompt": "x", "n": 3, "seed": 5, "stream": True})
    chunks = [json.loads(p) for p in sse_payloads(response.text)[:-1]]
    text_by_index: dict[int, str] = {}
    for chunk in chunks:
        choice = chunk["choices"][0]
        text_by_index[choice["index"]] = text_by_index.get(choice["index"], "") + choice["text"]
    assert text_by_index == {0: "s5!", 1: "s6!", 2: "s7!"}
    assert backend.max_active == 3


def test_a_client_that_leaves_a_stream_aborts_its_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    import httpx

    from runner_fakes import live_server

    monkeypatch.setenv("ALBATROSS_DISCONNECT_CHECK_INTERVAL", "4")
    backend = ScriptedBackend([f"t{i} " for i in range(100_000)], piece_delay_s=0.001)
    with live_server(make_app(settings_with(max_tokens=200_000), backend)) as base_url:
        with httpx.stream("POST", base_url + "/v1/completions", json={"prompt": "x", "stream": True, "max_tokens": 100_000}) as response:
            lines = response.iter_lines()
            received = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in received)
        for _ in range(1000):  # wait for the server to notice; the bound only guards a hang
            if backend.aborted:
                break
            time.sleep(0.01)
    assert len(backend.aborted) == 1 and not backend.finished, "the backend iterator must be closed (aborted) when the client leaves"
    assert backend.active == 0


def test_an_unexpected_failure_is_a_500_whose_request_id_matches_the_log(caplog: pytest.LogCaptureFixture) -> None:
    backend = ScriptedBackend()

    def broken_encode(text: str) -> list[int]:
        raise RuntimeError("tokenizer exploded")

    backend.encode = broken_encode  # type: ignore[method-assign]
    with TestClient(make_app(backend=backend), raise_server_exceptions=False) as client:
        response = client.post("/v1/completions", json={"prompt": "x"})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and "tokenizer exploded" not in error["message"]
    logged = [r for r in caplog.records if error["request_id"] in r.getMessage()]
    assert logged and logged[0].exc_info is not None, "the traceback is logged under the request id"
