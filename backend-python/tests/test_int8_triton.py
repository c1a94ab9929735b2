"""The W8A16 Triton tile kernel under Triton's CPU interpreter (a child process, since
TRITON_INTERPRET must be set before the kernel is decorated): every case matches the torch twin
(dequantize, then the product) on random inputs. On a GPU, test_int8_cuda.py runs it for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("int8_triton_interpreter.py")
TOLERANCE = {"fp32": 1e-5, "fp16": 2e-3}  # of the largest output; fp16 rounds the output once


@pytest.fixture(scope="module")
def cases() -> list[dict[str, object]]:
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"interpreter run failed:\n{done.stdout}\n{done.stderr[-4000:]}"
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_every_case_ran(cases: list[dict[str, object]]) -> None:
    assert len(cases) == 13, [c["name"] for c in cases]


def test_the_tile_kernel_matches_the_twin(cases: list[dict[str, object]]) -> None:
    for case in cases:
        if "exact" in case:
            continue
        assert case["shape"] == case["expected_shape"], case
        assert case["dtype"] == {"fp32": "torch.float32", "fp16": "torch.float16"}[str(case["act"])], case
        assert float(case["error"]) <= TOLERANCE[str(case["act"])], f"{case['name']}: error {case['error']:.2e}"


def test_the_dequantize_kernel_equals_the_twin_bit_for_bit(cases: list[dict[str, object]]) -> None:
    dequantized = [case for case in cases if "exact" in case]
    assert len(dequantized) == 4 and all(case["exact"] for case in dequantized), dequantized
