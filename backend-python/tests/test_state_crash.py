"""A real server process killed with SIGKILL in the middle of a burst of session turns leaves a
state database that opens cleanly. It holds every turn whose reply reached the client, and no row
that is partial or corrupt."""

from __future__ import annotations

import hashlib
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from albatross.state import SlotState
from ports import free_port
from runner.sessions import node_key, session_key

BACKEND_DIR = Path(__file__).resolve().parents[1]


def wait_until_serving(base_url: str, process: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited early with code {process.returncode}")
        try:
            if httpx.get(f"{base_url}/status", timeout=1.0).json().get("status") == 3:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.1)
    raise RuntimeError("the server did not load its model in time")


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_sigkill_during_a_burst_keeps_every_completed_turn_and_no_partial_one(tiny_checkpoint: Path, tmp_path: Path) -> None:
    db_path = tmp_path / "states.sqlite3"
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable, str(BACKEND_DIR / "main.py"), "--port", str(port), "--model-path", str(tiny_checkpoint),
        "--strategy", "albatross workers=1 batch=8", "--state-cache-path", str(db_path), "--log-level", "warning",
    ]
    log_file = (tmp_path / "server.log").open("wb")
    process = subprocess.Popen(command, cwd=BACKEND_DIR, env={**os.environ, "RWKV_V7_ON": "1"}, stdout=log_file, stderr=subprocess.STDOUT)
    completed_sessions: dict[str, int] = {}
    completed_nodes: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()
    workers: list[threading.Thread] = []

    def session_turns(session: str) -> None:
        with httpx.Client(base_url=base_url, timeout=30.0) as client:
            while not stop.is_set():
                try:
                    reply = client.post("/state/chat/completions", json={"session_id": session, "contents": ["User: go on\n\nAssistant:"], "max_tokens": 3, "temperature": 0})
                except httpx.HTTPError:
                    return  # the server is gone
                if reply.status_code == 200:
                    with lock:
                        completed_sessions[session] = completed_sessions.get(session, 0) + 1

    def dialogue_turns(session: str) -> None:
        node = 0
        with httpx.Client(base_url=base_url, timeout=30.0) as client:
            while not stop.is_set():
                try:
                    reply = client.post("/multi_state/chat/completions", json={"session_id": session, "dialogue_idx": node, "contents": ["next"], "max_tokens": 3, "temperature": 0})
                except httpx.HTTPError:
                    return
                if reply.status_code == 200:
                    node = reply.json()["dialogue_idx"]
                    with lock:
                        completed_nodes.append(node_key(session, node))

    try:
        wait_until_serving(base_url, process)
        workers += [threading.Thread(target=session_turns, args=(f"s{i}",)) for i in range(3)]
        workers += [threading.Thread(target=dialogue_turns, args=(f"tree{i}",)) for i in range(2)]
        for worker in workers:
            worker.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with lock:
                if sum(completed_sessions.values()) >= 6 and len(completed_nodes) >= 4:
                    break
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)  # in the middle of the burst: turns are in flight
        process.wait(timeout=10)
    finally:
        stop.set()
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        for worker in workers:
            worker.join(timeout=30)
        log_file.close()

    assert sum(completed_sessions.values()) >= 6 and len(completed_nodes) >= 4, f"the burst did not get going: {completed_sessions}, {completed_nodes}"
    with sqlite3.connect(db_path) as connection:
        assert connection.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        rows = {key: (payload, digest) for key, payload, digest in connection.execute("SELECT key, payload, checksum FROM states")}
    for key, (payload, digest) in rows.items():
        assert hashlib.sha256(payload).hexdigest() == digest, f"row {key!r} is partial or corrupt"
        SlotState.from_bytes(payload)  # decodes whole
    missing_sessions = sorted(session for session in completed_sessions if session_key(session) not in rows)
    assert missing_sessions == [], f"sessions with a completed turn but no saved state: {missing_sessions}"
    missing_nodes = sorted(node for node in completed_nodes if node not in rows)
    assert missing_nodes == [], f"dialogue nodes the client was given but the database lost: {missing_nodes}"
