"""A client that sends its request slowly is cut off: headers and body each have --request-read-timeout.

The timeouts here are short so the tests finish quickly; what is asserted is the server's answer
(408 and a closed connection) and that others are still served, never how long anything took.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from runner_fakes import ScriptedBackend, live_server, make_app, settings_with

TIMEOUT_S = 0.5
HI = {"messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture
def base_url() -> Iterator[str]:
    settings = settings_with(request_read_timeout=TIMEOUT_S, password="pw")
    with live_server(make_app(settings, ScriptedBackend(["fine"])), settings) as url:
        yield url


def connect(base_url: str) -> socket.socket:
    address = urlsplit(base_url)
    return socket.create_connection((address.hostname, address.port), timeout=30)


def read_until_closed(conn: socket.socket) -> bytes:
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    return data


def assert_408_then_closed(reply: bytes, mentions: str) -> None:
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply
    error = json.loads(body)["error"]
    assert error["code"] == 408 and mentions in error["message"] and "--request-read-timeout" in error["message"], error


def assert_still_serving(base_url: str) -> None:
    reply = httpx.post(base_url + "/v1/chat/completions", json=HI, headers={"Authorization": "Bearer pw"})
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "fine"


def test_headers_that_never_complete_get_408_and_the_connection_closes(base_url: str) -> None:
    with connect(base_url) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Trickle: a")  # no password needed to do this
        assert_408_then_closed(read_until_closed(conn), "headers")
    assert_still_serving(base_url)


def test_a_connection_that_sends_nothing_is_closed(base_url: str) -> None:
    with connect(base_url) as conn:
        assert_408_then_closed(read_until_closed(conn), "headers")


def test_the_next_request_on_a_kept_alive_connection_has_the_same_deadline(base_url: str) -> None:
    with connect(base_url) as conn:
        conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        first = conn.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first
        conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Trickle: a")
        assert_408_then_closed(read_until_closed(conn), "headers")


def test_a_body_that_never_completes_gets_408_and_the_connection_closes(base_url: str) -> None:
    body = json.dumps({**HI, "password": "pw"}).encode()
    with connect(base_url) as conn:
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        conn.sendall(head.encode() + body[:10])
        assert_408_then_closed(read_until_closed(conn), "body")
    assert_still_serving(base_url)


def test_a_long_stream_is_not_cut_by_the_read_timeout() -> None:
    """The deadline is on reading the request, not on answering it."""
    settings = settings_with(request_read_timeout=TIMEOUT_S)
    backend = ScriptedBackend(["a", "b", "c", "d"], piece_delay_s=TIMEOUT_S)
    with live_server(make_app(settings, backend), settings) as url:
        reply = httpx.post(url + "/v1/chat/completions", json={**HI, "stream": True}, timeout=30)
        assert reply.status_code == 200 and reply.text.endswith("data: [DONE]\n\n")
        assert "".join(json.loads(line[6:])["choices"][0]["delta"].get("content", "") for line in reply.text.split("\n\n") if line.startswith("data: {")) == "abcd"
