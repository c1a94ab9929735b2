"""A real `redis-server` (Debian's package) on a free loopback port, for the state-store tests.

Without the binary the tests are skipped, except under CI (CI=true), where `.ci/run` installs it
and a missing server is a failure.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from ports import free_port

REDIS_SERVER = shutil.which("redis-server")


def require_redis_server() -> str:
    if REDIS_SERVER is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed (.ci/run installs Debian's redis-server)")
        pytest.skip("needs redis-server (apt-get install redis-server)")
    return REDIS_SERVER


class RedisServer:
    """Starts on construction; `stop()` (SIGKILL) and `start()` again keep the port and, through the
    append-only file with fsync on every write (the durable setting docs/state-cache.md asks for),
    the data: a Redis outage."""

    def __init__(self, directory: Path) -> None:
        self.binary = require_redis_server()
        self.directory = directory
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        log = (self.directory / "redis.log").open("ab")
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.directory)],
            stdout=log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}; see {self.directory / 'redis.log'}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as connection:
                    connection.sendall(b"PING\r\n")
                    if connection.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("redis-server did not answer PING")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None


@pytest.fixture
def redis_server(tmp_path: Path):
    server = RedisServer(tmp_path)
    yield server
    server.stop()
