"""The W8A16 Triton kernels under Triton's CPU interpreter (a child process, since TRITON_INTERPRET
must be set before the kernels are decorated): the tile kernel, the swap-AB kernel and the L2-slab
product match the torch twin (dequantize, then the product) on random inputs, and the dequantizers
equal it bit for bit. On a GPU, test_int8_cuda.py runs them for real."""

from __future__ import annotations

from pathlib import Path

import pytest

from interpreter_cases import interpreter_cases

SCRIPT = Path(__file__).with_name("int8_triton_interpreter.py")
TOLERANCE = {"fp32": 1e-5, "fp16": 2e-3}  # of the largest output; fp16 rounds the output once


@pytest.fixture(scope="module")
def cases() -> list[dict[str, object]]:
    return interpreter_cases(SCRIPT)


def test_every_case_ran(cases: list[dict[str, object]]) -> None:
    names = [str(c["name"]) for c in cases]
    assert len(cases) == 9 + 9 + 4 + 16, names
    assert sum(name.startswith("swap:") for name in names) == 9 and sum(name.startswith("slab:") for name in names) == 4


def test_the_tile_swap_and_slab_products_match_the_twin(cases: list[dict[str, object]]) -> None:
    for case in cases:
        if "exact" in case:
            continue
        assert case["shape"] == case["expected_shape"], case
        assert case["dtype"] == {"fp32": "torch.float32", "fp16": "torch.float16"}[str(case["act"])], case
        assert float(case["error"]) <= TOLERANCE[str(case["act"])], f"{case['name']}: error {case['error']:.2e}"


def test_the_dequantize_kernels_equal_the_twin_bit_for_bit(cases: list[dict[str, object]]) -> None:
    dequantized = [case for case in cases if "exact" in case]
    assert len(dequantized) == 16 and all(case["exact"] for case in dequantized), [c for c in dequantized if not c["exact"]]


def test_each_slab_is_the_product_with_the_twins_own_columns(cases: list[dict[str, object]]) -> None:
    slabs = [case for case in cases if "slab_exact" in case]
    assert [case["slabs"] for case in slabs] == [5, 1, 3, 3], slabs
    assert all(case["slab_exact"] for case in slabs), [c["name"] for c in slabs if not c["slab_exact"]]
