"""The chunked WKV kernels build for sm90 without a GPU (Triton's compiler, then the wheel's
ptxas) at the settings the dispatch and the benchmark use: the parallel prepare pass (its
`PREPARE_WARPS`, chunks of 16) and the scan (32 value rows a program, 4 or 8 warps, either state layout), in both
product precisions and both state dtypes, within the block's shared memory and with no register
spills in the scan's default tf32x3 products (the prepare pass: a bound, below). Whether they are fast is for bench/bench_wkv_chunked.py
on the GPU."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from albatross import wkv_chunked_triton as chunked
from triton_sm90 import SM90_SHARED_BYTES, compile_sm90

INPUTS = ("r_ptr", "w_ptr", "k_ptr", "v_ptr", "a_ptr", "b_ptr")
STRIDES = ("stride_r", "stride_w", "stride_k", "stride_v", "stride_a", "stride_b")
# With the next chunk's factors in registers, the fp32-FMA products ("ieee", not the default)
# spill 60-76 bytes at 32 value rows (session 7's build); the default tf32x3 spills none.
IEEE_SCAN_SPILLS = 128


def _prepare_signature() -> dict[str, str]:
    pointers = {"cu_ptr": "*i32", "chunk_offsets_ptr": "*i32", "factors_ptr": "*fp32", "decay_ptr": "*fp32", "span_ptr": "*fp32", "total": "i32"}
    return {**dict.fromkeys(INPUTS, "*fp16"), **dict.fromkeys(STRIDES, "i32"), **pointers,
            **dict.fromkeys(("H", "N", "L", "F", "PRECISION", "SQUARING", "LOG2_L"), "constexpr")}  # fmt: skip


def _scan_signature(state: str) -> dict[str, str]:
    pointers = {"state_ptr": f"*{state}", "slot_idx_ptr": "*i32", "cu_ptr": "*i32", "chunk_offsets_ptr": "*i32",
                "factors_ptr": "*fp32", "decay_ptr": "*fp32", "span_ptr": "*fp32", "y_ptr": "*fp16"}  # fmt: skip
    return {**pointers, **dict.fromkeys(INPUTS, "*fp16"), **dict.fromkeys((*STRIDES, "stride_y"), "i32"), "span_limit": "fp32",
            "total": "i32", "capture_ptr": f"*{state}", "chunk_capture_ptr": "*i32",
            **dict.fromkeys(("H", "N", "L", "BV", "F", "PRECISION", "KEY_MAJOR", "CAPTURE"), "constexpr")}  # fmt: skip


# At 2 warps a program (PREPARE_WARPS) the prepare pass holds its 16 x 64 tiles in 255 registers
# and spills 28 bytes with tf32x3 products, 460 with "ieee" (inverting by squaring: 44 and 592);
# at 8 warps it spilled none (189 registers) but ran 1.9x slower on an H100 (docs/performance.md,
# "Session 16"). The bounds catch a change that spills much more.
PREPARE_SPILLS = {("tf32x3", False): 32, ("ieee", False): 512, ("tf32x3", True): 48, ("ieee", True): 640}


@pytest.mark.parametrize("squaring", [False, True], ids=["substitution", "squaring"])
@pytest.mark.parametrize("precision", ["tf32x3", "ieee"])
def test_the_prepare_kernel_builds_within_its_spill_bound(precision: str, squaring: bool) -> None:
    constexprs = {"H": 64, "N": chunked.HEAD, "L": chunked.CHUNK, "F": chunked.FACTORS, "PRECISION": precision,
                  "SQUARING": squaring, "LOG2_L": chunked.CHUNK.bit_length() - 1}  # fmt: skip
    build = compile_sm90(
        chunked._chunk_prepare_kernel, _prepare_signature(), constexprs, num_warps=chunked.PREPARE_WARPS, num_stages=1,
        unspecialized=chunked._PREPARE_INDEX_ARGS,
    )  # fmt: skip
    assert build.spill_bytes <= PREPARE_SPILLS[precision, squaring] and 0 < build.registers <= 255, build
    assert build.shared_bytes <= SM90_SHARED_BYTES, build


# The prefix cache's captures (CAPTURE) at the dispatch's settings: tf32x3, 4 warps, value-major.
SCAN_BUILDS = [
    *[(precision, state, warps, key_major, False) for precision in ("tf32x3", "ieee") for state in ("fp16", "fp32")
      for warps in (4, 8) for key_major in (False, True)],
    ("tf32x3", "fp16", 4, False, True),
    ("tf32x3", "fp32", 4, False, True),
]  # fmt: skip


@pytest.mark.parametrize(("precision", "state", "num_warps", "key_major", "capture"), SCAN_BUILDS)
def test_the_scan_kernel_builds_without_spills(capture: bool, key_major: bool, num_warps: int, state: str, precision: str) -> None:
    constexprs = {"H": 64, "N": chunked.HEAD, "L": chunked.CHUNK, "BV": 32, "F": chunked.FACTORS, "PRECISION": precision, "KEY_MAJOR": key_major,
                  "CAPTURE": capture}  # fmt: skip
    build = compile_sm90(
        chunked._chunk_scan_kernel, _scan_signature(state), constexprs, num_warps=num_warps, num_stages=1, unspecialized=chunked._SCAN_INDEX_ARGS
    )
    assert build.spill_bytes <= IEEE_SCAN_SPILLS if precision == "ieee" else build.spill_bytes == 0, build
    assert 0 < build.registers <= 255, build
    assert build.shared_bytes <= SM90_SHARED_BYTES, build
