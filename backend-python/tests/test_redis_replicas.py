"""Two real server processes (replicas) of a tiny model on one real Redis: a session started on one
continues on the other after the first is SIGKILLed, exactly as an uninterrupted session would; a
session busy on one replica is 409 on the other; a dead replica's lock expires after its lease; a
Redis outage fails the state routes with 503 at once while plain completions keep working."""

from __future__ import annotations

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

BACKEND_DIR = Path(__file__).resolve().parents[1]
TURNS = ["User: hello\n\nAssistant:", "User: and then?\n\nAssistant:", "User: one more\n\nAssistant:"]
LEASE_S = 3.0


class Replica:
    def __init__(self, checkpoint: Path, store_url: str, directory: Path, name: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable, str(BACKEND_DIR / "main.py"), "--port", str(self.port), "--model-path", str(checkpoint),
            "--strategy", "albatross workers=1 batch=4", "--state-store", store_url, "--state-lock-lease", str(LEASE_S),
            "--state-cache-path", str(directory / f"{name}-unused.sqlite3"), "--log-level", "warning",
        ]
        self.log = (directory / f"{name}.log").open("wb")
        self.process = subprocess.Popen(command, cwd=BACKEND_DIR, env={**os.environ, "RWKV_V7_ON": "1"}, stdout=self.log, stderr=subprocess.STDOUT)
        self.client = httpx.Client(base_url=self.url, timeout=60.0)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"the replica exited with {self.process.returncode}"
            try:
                if self.client.get("/readyz").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("the replica did not become ready")

    def turn(self, session_id: str, prompt: str) -> httpx.Response:
        return self.client.post("/state/chat/completions", json={"session_id": session_id, "contents": [prompt], "max_tokens": 8, "temperature": 0})

    def text(self, session_id: str, prompt: str) -> str:
        response = self.turn(session_id, prompt)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"]

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def close(self) -> None:
        self.client.close()
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        self.log.close()


@pytest.fixture
def cluster(tiny_checkpoint: Path, tmp_path: Path) -> Iterator[tuple[RedisServer, Replica, Replica]]:
    redis_server = RedisServer(tmp_path)
    first = Replica(tiny_checkpoint, redis_server.url, tmp_path, "a")
    second = Replica(tiny_checkpoint, redis_server.url, tmp_path, "b")
    try:
        first.wait_ready()
        second.wait_ready()
        yield redis_server, first, second
    finally:
        first.close()
        second.close()
        redis_server.stop()


def test_two_replicas_share_sessions_locks_and_survive_a_killed_replica_and_a_redis_outage(cluster) -> None:
    redis_server, a, b = cluster
    # The reference: an uninterrupted session, every turn on one replica.
    reference = [b.text("reference", prompt) for prompt in TURNS]

    # A session started on A, whose replica then dies with a turn of another session in flight.
    moved = [a.text("moved", TURNS[0]), a.text("moved", TURNS[1])]
    root = a.client.post("/multi_state/chat/completions", json={"session_id": "tree", "dialogue_idx": 0, "contents": ["root"], "max_tokens": 4})
    assert root.status_code == 200 and root.json()["dialogue_idx"] == 1
    with a.client.stream("POST", "/state/chat/completions", json={"session_id": "held", "contents": ["x"], "max_tokens": 4000, "stream": True}) as busy:
        assert busy.status_code == 200
        lines = busy.iter_lines()  # kept: a discarded iterator closes the stream (an abort)
        next(lines)  # the turn runs on A and holds the session's lock
        refused = b.turn("held", "y")
        assert refused.status_code == 409, f"a session busy on one replica must be 409 on the other: {refused.text}"
        a.kill()
    moved.append(b.text("moved", TURNS[2]))
    assert moved == reference, "the session continued on B must equal an uninterrupted session"
    branched = b.client.post("/multi_state/chat/completions", json={"session_id": "tree", "dialogue_idx": 1, "contents": ["on B"], "max_tokens": 4})
    assert branched.status_code == 200 and branched.json()["dialogue_idx"] == 2, "a node made on A is usable on B, numbering goes on"

    # The dead replica's lock on "held" expires within its lease; until then B refuses the turn.
    deadline = time.monotonic() + LEASE_S + 30
    while (status := b.turn("held", "y").status_code) == 409:
        assert time.monotonic() < deadline, "the dead replica's lock never expired"
        time.sleep(0.2)
    assert status == 200

    # Redis goes away mid-run: state routes answer 503 at once, plain completions carry on.
    redis_server.stop()
    for path, body in [("/state/chat/completions", {"session_id": "moved", "contents": ["z"], "max_tokens": 2}),
                       ("/multi_state/chat/completions", {"session_id": "tree", "dialogue_idx": 1, "contents": ["z"], "max_tokens": 2}),
                       ("/state/status", {}), ("/state/delete", {"session_id": "moved"})]:
        response = b.client.post(path, json=body)
        assert response.status_code == 503, f"{path} without Redis: {response.status_code} {response.text}"
        assert "unreachable" in response.json()["error"]["message"]
    plain = b.client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
    assert plain.status_code == 200, plain.text
    chat = b.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat.status_code == 200, chat.text

    redis_server.start()  # back (its append-only file kept every acknowledged turn)
    assert b.text("moved", "User: still there?\n\nAssistant:") != ""
    listed = {s["session_id"] for s in b.client.post("/state/status").json()["sessions"]}
    assert {"moved", "reference", "held", "tree:1", "tree:2"} <= listed
