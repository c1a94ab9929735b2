"""The chunked WKV kernels build for sm90 without a GPU (Triton's compiler, then the wheel's
ptxas) at the dispatch's settings (8 warps, 32 value rows): the transition mode (the segmented
kernel's maps) and the segments' carry with no register spills; the one-walk scan with none in
fp32 FMA products and, in the default tf32x3, no more than it had before transition mode was
added (92 bytes with a 16-bit state, 136 with fp32: the H200 measured that build fastest anyway).
Whether they are fast is for bench/bench_wkv_chunked.py on the GPU."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from albatross import wkv_chunked_triton as chunked
from triton_sm90 import SM90_SHARED_BYTES, compile_sm90

INPUTS = ("r_ptr", "w_ptr", "k_ptr", "v_ptr", "a_ptr", "b_ptr")
STRIDES = ("stride_r", "stride_w", "stride_k", "stride_v", "stride_a", "stride_b", "stride_y")


def _scan_signature(state: str) -> dict[str, str]:
    pointers = {"state_ptr": f"*{state}", "slot_idx_ptr": "*i32", "cu_ptr": "*i32", "chunk_offsets_ptr": "*i32", "inv_ptr": "*fp32", "y_ptr": "*fp16"}
    return {**pointers, **dict.fromkeys(INPUTS, "*fp16"), **dict.fromkeys(STRIDES, "i32"), "span_limit": "fp32",
            **dict.fromkeys(("H", "N", "L", "BV", "PRECISION", "TRANSITION"), "constexpr")}  # fmt: skip


SCAN_SPILLS_TF32X3 = {"fp16": 92, "fp32": 136}  # the one-walk scan's build before transition mode


@pytest.mark.parametrize("precision", ["tf32x3", "ieee"])
@pytest.mark.parametrize("state", ["fp16", "fp32"])
@pytest.mark.parametrize("transition", [False, True], ids=["scan", "transition"])
def test_the_scan_kernel_builds(transition: bool, state: str, precision: str) -> None:
    constexprs = {"H": 64, "N": chunked.HEAD, "L": chunked.CHUNK, "BV": 32, "PRECISION": precision, "TRANSITION": transition}
    build = compile_sm90(chunked._chunk_scan_kernel, _scan_signature(state), constexprs, num_warps=8, num_stages=1)
    allowed = SCAN_SPILLS_TF32X3[state] if precision == "tf32x3" and not transition else 0
    assert build.spill_bytes <= allowed and 0 < build.registers <= 255, build
    assert build.shared_bytes <= SM90_SHARED_BYTES, build


def test_the_carry_kernel_builds_without_spills() -> None:
    signature = {"state_ptr": "*fp16", "slot_idx_ptr": "*i32", "seg_first_ptr": "*i32", "trans_ptr": "*fp32", "start_ptr": "*fp32",
                 **dict.fromkeys(("H", "N", "BV", "PRECISION"), "constexpr")}  # fmt: skip
    constexprs = {"H": 64, "N": chunked.HEAD, "BV": 32, "PRECISION": "tf32x3"}
    build = compile_sm90(chunked._segment_carry_kernel, signature, constexprs, num_warps=8, num_stages=1)
    assert build.spill_bytes == 0 and 0 < build.registers <= 255, build
    assert build.shared_bytes <= SM90_SHARED_BYTES, build
