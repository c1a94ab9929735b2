"""The fused LoRA kernels' design holds in what Triton builds for sm90, checked without a GPU (the
compiler and ptxas come with the triton wheel): padding the 1-4 rows to tl.dot's 16 gets both
kernels' loads pipelined (cp.async), with no register spills and shared memory that fits.
test_lora_cuda.py runs them on a GPU; bench_model.py --fused-lora on,off times them."""

from __future__ import annotations

import pytest

from albatross import lora_triton
from triton_sm90 import SM90_SHARED_BYTES, compile_sm90

_INTS = ("rows", "C", "R", "G")


def _down(dtype: str) -> tuple[dict[str, str], dict[str, object]]:
    pointers = {"x_ptr": f"*{dtype}", "down_ptr": f"*{dtype}", "g1_ptr": f"*{dtype}", "partial_ptr": "*fp32"}
    signature = {**pointers, **dict.fromkeys((*_INTS, "k_per_split", "stride_xm", "stride_xr"), "i32"), **dict.fromkeys(("N_STACK", "ROWS_P", "BLOCK_N", "BLOCK_K"), "constexpr")}
    return signature, {"N_STACK": 3, "ROWS_P": lora_triton.ROWS_P, "BLOCK_N": lora_triton.TILES.down_block_n, "BLOCK_K": lora_triton.TILES.down_block_k}


def _up(dtype: str) -> tuple[dict[str, str], dict[str, object]]:
    pointers = {"partial_ptr": "*fp32", "up_ptr": f"*{dtype}", "g2_ptr": f"*{dtype}", "lora_ptr": f"*{dtype}", "gate_ptr": f"*{dtype}"}
    signature = {**pointers, **dict.fromkeys(_INTS, "i32"), **dict.fromkeys(("N_STACK", "SPLITS", "ROWS_P", "BLOCK_N", "BLOCK_K"), "constexpr")}
    constants = {"N_STACK": 3, "SPLITS": lora_triton.TILES.splits, "ROWS_P": lora_triton.ROWS_P, "BLOCK_N": lora_triton.TILES.up_block_n, "BLOCK_K": lora_triton.TILES.up_block_k}
    return signature, constants


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("kernel", ["down", "up"])
def test_the_loads_are_pipelined_without_spills(kernel: str, dtype: str) -> None:
    fn = lora_triton._down_kernel if kernel == "down" else lora_triton._up_kernel
    signature, constants = (_down if kernel == "down" else _up)(dtype)
    tiles = lora_triton.TILES
    build = compile_sm90(fn, signature, constants, num_warps=tiles.down_warps if kernel == "down" else tiles.up_warps, num_stages=tiles.stages)
    assert build.async_copies > 0, f"loads not pipelined: {build}"
    assert build.spill_bytes == 0 and 0 < build.registers <= 128, build
    assert build.shared_bytes <= SM90_SHARED_BYTES, build
