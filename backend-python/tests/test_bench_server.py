"""bench/bench_server.py: the real server with a simulated device step, loaded by the HTTP
benchmark over loopback; the device report covers what the device did since the previous read."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

from ports import free_port
from server_process import wait_ready

BACKEND_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BACKEND_DIR / "bench"))

import albatross_api_benchmark as api_bench


def test_http_benchmark_against_the_simulated_device_reports_each_level(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable, str(BACKEND_DIR / "bench" / "bench_server.py"), "--device-step", "simulated", "--simulated-step", "5,5,10,10",
        "--port", str(port), "--model-path", "random:7.2b", "--strategy", "albatross workers=1 batch=8",
        "--state-cache-path", str(tmp_path / "states.sqlite3"), "--log-level", "warning",
    ]  # fmt: skip
    log = (tmp_path / "server.log").open("wb")
    process = subprocess.Popen(command, cwd=BACKEND_DIR, env={**os.environ, "RWKV_V7_ON": "1"}, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(process, url, tmp_path / "server.log")
        status = httpx.get(f"{url}/status").json()
        assert status["model"] == "random-2x64" and status["effective"]["device"] == "cpu"  # the simulated device's stand-in
        out = tmp_path / "api.json"
        api_bench.main(["--url", url, "--concurrency", "4,8", "--max-tokens", "6", "--prompt-words", "20", "--device-report", "--json", str(out)])
        levels = json.loads(out.read_text())["levels"]
        for level, concurrency in zip(levels, (4, 8)):
            assert level["failed"] == 0 and level["generated_tokens"] == 6 * concurrency
            (report,) = level["device_report"]
            # A mixed step (5 ms and 10 us a prompt token) brings each request's first token and
            # five 5 ms decode steps the rest, however the requests share steps: the level's time on
            # the device (all requests apart at most), not the server's life.
            assert 0.03 < report["busy_s"] < 0.04 * concurrency
        (after,) = api_bench.read_device_report(argparse.Namespace(url=url, password=None))
        assert after["busy_s"] == after["idle_s"] == 0, "a read covers only what came after the previous one"
    finally:
        process.terminate()
        process.wait(timeout=60)
        log.close()


def test_sync_debug_prints_each_distinct_waiting_stack_once() -> None:
    """--sync-debug: torch's warning for a call that waits on the GPU is printed with its stack,
    once per distinct stack; other warnings go their usual way."""
    import io
    import warnings

    import bench_server

    out = io.StringIO()
    with warnings.catch_warnings():  # puts back showwarning and the filters
        bench_server.log_synchronizing_calls(out)

        def waits() -> None:
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)

        for _ in range(3):
            waits()
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)  # another place
    printed = out.getvalue()
    assert printed.count("[sync-debug] called a synchronizing CUDA operation") == 2
    assert any(line.strip().endswith(" waits") and "test_bench_server.py" in line for line in printed.splitlines())
