"""The one-launch decode WKV step (albatross/wkv_decode_triton.py) under Triton's CPU interpreter
(a child process, since TRITON_INTERPRET must be set before the kernel is decorated) matches its
twin (`wkv_decode.prep_wkv_gate_torch`: `wkv_prep`, `wkv7`, `gn_bonus_gate`) on random inputs:
the output, k and v updated in place, the rows' slot states, and no other slot touched. On a GPU,
test_wkv_decode_cuda.py runs it for real. The dispatch keeps the three ops where it does not apply."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from albatross import ops, wkv_decode
from interpreter_cases import interpreter_cases

SCRIPT = Path(__file__).with_name("wkv_decode_triton_interpreter.py")
# Of the largest value. fp16/bf16: the twin on the CPU rounds after each op of the prep, the
# kernel once; the interpreter's bf16 conversion also rounds differently from the GPU's.
TOLERANCE = {"fp32": 2e-6, "fp16": 3e-3, "bf16": 3.2e-2}


@pytest.fixture(scope="module")
def cases() -> list[dict[str, object]]:
    return interpreter_cases(SCRIPT)


def test_every_case_ran(cases: list[dict[str, object]]) -> None:
    assert len(cases) == 6, [case["name"] for case in cases]


def test_the_kernel_matches_the_three_ops(cases: list[dict[str, object]]) -> None:
    for case in cases:
        assert case["shape"] == case["want_shape"], case
        assert case["r_untouched"] and case["other_slots_untouched"], case
        bound = max(TOLERANCE[str(case["act"])], TOLERANCE[str(case["state"])])
        for part in ("out_error", "k_error", "v_error", "state_error"):
            assert float(case[part]) <= bound, f"{case['name']}: {part} {case[part]:.2e}"


def test_the_three_ops_serve_where_the_kernel_does_not_apply() -> None:
    k = torch.randn(2, 128, dtype=torch.float16)
    wkv_decode.set_fused_allowed(True)
    try:
        assert not wkv_decode.fused_applies(k, ops.FlatBatch.build([0, 1], [1, 1], torch.device("cpu"))), "a CPU tensor"
        if torch.cuda.is_available():
            gpu = k.cuda()
            assert wkv_decode.fused_applies(gpu, ops.FlatBatch.build([0, 1], [1, 1], gpu.device))
            assert not wkv_decode.fused_applies(gpu, ops.FlatBatch.build([0], [2], gpu.device)), "a prefill row"
            assert not wkv_decode.fused_applies(gpu.float(), ops.FlatBatch.build([0, 1], [1, 1], gpu.device)), "fp32"
    finally:
        wkv_decode.set_fused_allowed(wkv_decode.FUSED_BY_DEFAULT)


def test_the_cuda_step_op_applies_only_to_decode_rows_on_a_gpu_when_allowed() -> None:
    k = torch.randn(2, 128, dtype=torch.float16)
    decode = ops.FlatBatch.build([0, 1], [1, 1], torch.device("cpu"))
    wkv_decode.set_step_op_allowed(True)
    try:
        assert not wkv_decode.step_op_applies(k, decode), "a CPU tensor takes the three ops"
        if torch.cuda.is_available():
            gpu = k.cuda()
            loaded = "wkv_decode_step" in ops.registered_cuda_ops()
            assert wkv_decode.step_op_applies(gpu, ops.FlatBatch.build([0, 1], [1, 1], gpu.device)) == loaded
            assert not wkv_decode.step_op_applies(gpu, ops.FlatBatch.build([0], [2], gpu.device)), "a prefill row"
    finally:
        wkv_decode.set_step_op_allowed(wkv_decode.STEP_OP_BY_DEFAULT)
