"""Runs one of the scripts that check our Triton kernels under Triton's CPU interpreter
(`*_interpreter.py`) in a child process, since TRITON_INTERPRET must be set before the kernels
are decorated, and returns the JSON line it printed for each case."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def interpreter_cases(script: Path, timeout_s: float = 600) -> list[dict[str, Any]]:
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    assert done.returncode == 0, f"interpreter run of {script.name} failed:\n{done.stdout}\n{done.stderr[-4000:]}"
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
