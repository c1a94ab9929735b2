"""`python -m albatross_serve` on a local Ray cluster (started by the command, loopback only) with two
replicas of a tiny model and a real Redis: chat streams through Serve's proxy unchanged, load without
a session spreads over both replicas, a session id (header, or the body on the state routes) keeps a
session on one replica, and a session whose replica is SIGKILLed continues on the other exactly as an
uninterrupted session would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from redis_server import RedisServer, free_port

pytest.importorskip("ray.serve")

BACKEND_DIR = Path(__file__).resolve().parents[1]
TURNS = ["User: hello\n\nAssistant:", "User: and then?\n\nAssistant:", "User: one more\n\nAssistant:"]
READY_LINE = "replica(s) ready on"


class ServeCluster:
    def __init__(self, checkpoint: Path, store_url: str, directory: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = directory / "serve.log"
        command = [
            sys.executable, "-m", "albatross_serve", "--replicas", "2", "--replica-cpus", "0.5", "--port", str(self.port),
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
        body = {"session_id": session_id, "contents": [prompt], "max_tokens": 6, "temperature": 0}
        return self.client.post("/state/chat/completions", json=body, headers=headers)

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


@pytest.fixture
def cluster(tiny_checkpoint: Path, tmp_path: Path) -> Iterator[ServeCluster]:
    redis_server = RedisServer(tmp_path)
    serve_cluster = ServeCluster(tiny_checkpoint, redis_server.url, tmp_path)
    try:
        serve_cluster.wait_ready()
        yield serve_cluster
    finally:
        serve_cluster.close()
        redis_server.stop()


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
    def saves_at_home() -> int:
        status = client.get("/status", headers={"X-Session-Id": "body-only"}).json()
        return int(status["effective"]["state_cache"]["puts"])

    before = saves_at_home()
    for prompt in TURNS:
        cluster.text("body-only", prompt, header=False)
    assert saves_at_home() - before == len(TURNS), "every body-only turn must reach the session's replica"

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
