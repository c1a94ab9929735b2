"""Liveness, readiness and the graceful drain on SIGTERM: readiness goes false, new requests get 503
with Retry-After, running streams finish until --drain-timeout and are then ended with an error
event, and cached states are flushed before the process exits."""

from __future__ import annotations

import itertools
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from redis_server import free_port
from server_process import wait_ready
from runner.context import app_context
from runner.drain import DrainingServer
from runner.interface import GenerationRequest
from runner.model_manager import ModelStatus
from runner_fakes import ScriptedBackend, install_backend, make_app, settings_with

BACKEND_DIR = Path(__file__).resolve().parents[1]


class SickBackend(ScriptedBackend):
    def health(self) -> str | None:
        return "albatross worker(s) 0 stopped"


def test_readyz_is_ready_only_with_a_loaded_model_and_live_workers() -> None:
    app = make_app(settings_with())
    with TestClient(app) as client:
        missing = client.get("/readyz")
        assert missing.status_code == 503 and missing.json()["ready"] is False
        assert "no model" in missing.json()["error"]["message"] and missing.headers["retry-after"]
        assert client.get("/healthz").status_code == 200, "liveness does not need a model"
        install_backend(app, ScriptedBackend())
        assert client.get("/readyz").json() == {"ready": True, "status": 3}
        app_context(app).manager.status = ModelStatus.LOADING
        assert "loading" in client.get("/readyz").json()["error"]["message"]
        install_backend(app, SickBackend())
        sick = client.get("/readyz")
        assert sick.status_code == 503 and "worker(s) 0 stopped" in sick.json()["error"]["message"]


def pieces(request: GenerationRequest) -> Iterator[str]:
    """A prompt with "forever" never ends on its own (until max_tokens); others send ten pieces."""
    prompt = bytes(request.prompt_tokens).decode()
    return itertools.repeat("x") if "forever" in prompt else iter(["y"] * 10)


@pytest.fixture
def draining_server() -> Iterator[tuple[DrainingServer, str, ScriptedBackend]]:
    backend = ScriptedBackend(pieces, concurrent=True, piece_delay_s=0.05)
    app = make_app(settings_with(drain_timeout=5.0), backend)
    port = free_port()
    server = DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=5), app)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    yield server, f"http://127.0.0.1:{port}", backend
    server.should_exit = True
    thread.join(timeout=30)


def read_stream(url: str, prompt: str, into: list[str]) -> None:
    body = {"prompt": prompt, "max_tokens": 10000, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line:
                into.append(line)


def test_sigterm_refuses_new_requests_lets_running_ones_finish_and_ends_the_rest(draining_server) -> None:
    server, url, backend = draining_server
    finite: list[str] = []
    endless: list[str] = []
    readers = [threading.Thread(target=read_stream, args=(url, "short", finite)), threading.Thread(target=read_stream, args=(url, "forever", endless))]
    for reader in readers:
        reader.start()
    while not (finite and endless):  # both streams have started
        time.sleep(0.01)
    server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
    while httpx.get(f"{url}/readyz").status_code != 503:
        time.sleep(0.01)
    refused = httpx.post(f"{url}/v1/completions", json={"prompt": "new", "max_tokens": 2})
    assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
    assert "draining" in refused.json()["error"]["message"]
    assert httpx.get(f"{url}/healthz").status_code == 200, "liveness holds while draining"
    for reader in readers:
        reader.join(timeout=60)
    finite_payloads = [line[len("data: ") :] for line in finite]
    assert finite_payloads[-1] == "[DONE]" and not any('"error"' in p for p in finite_payloads), "a stream that ends in time ends normally"
    text = "".join(c["choices"][0]["text"] for c in map(json.loads, finite_payloads[:-1]))
    assert text == "y" * 10
    endless_payloads = [line[len("data: ") :] for line in endless]
    assert endless_payloads[-1] == "[DONE]"
    error = json.loads(endless_payloads[-2])["error"]
    assert error["code"] == 503 and "drain timeout" in error["message"]
    assert len(backend.aborted) == 1, "the ended stream's generation was aborted"
    while not server.should_exit:
        time.sleep(0.01)


def test_sigterm_on_a_real_server_flushes_the_prefix_cache_and_exits(tiny_checkpoint: Path, tmp_path: Path) -> None:
    db_path = tmp_path / "states.sqlite3"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable, str(BACKEND_DIR / "main.py"), "--port", str(port), "--model-path", str(tiny_checkpoint),
        "--strategy", "albatross workers=1 batch=4", "--state-cache-path", str(db_path), "--drain-timeout", "3", "--log-level", "warning",
    ]
    log = (tmp_path / "server.log").open("wb")
    process = subprocess.Popen(command, cwd=BACKEND_DIR, env={**os.environ, "RWKV_V7_ON": "1"}, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(process, url, tmp_path / "server.log")
        prompts = [f"User: question number {i} about the weather\n\nAssistant:" for i in range(3)]
        for prompt in prompts:
            reply = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}], "max_tokens": 2}, timeout=60)
            assert reply.status_code == 200, reply.text
        endless: list[str] = []
        reader = threading.Thread(target=lambda: _read_lines(f"{url}/v1/completions", endless))
        reader.start()
        while not endless:
            time.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        reader.join(timeout=60)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        log.close()
    assert process.returncode in (0, -signal.SIGTERM), f"exit status {process.returncode}"
    payloads = [line[len("data: ") :] for line in endless if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]" and "drain timeout" in payloads[-2], payloads[-3:]
    with sqlite3.connect(db_path) as connection:
        (prefix_rows,) = connection.execute("SELECT COUNT(*) FROM states WHERE key LIKE 'prefix:%'").fetchone()
    assert prefix_rows >= len(prompts), f"the prefix states of {len(prompts)} prompts should be on disk, found {prefix_rows}"


def _read_lines(url: str, into: list[str]) -> None:
    body = {"prompt": "once upon a time", "max_tokens": 16384, "temperature": 0, "stream": True}
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line:
                into.append(line)
