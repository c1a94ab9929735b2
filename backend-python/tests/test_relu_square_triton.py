"""The key product with relu^2 in its epilogue (albatross/relu_square_triton.py) under Triton's
CPU interpreter (a child process, since TRITON_INTERPRET must be set before the kernel is
decorated) rounds as the unfused path does (the product to 16 bits, then its square), so it
differs from it only where the fp32 sums, added in another order, round to a neighbouring value:
on random inputs at sizes on and off its tiles. On a
GPU, test_relu_square_triton_cuda.py runs it for real. The dispatch keeps cuBLAS and the pass
where the kernel does not apply."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from albatross import linear, ops
from interpreter_cases import interpreter_cases

SCRIPT = Path(__file__).with_name("relu_square_triton_interpreter.py")


@pytest.fixture(scope="module")
def cases() -> list[dict[str, object]]:
    return interpreter_cases(SCRIPT)


def test_every_case_ran(cases: list[dict[str, object]]) -> None:
    assert len(cases) == 8, [case["name"] for case in cases]


def test_the_fused_product_rounds_as_the_unfused_path(cases: list[dict[str, object]]) -> None:
    for case in cases:
        assert case["shape"] == case["want_shape"] and case["dtype"] == "torch.float16", case
        assert float(case["mismatch_fraction"]) <= 0.01, case
        # a product one fp16 ulp (<= 2**-10 of it) away, squared and rounded: under 2**-8 of the element
        assert float(case["worst_mismatch"]) <= 2.0**-8, case
        # so its error against float64 is the unfused path's: two fp16 roundings, ~1e-3 of the largest
        assert float(case["error"]) <= 1.5e-3 and abs(float(case["error"]) - float(case["unfused_error"])) <= 5e-4, case
        assert case["negatives"] == 0 and case["missed_zeros"] == 0 and case["spurious_zeros"] == 0, case


def test_the_unfused_path_serves_where_the_kernel_does_not_apply() -> None:
    x = torch.randn(linear.FUSED_RELU_SQUARE_MIN_ROWS, 64, dtype=torch.float16)
    weight = torch.randn(64, 128, dtype=torch.float16)
    linear.set_fused_relu_square(True)
    try:
        assert not linear.takes_fused_relu_square(x, weight), "a CPU tensor takes cuBLAS and the pass"
        assert torch.equal(linear.mm_relu_square(x, weight), ops.relu_square(x @ weight))
        if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
            gpu_x, gpu_w = x.cuda(), weight.cuda()
            assert linear.takes_fused_relu_square(gpu_x, gpu_w)
            assert not linear.takes_fused_relu_square(gpu_x[:-1], gpu_w), "fewer rows than the threshold"
            assert not linear.takes_fused_relu_square(gpu_x.float(), gpu_w.float()), "fp32"
            assert not linear.takes_fused_relu_square(gpu_x[:, 1:], gpu_w[1:]), "rows not 16-byte aligned"
            assert not linear.takes_fused_relu_square(gpu_x, gpu_w[:, :100]), "columns not a multiple of 8"
        linear.set_fused_relu_square(False)
        assert not linear.takes_fused_relu_square(x.cuda() if torch.cuda.is_available() else x, weight.cuda() if torch.cuda.is_available() else weight)
    finally:
        linear.set_fused_relu_square(linear.FUSED_RELU_SQUARE_BY_DEFAULT)
