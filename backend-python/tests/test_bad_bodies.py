"""Bad request bodies get a 4xx JSON error naming the problem, and the server keeps serving."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi.testclient import TestClient

from runner_fakes import ScriptedBackend, live_server, make_app, settings_with

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(make_app(backend=ScriptedBackend(["fine"]))) as test_client:
        yield test_client


def assert_error(response: httpx.Response, status: int, mentions: str) -> None:
    assert response.status_code == status, f"expected {status}, got {response.status_code}: {response.text}"
    error = response.json()["error"]
    assert mentions in error["message"], f"{mentions!r} not named in {error['message']!r}"
    assert error["code"] == status


def assert_still_serving(client: TestClient) -> None:
    reply = client.post(CHAT, json={"messages": HI})
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "fine"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": HI, "max_tokens": -1}, "max_tokens"),
        ({"messages": HI, "max_tokens": "many"}, "max_tokens"),
        ({"messages": HI, "top_p": 2}, "top_p"),
        ({"messages": HI, "temperature": -0.5}, "temperature"),
        ({"messages": HI, "top_k": -3}, "top_k"),
        ({"messages": HI, "n": 0}, "n"),
        ({"messages": HI, "stream": {"yes": True}}, "stream"),
        ({"messages": HI, "stop": 7}, "stop"),
        ({"messages": []}, "messages"),
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"content": "x"}]}, "messages.0.role"),
    ],
)
def test_invalid_chat_fields_are_422_naming_the_field(client: TestClient, body: dict, field: str) -> None:
    response = client.post(CHAT, json=body)
    assert_error(response, 422, field)
    assert_still_serving(client)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": 5}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "penalty_decay": 1.5}, "penalty_decay"),
        ({"prompt": "x", "stop": ""}, "stop"),
        ({"prompt": "x", "logprobs": 9}, "logprobs"),
    ],
)
def test_invalid_completion_fields_are_422_naming_the_field(client: TestClient, body: dict, field: str) -> None:
    assert_error(client.post("/v1/completions", json=body), 422, field)


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b"\xff\xfe", b"null"])
def test_a_body_that_is_not_a_json_object_is_400(client: TestClient, raw: bytes) -> None:
    response = client.post(CHAT, content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert_still_serving(client)


def test_update_config_and_switch_model_validate_their_fields(client: TestClient) -> None:
    assert_error(client.post("/update-config", json={"top_p": 3}), 422, "top_p")
    assert_error(client.post("/switch-model", json={"strategy": "cpu fp32"}), 422, "model")
    assert_error(client.post("/switch-model", json={"model": "x.gguf", "strategy": "cpu fp32"}), 400, ".gguf")


def test_an_unknown_route_is_a_404_json_error(client: TestClient) -> None:
    response = client.get("/no/such/route")
    assert response.status_code == 404 and response.json()["error"]["code"] == 404


def read_http_reply(conn: socket.socket) -> str:
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return (head + b"\r\n\r\n" + body).decode()


def test_a_declared_10_mb_body_is_refused_before_it_is_read() -> None:
    """The server answers 413 after the headers, while the client has sent none of the body."""
    app = make_app(settings_with(max_body_bytes=4 * 1024 * 1024), ScriptedBackend(["fine"]))
    with live_server(app) as base_url:
        address = urlsplit(base_url)
        with socket.create_connection((address.hostname, address.port), timeout=10) as conn:
            head = f"POST {CHAT} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: {10 * 1024 * 1024}\r\n\r\n"
            conn.sendall(head.encode())
            reply = read_http_reply(conn)
        status_line, _, rest = reply.partition("\r\n")
        assert " 413 " in status_line, reply
        body = json.loads(rest.split("\r\n\r\n", 1)[1])
        assert "--max-body-bytes" in body["error"]["message"]
        assert httpx.post(base_url + CHAT, json={"messages": HI}).status_code == 200


def test_a_streamed_10_mb_body_without_length_is_cut_off_at_the_limit() -> None:
    app = make_app(settings_with(max_body_bytes=4 * 1024 * 1024), ScriptedBackend(["fine"]))
    sent = 0

    def chunks() -> Iterator[bytes]:
        nonlocal sent
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(10):
            sent += 1024 * 1024
            yield b"a" * (1024 * 1024)
        yield b'"}]}'

    with live_server(app) as base_url:
        try:
            response = httpx.post(base_url + CHAT, content=chunks(), headers={"Content-Type": "application/json"}, timeout=30)
            assert response.status_code == 413, response.text
            assert "--max-body-bytes" in response.json()["error"]["message"]
        except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError):
            pass  # the server may close the connection while the client is still writing: also a refusal
        assert httpx.post(base_url + CHAT, json={"messages": HI}).status_code == 200


# Numeric ranges and stop-string caps: refused at the route, before anything reaches a backend.

NATIVE_ROUTES = ("/v2/chat/completions", "/big_batch/completions", "/state/chat/completions")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", 2**63),
        ("top_k", 2**31),
        ("presence_penalty", 1e308),
        ("frequency_penalty", -1e30),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("stop_token_ids", [2**40]),
        ("stop_token_ids", [-1]),
    ],
)
def test_out_of_range_numbers_are_422_naming_the_field(client: TestClient, field: str, value: object) -> None:
    for route, body in ((CHAT, {"messages": HI}), ("/v1/completions", {"prompt": "x"})):
        assert_error(client.post(route, json={**body, field: value}), 422, field)
    assert_still_serving(client)


@pytest.mark.parametrize(("field", "value"), [("top_k", 2**63), ("alpha_presence", 1e300), ("alpha_frequency", -1e300)])
def test_out_of_range_native_numbers_are_422_naming_the_field(client: TestClient, field: str, value: object) -> None:
    for route in (CHAT, *NATIVE_ROUTES):
        body = {"contents": ["hi"], "session_id": "s", field: value}
        assert_error(client.post(route, json=body), 422, field)
    assert_still_serving(client)


def test_dialogue_index_beyond_64_bits_is_422(client: TestClient) -> None:
    body = {"contents": ["hi"], "session_id": "s", "dialogue_idx": 2**64}
    assert_error(client.post("/multi_state/chat/completions", json=body), 422, "dialogue_idx")


def test_too_many_or_too_long_stop_strings_are_400_naming_the_limit(client: TestClient) -> None:
    from runner.limits import MAX_STOP_LENGTH, MAX_STOP_STRINGS

    many = [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]
    long = "x" * (MAX_STOP_LENGTH + 1)
    for route, field, body in (
        (CHAT, "stop", {"messages": HI}),
        ("/v1/completions", "stop", {"prompt": "x"}),
        ("/openai/v1/chat/completions", "stop", {"messages": HI}),
        (CHAT, "stop_tokens", {"contents": ["hi"]}),
        ("/v2/chat/completions", "stop_tokens", {"contents": ["hi"]}),
        ("/big_batch/completions", "stop_tokens", {"contents": ["hi"]}),
        ("/state/chat/completions", "stop_tokens", {"contents": ["hi"], "session_id": "s"}),
    ):
        too_many = client.post(route, json={**body, field: many})
        assert_error(too_many, 400, f"at most {MAX_STOP_STRINGS} stop strings")
        assert too_many.json()["error"]["param"] == field
        assert_error(client.post(route, json={**body, field: long}), 400, f"{MAX_STOP_LENGTH} characters")
        assert_error(client.post(route, json={**body, field: [long]}), 400, f"{MAX_STOP_LENGTH} characters")
    assert_still_serving(client)


def test_a_one_megabyte_native_stop_string_is_refused_without_growing_the_server(client: TestClient) -> None:
    """It took the server to 18.8 GB (every prefix of the stop was stored)."""
    reply = client.post("/v2/chat/completions", json={"contents": ["hi"], "stop_tokens": ["y" * (1024 * 1024)]})
    assert_error(reply, 400, "stop_tokens")
    assert_still_serving(client)


def test_too_many_stop_token_ids_are_400_naming_the_limit(client: TestClient) -> None:
    from runner.limits import MAX_STOP_TOKEN_IDS

    reply = client.post(CHAT, json={"messages": HI, "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))})
    assert_error(reply, 400, f"at most {MAX_STOP_TOKEN_IDS}")


def test_a_refused_update_config_leaves_the_defaults_as_they_were(client: TestClient) -> None:
    """`{"top_k": 2**63}` used to answer "success" and fail every later request without a top_k."""
    manager = client.app.state.context.manager  # type: ignore[attr-defined]
    before = manager.config_overrides
    for bad in ({"top_k": 2**63}, {"presence_penalty": 1e308}, {"temperature": float("nan")}, {"max_tokens": 2**70}):
        response = client.post("/update-config", content=json.dumps(bad), headers={"Content-Type": "application/json"})
        assert response.status_code in (400, 422), f"{bad}: {response.status_code} {response.text}"
        assert response.json()["error"]["param"] == next(iter(bad))
    assert manager.config_overrides == before
    assert_still_serving(client)


# Hostile JSON: answered 400 before the password is checked, without a traceback in the log.

POST_PATHS = (CHAT, "/v1/completions", "/v2/chat/completions", "/state/delete", "/switch-model", "/update-config", "/no/such/route")


@pytest.fixture
def guarded_client() -> Iterator[TestClient]:
    with TestClient(make_app(settings_with(password="pw"), ScriptedBackend(["fine"])), raise_server_exceptions=False) as test_client:
        yield test_client


@pytest.mark.parametrize("opener", ["[", '{"a":'])
def test_a_body_nested_100000_deep_is_400_before_auth_without_a_traceback(guarded_client: TestClient, opener: str, caplog: pytest.LogCaptureFixture) -> None:
    closer = "]" if opener == "[" else "}"
    deep = opener * 100_000 + "1" + closer * 100_000
    for path in POST_PATHS:
        response = guarded_client.post(path, content=deep, headers={"Content-Type": "application/json"})
        assert_error(response, 400, "nested too deeply")
    assert not [r for r in caplog.records if r.levelno >= 40], [r.getMessage() for r in caplog.records if r.levelno >= 40]
    ok = guarded_client.post(CHAT, json={"messages": HI}, headers={"Authorization": "Bearer pw"})
    assert ok.status_code == 200


def test_a_body_nested_deep_but_parseable_is_an_ordinary_answer(client: TestClient) -> None:
    nested: object = 1
    for _ in range(500):
        nested = [nested]
    response = client.post(CHAT, json={"messages": HI, "metadata": nested})  # an unknown field: ignored
    assert response.status_code == 200, response.text
    assert_error(client.post(CHAT, json={"messages": HI, "tools": [nested]}), 422, "tools")


LONE = '"\\ud800"'  # a JSON escape of half a surrogate pair: no character, not encodable as UTF-8


@pytest.mark.parametrize(
    ("path", "raw", "field"),
    [
        (CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "model": ' + LONE + "}", "model"),
        ("/v1/completions", '{"prompt": "x", "model": ' + LONE + "}", "model"),
        ("/v1/completions", '{"prompt": ' + LONE + "}", "prompt"),
        (CHAT, '{"messages": [{"role": "user", "content": ' + LONE + "}]}", "messages.0.content"),
        (CHAT, '{"contents": ["hi"], "model": ' + LONE + "}", "model"),
        ("/v2/chat/completions", '{"contents": ["hi"], "model": ' + LONE + "}", "model"),
        ("/translate/v1/batch-translate", '{"target_lang": "en", "text_list": ["x"], "source_lang": ' + LONE + "}", "source_lang"),
        ("/state/delete", '{"session_id": ' + LONE + "}", "session_id"),
        ("/switch-model", '{"model": ' + LONE + ', "strategy": "fake"}', "model"),
        (CHAT, '{"messages": [{"role": "user", "content": "Hi"}], ' + LONE + ": 1}", "\\ud800"),
    ],
)
def test_a_lone_surrogate_is_400_naming_the_field(client: TestClient, path: str, raw: str, field: str) -> None:
    response = client.post(path, content=raw.encode(), headers={"Content-Type": "application/json"})
    assert_error(response, 400, "surrogate")
    assert response.json()["error"]["param"] == field
    assert_still_serving(client)


def test_a_surrogate_pair_is_an_ordinary_character(client: TestClient) -> None:
    raw = '{"messages": [{"role": "user", "content": "Hi"}], "model": "\\ud83d\\ude00"}'
    response = client.post(CHAT, content=raw.encode(), headers={"Content-Type": "application/json"})
    assert response.status_code == 200 and response.json()["model"] == "\U0001f600"
