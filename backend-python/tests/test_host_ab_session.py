"""bench/host_ab_gpu_session.sh and make_host_overlay.sh, run on the CPU with the simulated device:
each side is served from its own copy with its overlay laid over it, in the order asked, and each
run's table, JSON and server log come back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "backend-python" / "bench"


def _member(runs: tarfile.TarFile, name: str) -> bytes:
    member = runs.extractfile(f"./{name}")
    assert member is not None, name
    return member.read()


@pytest.mark.slow
def test_two_sides_are_served_in_turn_and_the_overlay_reaches_only_its_side(tmp_path: Path) -> None:
    overlay = tmp_path / "overlay"
    subprocess.run(["bash", str(BENCH / "make_host_overlay.sh"), str(overlay), "HEAD", "runner/jobs.py"], check=True, capture_output=True)
    jobs = overlay / "runner" / "jobs.py"
    committed = subprocess.run(["git", "show", "HEAD:backend-python/runner/jobs.py"], cwd=REPO, check=True, capture_output=True, text=True).stdout
    assert jobs.read_text() == committed
    # The overlay side's server says so in its log, when the route module is imported.
    jobs.write_text(committed + "\nimport logging as _logging\n_logging.getLogger(__name__).warning('the overlay side is serving')\n")
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # python3: this interpreter
        "OUT": str(out),
        "DEVICE_STEP": "simulated",
        "SERVER_ARGS": f"--simulated-step 36.7,5.2,26.9,40 --state-cache-path {tmp_path / 'states.sqlite3'}",
        "CONCURRENCY": "4",
        "MAX_TOKENS": "4",
        "WORDS": "20",
        "SIDES": f"other={overlay}",
        "ORDER": "tree other",
    }
    done = subprocess.run(["bash", str(BENCH / "host_ab_gpu_session.sh")], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = (out / "log.txt").read_text()
    assert "side other: 1 files from" in log and log.index("== run 1: side tree") < log.index("== run 2: side other"), log
    with tarfile.open(out / "runs.tgz") as runs:
        assert "the overlay side is serving" in _member(runs, "server_2_other.log").decode()
        assert "the overlay side is serving" not in _member(runs, "server_1_tree.log").decode()
        for name in ("run_1_tree.json", "run_2_other.json"):
            (level,) = json.loads(_member(runs, name))["levels"]
            assert (level["concurrency"], level["requests"], level["failed"], level["generated_tokens"]) == (4, 4, 0, 16), (name, level)
