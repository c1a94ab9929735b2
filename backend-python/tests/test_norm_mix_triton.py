"""The one-launch layer norm + token-shift mix (albatross/norm_mix_triton.py) under Triton's CPU
interpreter (a child process, since TRITON_INTERPRET must be set before the kernel is decorated)
matches its twin (`norm_mix.norm_mix_torch`: the two ops) on random inputs; on a GPU,
test_norm_mix_cuda.py runs it for real. The dispatch keeps the two ops where it does not apply."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from albatross import norm_mix, ops
from interpreter_cases import interpreter_cases

SCRIPT = Path(__file__).with_name("norm_mix_triton_interpreter.py")
# Of the largest value. fp16/bf16: the twin on the CPU rounds after each op of the mix, the kernel
# once; the interpreter's bf16 conversion also rounds differently from the GPU's.
TOLERANCE = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 1.6e-2}


@pytest.fixture(scope="module")
def cases() -> list[dict[str, object]]:
    return interpreter_cases(SCRIPT)


def test_every_case_ran(cases: list[dict[str, object]]) -> None:
    assert len(cases) == 7, [case["name"] for case in cases]


def test_the_kernel_matches_the_two_ops(cases: list[dict[str, object]]) -> None:
    for case in cases:
        assert case["shape"] == case["want_shape"], case
        assert case["dtype"] == {"fp32": "torch.float32", "fp16": "torch.float16", "bf16": "torch.bfloat16"}[str(case["act"])], case
        assert case["other_layer_untouched"], case
        for part in ("mix_error", "x_error", "shift_error"):
            assert float(case[part]) <= TOLERANCE[str(case["act"])], f"{case['name']}: {part} {case[part]:.2e}"


def test_the_two_ops_serve_where_the_kernel_does_not_apply() -> None:
    x = torch.randn(2, 64, dtype=torch.float16)
    single = ops.FlatBatch.build([0, 1], [1, 1], torch.device("cpu"))
    prefill = ops.FlatBatch.build([0], [2], torch.device("cpu"))
    norm_mix.set_fused_allowed(True)
    try:
        assert not norm_mix.fused_applies(x, single), "a CPU tensor takes the two ops"
        if torch.cuda.is_available():
            gpu = x.cuda()
            gpu_single = ops.FlatBatch.build([0, 1], [1, 1], gpu.device)
            assert norm_mix.fused_applies(gpu, gpu_single)
            assert not norm_mix.fused_applies(gpu, ops.FlatBatch.build([0], [2], gpu.device)), "a prefill row has a previous row"
            assert not norm_mix.fused_applies(torch.randn(5, 64, dtype=torch.float16, device="cuda"), ops.FlatBatch.build(list(range(5)), [1] * 5, gpu.device))
            assert not norm_mix.fused_applies(gpu.float(), gpu_single), "fp32 takes the two ops"
        assert not prefill.single_token
    finally:
        norm_mix.set_fused_allowed(norm_mix.FUSED_BY_DEFAULT)


def test_the_dispatch_gives_the_two_ops_result_on_the_cpu() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 64, generator=gen)
    delta = torch.randn(2, 64, generator=gen)
    weight, bias = torch.randn(64, generator=gen), torch.randn(64, generator=gen)
    coefficients = torch.rand(6, 64, generator=gen)
    shift = torch.randn(4, 64, generator=gen)
    batch = ops.FlatBatch.build([3, 1], [1, 1], torch.device("cpu"))
    want_x, want_shift = x.clone(), shift.clone()
    h = ops.add_layer_norm(want_x, delta, weight, bias)
    want = ops.shift_mix(h, want_shift, batch.slot_idx, batch.cu_seqlens, coefficients)
    residual, got = norm_mix.norm_mix(x, delta, weight, bias, shift, batch, coefficients)
    assert residual is x, "on the CPU the residual is updated in place"
    assert torch.equal(got, want) and torch.equal(x, want_x) and torch.equal(shift, want_shift)
    assert torch.equal(shift[1], h[1]) and torch.equal(shift[3], h[0]), "each slot keeps its row's norm"


def test_the_cuda_op_applies_only_to_decode_rows_on_a_gpu_when_allowed() -> None:
    x = torch.randn(2, 128, dtype=torch.float16)
    operands = (torch.ones(128, dtype=torch.float16), torch.zeros(128, dtype=torch.float16), torch.zeros(4, 128, dtype=torch.float16), torch.rand(6, 128).half())
    decode = ops.FlatBatch.build([0, 1], [1, 1], torch.device("cpu"))
    norm_mix.set_op_allowed(True)
    try:
        assert not norm_mix.op_applies(x, None, operands, decode), "a CPU tensor takes the two ops"
        if torch.cuda.is_available():
            gpu = x.cuda()
            loaded = "norm_mix_decode" in ops.registered_cuda_ops()
            on_gpu = tuple(t.cuda() for t in operands)
            assert norm_mix.op_applies(gpu, None, on_gpu, ops.FlatBatch.build([0, 1], [1, 1], gpu.device)) == loaded
            assert not norm_mix.op_applies(gpu, None, on_gpu, ops.FlatBatch.build([0], [2], gpu.device)), "a prefill row"
    finally:
        norm_mix.set_op_allowed(norm_mix.OP_BY_DEFAULT)
