"""Starting the server: what can be checked before loading anything fails at once, in one line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from ports import free_port

MAIN = Path(__file__).resolve().parents[1] / "main.py"


def run_main(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RWKV_STATE_CACHE_PATH": os.devnull}
    return subprocess.run([sys.executable, str(MAIN), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=MAIN.parent)


def test_a_missing_model_file_is_one_clear_line(tmp_path: Path) -> None:
    result = run_main("--model-path", str(tmp_path / "absent.pth"), "--port", str(free_port()))
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "model file not found" in lines[0] and "--model-path" in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_an_unknown_strategy_is_one_clear_line(tiny_checkpoint: Path) -> None:
    result = run_main("--model-path", str(tiny_checkpoint), "--strategy", "quantum x9", "--port", str(free_port()))
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0 and len(lines) == 1 and "--strategy" in lines[0] and "quantum" in lines[0], result.stderr


def test_a_busy_port_is_reported_before_the_model_loads(tiny_checkpoint: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_main("--model-path", str(tiny_checkpoint), "--strategy", "cpu fp32", "--port", str(port))
    assert result.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr, result.stderr
    assert "loading" not in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_help_shows_every_default() -> None:
    text = run_main("--help").stdout
    for shown in ("(default: 8000)", "(default: 127.0.0.1)", "(default: 4MiB)", "(default: 30.0)", "(default: text)", "(default: off)", "(default: none)"):
        assert shown in " ".join(text.split()), f"{shown} missing from --help"
