"""The fused LoRA kernels (albatross/lora_triton.py) under Triton's CPU interpreter (a child
process, since TRITON_INTERPRET must be set before the kernels are decorated) match the eager
path (`loras.loras_torch`) on random inputs; on a GPU, test_lora_cuda.py runs them for real. The
dispatch keeps the eager path where the kernels do not apply."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from albatross import loras
from interpreter_cases import interpreter_cases

SCRIPT = Path(__file__).with_name("lora_triton_interpreter.py")
TOLERANCE = {"fp32": 1e-5, "fp16": 2e-3}  # of the largest output; fp16 rounds twice on the way


@pytest.fixture(scope="module")
def cases() -> list[dict[str, object]]:
    return interpreter_cases(SCRIPT)


def test_every_case_ran(cases: list[dict[str, object]]) -> None:
    assert len(cases) == 8, [case["name"] for case in cases]


def test_the_fused_loras_match_the_eager_path(cases: list[dict[str, object]]) -> None:
    for case in cases:
        assert case["lora_shape"] == case["want_lora_shape"] and case["gate_shape"] == case["want_gate_shape"], case
        expected = {"fp32": "torch.float32", "fp16": "torch.float16"}[str(case["act"])]
        assert case["dtypes"] == [expected, expected], case
        for part in ("lora_error", "gate_error", "decay_error"):
            assert float(case[part]) <= TOLERANCE[str(case["act"])], f"{case['name']}: {part} {case[part]:.2e}"


def test_the_eager_path_serves_where_the_kernels_do_not_apply() -> None:
    mixes = torch.randn(6, 2, 64, dtype=torch.float16)
    loras.set_fused_allowed(True)
    try:
        assert not loras.fused_applies(mixes), "a CPU tensor takes the eager path"
        if torch.cuda.is_available():
            gpu = mixes.cuda()
            assert loras.fused_applies(gpu)
            assert not loras.fused_applies(gpu.float()), "fp32 takes the eager path"
            assert not loras.fused_applies(torch.randn(6, 5, 64, dtype=torch.float16, device="cuda")), "so do more than 4 rows"
        loras.set_fused_allowed(False)
        assert not loras.fused_applies(mixes.cuda() if torch.cuda.is_available() else mixes), "switched off"
    finally:
        loras.set_fused_allowed(loras.FUSED_BY_DEFAULT)
