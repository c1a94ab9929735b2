"""The fused LoRA up products + `wkv_prep` (albatross/lora_prep_triton.py) under Triton's CPU
interpreter (a child process, since TRITON_INTERPRET must be set before the kernel is decorated)
give the unfused path's results: the up products rounded as the bmm stores them, then wkv_prep's
fp32 arithmetic, so outputs differ only where fp32 sums added in another order round to a
neighbouring value. On a GPU, test_lora_prep_triton_cuda.py runs it against the CUDA ops. The
dispatch keeps the unfused path where the kernel does not apply."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from albatross import lora_prep, ops
from interpreter_cases import interpreter_cases

SCRIPT = Path(__file__).with_name("lora_prep_triton_interpreter.py")


@pytest.fixture(scope="module")
def cases() -> list[dict[str, object]]:
    return interpreter_cases(SCRIPT)


def test_every_case_ran(cases: list[dict[str, object]]) -> None:
    assert len(cases) == 5, [case["name"] for case in cases]


def test_the_fused_kernel_rounds_as_the_unfused_path(cases: list[dict[str, object]]) -> None:
    for case in cases:
        assert case["dtypes"] == ["torch.float16"], case
        for output in ("w", "a", "b", "k", "v"):
            compared = case[output]
            assert isinstance(compared, dict)
            assert compared["differ"] <= 0.01, (case["name"], output, compared)
            assert compared["worst"] <= 2.0**-10, (case["name"], output, compared)  # one fp16 ulp of the largest
        assert case["v_untouched"] == (case["stacked"] == 2), case  # block 0 has no value residual


def test_the_unfused_path_serves_where_the_kernel_does_not_apply() -> None:
    k = torch.zeros(lora_prep.MIN_ROWS, 128, dtype=torch.float16)
    down = torch.zeros(3, 128, 32, dtype=torch.float16)
    prompt = ops.FlatBatch.build([0], [lora_prep.MIN_ROWS], torch.device("cpu"))
    lora_prep.set_fused_allowed(True)
    try:
        assert not lora_prep.applies(k, prompt, down), "a CPU tensor takes the bmm and wkv_prep"
        if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
            gpu = torch.device("cuda")
            prompt = ops.FlatBatch.build([0], [lora_prep.MIN_ROWS], gpu)
            assert lora_prep.applies(k.to(gpu), prompt, down.to(gpu))
            assert not lora_prep.applies(k.to(gpu)[:-1], ops.FlatBatch.build([0], [lora_prep.MIN_ROWS - 1], gpu), down.to(gpu)), "too few rows"
            decode = ops.FlatBatch.build(list(range(lora_prep.MIN_ROWS)), [1] * lora_prep.MIN_ROWS, gpu)
            assert not lora_prep.applies(k.to(gpu), decode, down.to(gpu)), "a decode step takes the CUDA step op"
            assert not lora_prep.applies(k.to(gpu).float(), prompt, down.to(gpu).float()), "fp32"
        lora_prep.set_fused_allowed(False)
        assert not lora_prep.applies(k, prompt, down)
    finally:
        lora_prep.set_fused_allowed(lora_prep.FUSED_BY_DEFAULT)
