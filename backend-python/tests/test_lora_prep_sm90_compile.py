"""The fused LoRA up products + `wkv_prep` (albatross/lora_prep_triton.py) as Triton builds it for
sm90 without a GPU (the compiler and ptxas come with the triton wheel): its products are
tensor-core products (`mma.sync` or `wgmma`), with no register spills and shared memory that fits,
in both dtypes and with and without the value residual, at every tile shape the benchmark times. test_lora_prep_triton_cuda.py runs it on
a GPU; bench/bench_lora_prep.py times it against the bmm and wkv_prep."""

from __future__ import annotations

import pytest

from albatross import lora_prep_triton
from albatross.lora_prep_triton import CANDIDATES, TILES, Tiles
from triton_sm90 import SM90_SHARED_BYTES, compile_sm90

_POINTERS = ("hidden_ptr", "up_ptr", "k_ptr", "v_ptr", "v_first_ptr", "w0_ptr", "a0_ptr", "v0_ptr", "k_k_ptr", "k_a_ptr", "w_ptr", "a_ptr", "b_ptr")
_INTS = ("rows_total", "R", "C", "stride_hm", "stride_hr", "stride_um", "stride_ur", "stride_k", "stride_v", "stride_first", "stride_out")


_CASES = [(TILES, dtype, has_v) for dtype in ("fp16", "bf16") for has_v in (True, False)] + [(tiles, "fp16", True) for tiles in CANDIDATES[1:]]


@pytest.mark.parametrize(("tiles", "dtype", "has_v"), _CASES)
def test_tensor_core_products_without_spills(tiles: Tiles, dtype: str, has_v: bool) -> None:
    signature = {**dict.fromkeys(_POINTERS, f"*{dtype}"), **dict.fromkeys(_INTS, "i32"), **dict.fromkeys(("HAS_V", "BLOCK_M", "BLOCK_K"), "constexpr")}
    constants = {"HAS_V": has_v, "BLOCK_M": tiles.block_m, "BLOCK_K": tiles.block_k}
    build = compile_sm90(lora_prep_triton._lora_prep_kernel, signature, constants, num_warps=tiles.warps, num_stages=tiles.stages,
                         unspecialized=("rows_total", "stride_hm"))  # fmt: skip
    mma = sum(n for op, n in build.memory_ops.items() if op.startswith("wgmma")) + build.wgmma
    assert mma > 0 or build.memory_ops.get("ldmatrix.sync.aligned.m8n8.x4.shared.b16", 0) > 0, build.memory_ops
    assert build.spill_bytes == 0 and 0 < build.registers <= 255, build
    assert build.shared_bytes <= SM90_SHARED_BYTES, build
