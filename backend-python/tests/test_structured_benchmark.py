"""bench/structured_benchmark.py end to end on a tiny CPU model: it builds its backend through
engine_benchmark's builder (whose knobs grow with the engine), so a run here keeps the GPU
session's script runnable, and its report counts what the runs did."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import structured_benchmark


def test_a_tiny_cpu_run_reports_every_fraction(tmp_path: Path) -> None:
    out = tmp_path / "structured.json"
    structured_benchmark.main([
        "--shape", "2x64", "--device", "cpu", "--batch", "4", "--max-tokens", "8", "--prompt-len", "4",
        "--fractions", "0,1", "--schemas", "2", "--json", str(out),
    ])  # fmt: skip
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["batch"] == 4
    free, constrained = report["runs"]
    for run in (free, constrained):
        # The schema cannot be completed within 8 tokens, so every request runs to its length.
        assert run["requests"] == 4 and run["generated_tokens"] == 4 * 8
        assert run["finish_reasons"] == {"length": 4}
    assert free["masked_samples"] == 0
    assert constrained["masked_samples"] == 4 * 8  # every token of every request sampled under its mask
    assert len(report["compile_ms"]) == 2 and all(ms > 0 for ms in report["compile_ms"])
