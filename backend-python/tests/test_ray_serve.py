"""`python -m albatross_serve` on a local Ray cluster (started by the command, loopback only) with two
replicas of a tiny model and a real Redis: chat streams through Serve's proxy unchanged, load without
a session spreads over both replicas, a session id (header, or the body on the state routes) keeps a
session on one replica, and a session whose replica is SIGKILLed continues on the other exactly as an
uninterrupted session would. With one replica, every body-only state request has its session's
replica in the replica that got it, which serves it itself. Without a cluster: a forward bounds how
long it waits for a silent session's replica."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from redis_server import RedisServer, free_port

pytest.importorskip("ray.serve")

from albatross_serve.session_affinity import HEARTBEAT, Relayed, relay, run_forwarded  # after the skip: it imports ray

BACKEND_DIR = Path(__file__).resolve().parents[1]
TURNS = ["User: hello\n\nAssistant:", "User: and then?\n\nAssistant:", "User: one more\n\nAssistant:"]
READY_LINE = "replica(s) ready on"
HANG_S = 30.0  # a body-only turn takes well under a second: one that takes this long hangs


class ServeCluster:
    def __init__(self, checkpoint: Path, store_url: str, directory: Path, replicas: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = directory / "serve.log"
        command = [
            sys.executable, "-m", "albatross_serve", "--replicas", str(replicas), "--replica-cpus", "0.5", "--port", str(self.port),
            "--model-path", str(checkpoint), "--strategy", "albatross workers=1 batch=4", "--state-store", store_url, "--log-level", "warning",
        ]
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RWKV_V7_ON": "1"}
        with self.log_path.open("wb") as log:
            # Its own session: teardown can end every process Ray started for it, and nothing else.
            self.process = subprocess.Popen(command, cwd=BACKEND_DIR, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.client = httpx.Client(base_url=self.url, timeout=120.0)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 600
        while READY_LINE not in self.log_path.read_text(errors="replace"):
            assert self.process.poll() is None, f"albatross_serve exited with {self.process.returncode}:\n{self.log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "albatross_serve did not start its replicas"
            time.sleep(0.5)

    def pid(self, session_id: str | None = None) -> int:
        headers = {"X-Session-Id": session_id} if session_id else {}
        return int(self.client.get("/status", headers=headers).json()["pid"])

    def turn(self, session_id: str, prompt: str, header: bool = True) -> httpx.Response:
        headers = {"X-Session-Id": session_id} if header else {}
        timeout = httpx.USE_CLIENT_DEFAULT if header else HANG_S  # a body-only turn may be forwarded: fail fast on a hang
        return self.client.post("/state/chat/completions", json=turn_body(session_id, prompt), headers=headers, timeout=timeout)

    def streamed_text(self, session_id: str, prompt: str) -> str:
        """A body-only turn with `stream: true`: the text of its chunks."""
        body = {**turn_body(session_id, prompt), "stream": True}
        with self.client.stream("POST", "/state/chat/completions", json=body, timeout=HANG_S) as stream:
            assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream"), stream.read()
            payloads = [line[len("data: ") :] for line in stream.iter_lines() if line.startswith("data: ")]
        assert payloads[-1] == "[DONE]"
        return "".join(choice["delta"].get("content", "") for p in payloads[:-1] for choice in json.loads(p).get("choices", []))

    def saves(self, session_id: str) -> int:
        """The state cache saves of the replica of `session_id`."""
        status = self.client.get("/status", headers={"X-Session-Id": session_id}).json()
        return int(status["effective"]["state_cache"]["puts"])

    def text(self, session_id: str, prompt: str, header: bool = True) -> str:
        response = self.turn(session_id, prompt, header)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"]

    def close(self) -> None:
        self.client.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # whatever of its session is still there
        except ProcessLookupError:
            pass
        if self.process.poll() is None:
            self.process.wait(timeout=30)


def turn_body(session_id: str, prompt: str) -> dict[str, Any]:
    return {"session_id": session_id, "contents": [prompt], "max_tokens": 6, "temperature": 0}


def running_cluster(checkpoint: Path, directory: Path, replicas: int) -> Iterator[ServeCluster]:
    redis_server = RedisServer(directory)
    serve_cluster = ServeCluster(checkpoint, redis_server.url, directory, replicas)
    try:
        serve_cluster.wait_ready()
        yield serve_cluster
    finally:
        serve_cluster.close()
        redis_server.stop()


@pytest.fixture
def cluster(tiny_checkpoint: Path, tmp_path: Path) -> Iterator[ServeCluster]:
    yield from running_cluster(tiny_checkpoint, tmp_path, replicas=2)


@pytest.fixture
def one_replica(tiny_checkpoint: Path, tmp_path: Path) -> Iterator[ServeCluster]:
    yield from running_cluster(tiny_checkpoint, tmp_path, replicas=1)


def test_ray_serve_streams_spreads_load_keeps_sessions_and_survives_a_killed_replica(cluster: ServeCluster) -> None:
    client = cluster.client
    body = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 8, "temperature": 0}
    whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as stream:
        assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
        payloads = [line[len("data: ") :] for line in stream.iter_lines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks) and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == whole, "the stream through Serve carries the same text"

    assert len({cluster.pid() for _ in range(16)}) == 2, "requests without a session id reach both replicas"
    assert len({cluster.pid("sticky") for _ in range(6)}) == 1, "one session id, one replica"

    # The body's session_id alone brings the state routes to the session's replica: it saves every turn.
    before = cluster.saves("body-only")
    for prompt in TURNS:
        cluster.text("body-only", prompt, header=False)
    assert cluster.saves("body-only") - before == len(TURNS), "every body-only turn must reach the session's replica"

    reference = [cluster.text("reference", prompt) for prompt in TURNS]
    moved = [cluster.text("moved", TURNS[0]), cluster.text("moved", TURNS[1])]
    home = cluster.pid("moved")
    os.kill(home, signal.SIGKILL)
    deadline = time.monotonic() + 300
    while (response := cluster.turn("moved", TURNS[2])).status_code != 200:  # until Serve notices the death
        assert time.monotonic() < deadline, f"the session never continued: {response.status_code} {response.text}"
        time.sleep(0.5)
    moved.append(response.json()["choices"][0]["message"]["content"])
    assert moved == reference, "the session continued on the other replica must equal an uninterrupted one"
    assert cluster.pid("moved") != home


def test_body_only_turns_whose_session_lives_on_the_receiving_replica_are_served_there(one_replica: ServeCluster) -> None:
    # One replica: the router hands every body-only request back to the replica that got it. Relayed
    # through Ray to itself, such a reply lost its last message now and then and the request hung (a
    # few percent of turns); served where it is, every turn answers, the same as a header-routed one.
    reference = [one_replica.text("reference", prompt) for prompt in TURNS]
    sessions = [f"here-{n}" for n in range(16)]
    before = one_replica.saves(sessions[0])
    for session_id in sessions:
        assert [one_replica.text(session_id, prompt, header=False) for prompt in TURNS] == reference
    assert one_replica.saves(sessions[0]) - before == len(sessions) * len(TURNS), "every body-only turn saves its session's state"
    for n in range(8):
        assert [one_replica.streamed_text(f"streamed-{n}", prompt) for prompt in TURNS] == reference, "the same turns as a stream"


class InProcessForward:
    """`relay`'s view of a forward, with the session's replica in this process instead of behind a
    Ray handle: `messages` stands for what the handle delivers."""

    def __init__(self, messages: AsyncIterator[dict[str, Any]]) -> None:
        self.messages = messages
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self.messages

    def cancel(self) -> None:
        self.cancelled = True


async def silent_after(*messages: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """A session's replica that sends `messages`, then nothing, not even a heartbeat (its replica
    stuck, or Ray lost the call)."""
    for message in messages:
        yield message
    await asyncio.Event().wait()


async def relayed(forward: InProcessForward, silence_s: float) -> tuple[Relayed, list[dict[str, Any]]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:  # the client stays
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)

    outcome = await asyncio.wait_for(relay(forward, asyncio.get_running_loop().create_future(), receive, send, "s", silence_s=silence_s), 10)
    return outcome, sent


def test_a_forward_to_a_silent_replica_answers_503_instead_of_waiting_for_ever() -> None:
    forward = InProcessForward(silent_after())
    outcome, sent = asyncio.run(relayed(forward, silence_s=0.3))
    assert outcome is Relayed.ANSWERED and forward.cancelled, "the forward is given up, and cancelled on its replica"
    assert sent[0]["status"] == 503 and (b"content-type", b"application/json") in sent[0]["headers"]
    error = json.loads(sent[1]["body"])["error"]
    assert error["type"] == "service_unavailable" and "did not answer for 0.3 s" in error["message"] and not sent[1]["more_body"]


def test_a_stream_whose_replica_falls_silent_ends_with_an_error_event() -> None:
    start = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
    chunk = {"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True}
    outcome, sent = asyncio.run(relayed(InProcessForward(silent_after(start, chunk)), silence_s=0.3))
    assert outcome is Relayed.ANSWERED and sent[:2] == [start, chunk]
    assert sent[2]["body"].startswith(b'data: {"error":') and sent[2]["body"].endswith(b"data: [DONE]\n\n") and not sent[2]["more_body"]


def test_heartbeats_keep_a_slow_reply_alive_and_never_reach_the_client() -> None:
    # The session's replica's app answers after 1.5 s, three times the silence bound; its heartbeats
    # (every 0.05 s) keep the forward waiting, and the client gets the app's messages alone.
    async def slow_app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await asyncio.sleep(1.5)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    async def relay_slow_app() -> tuple[Relayed, list[dict[str, Any]], int]:
        heartbeats = 0

        async def home() -> AsyncIterator[dict[str, Any]]:
            nonlocal heartbeats
            scope = {"type": "http", "method": "POST", "path": "/state/chat/completions", "headers": []}
            async for message in run_forwarded(slow_app, scope, b"{}", heartbeat_s=0.05):
                heartbeats += message["type"] == HEARTBEAT
                yield message

        outcome, sent = await relayed(InProcessForward(home()), silence_s=0.5)
        return outcome, sent, heartbeats

    outcome, sent, heartbeats = asyncio.run(relay_slow_app())
    assert outcome is Relayed.ANSWERED and [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[1]["body"] == b"{}" and heartbeats >= 10
