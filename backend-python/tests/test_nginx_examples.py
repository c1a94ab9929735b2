"""The nginx examples are complete configurations nginx accepts as they are, and behind them an
oversized body gets the API's JSON 413. Needs Debian's nginx (.ci/run installs it); skipped without."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ports import free_port
from runner_fakes import ScriptedBackend, live_server, make_app, settings_with

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy-examples"
CONFIGS = sorted(EXAMPLES.glob("nginx-*.conf"))
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
pytestmark = pytest.mark.skipif(NGINX is None, reason="needs nginx (apt-get install nginx)")


def nginx(prefix: Path, config: Path, *args: str) -> list[str]:
    assert NGINX is not None
    return [NGINX, "-c", str(config), "-p", str(prefix), "-g", f"pid {prefix}/nginx.pid; error_log {prefix}/error.log;", *args]


def test_there_are_nginx_examples() -> None:
    assert {c.name for c in CONFIGS} >= {"nginx-sse.conf", "nginx-multi-replica.conf"}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_nginx_accepts_each_example_as_it_is(config: Path, tmp_path: Path) -> None:
    result = subprocess.run(nginx(tmp_path, config, "-t"), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.fixture
def proxied(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """(nginx URL, server URL): the example with its upstreams pointed at a live test server."""
    app = make_app(settings_with(max_body_bytes=8 * 1024 * 1024), ScriptedBackend(["fine"]))
    with live_server(app) as server_url:
        port = free_port()
        text = request.param.read_text()
        text = re.sub(r"server \d+\.\d+\.\d+\.\d+:\d+;", f"server {server_url.removeprefix('http://')};", text)
        text = text.replace("listen 80;", f"listen 127.0.0.1:{port};")
        config = tmp_path / request.param.name
        config.write_text(text)
        process = subprocess.Popen(nginx(tmp_path, config, "-g", "daemon off;"), stderr=subprocess.PIPE)
        try:
            url = f"http://127.0.0.1:{port}"
            for _ in range(500):
                try:
                    httpx.get(url + "/healthz", timeout=1)
                    break
                except httpx.TransportError:
                    assert process.poll() is None, process.stderr.read() if process.stderr else ""
                    time.sleep(0.02)
            yield url, server_url
        finally:
            process.terminate()
            process.wait(timeout=30)


@pytest.mark.parametrize("proxied", CONFIGS, ids=lambda c: c.name, indirect=True)
def test_through_nginx_an_oversized_body_gets_the_apis_json_413(proxied: tuple[str, str]) -> None:
    url, _ = proxied
    ok = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]}, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "fine"
    big = httpx.post(url + "/v1/chat/completions", content=b'{"prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}', headers={"Content-Type": "application/json"}, timeout=60)
    assert big.status_code == 413
    assert big.headers["content-type"].startswith("application/json"), big.text[:200]
    error = big.json()["error"]
    assert (error["code"], error["type"]) == (413, "request_too_large") and "client_max_body_size" in error["message"]
