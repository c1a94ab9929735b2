"""A server the tests start as a child process (main.py, bench/bench_server.py): waiting for it."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx


def wait_ready(process: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float = 120) -> None:
    """Until `url`/readyz answers 200; fails with the server's log when it exits or takes too long."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None and time.monotonic() < deadline, f"the server did not become ready:\n{log.read_text()[-4000:]}"
        try:
            if httpx.get(f"{url}/readyz").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
