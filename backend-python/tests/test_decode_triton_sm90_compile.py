"""The one-launch decode kernels (albatross/norm_mix_triton.py, albatross/wkv_decode_triton.py)
compile for sm90 without a GPU (the compiler and ptxas come with the triton wheel), with no
register spills: the interpreter tests check their arithmetic, this checks that the real backend
takes them as written. test_norm_mix_cuda.py and test_wkv_decode_cuda.py run them on a GPU."""

from __future__ import annotations

import pytest

from albatross import norm_mix_triton, wkv_decode_triton
from triton_sm90 import compile_sm90


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("has_delta, mixes", [(True, 6), (False, 6), (True, 1)])
def test_the_norm_mix_kernel_compiles_without_spills(dtype: str, has_delta: bool, mixes: int) -> None:
    pointers = dict.fromkeys(("x_ptr", "delta_ptr", "weight_ptr", "bias_ptr", "shift_ptr"), f"*{dtype}")
    signature = {
        **pointers, "slot_ptr": "*i32", "coef_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "C": "i32", "eps": "fp32",
        **dict.fromkeys(("stride_x", "stride_delta", "stride_shift", "stride_out_k", "stride_out_row"), "i32"),
        **dict.fromkeys(("HAS_DELTA", "K", "BLOCK_C", "LAUNCH_DEPENDENTS"), "constexpr"),
    }  # fmt: skip
    build = compile_sm90(norm_mix_triton._norm_mix_kernel, signature, {"HAS_DELTA": has_delta, "K": mixes, "BLOCK_C": 4096, "LAUNCH_DEPENDENTS": True}, num_warps=16, num_stages=3)
    assert build.spill_bytes == 0 and 0 < build.registers <= 128, build


@pytest.mark.parametrize("dtype, state", [("fp16", "fp16"), ("fp16", "fp32"), ("bf16", "bf16")])
@pytest.mark.parametrize("value_lora", [True, False])
def test_the_wkv_step_kernel_compiles_without_spills(dtype: str, state: str, value_lora: bool) -> None:
    names = ("r_ptr", "k_ptr", "v_ptr", "g_ptr", "w_lora_ptr", "a_lora_ptr", "v_lora_ptr", "v_first_ptr",
             "w0_ptr", "a0_ptr", "v0_ptr", "k_k_ptr", "k_a_ptr", "r_k_ptr", "ln_w_ptr", "ln_b_ptr")  # fmt: skip
    strides = ("stride_r", "stride_k", "stride_v", "stride_g", "stride_wl", "stride_al", "stride_vl", "stride_vf", "stride_out", "stride_state")
    signature = {
        **dict.fromkeys(names, f"*{dtype}"), "state_ptr": f"*{state}", "slot_ptr": "*i32", "out_ptr": f"*{dtype}",
        **dict.fromkeys(strides, "i32"), "eps": "fp32", "HAS_VALUE_LORA": "constexpr", "N": "constexpr", "LAUNCH_DEPENDENTS": "constexpr",
    }  # fmt: skip
    build = compile_sm90(wkv_decode_triton._prep_wkv_gate_kernel, signature, {"HAS_VALUE_LORA": value_lora, "N": 64, "LAUNCH_DEPENDENTS": True}, num_warps=wkv_decode_triton.NUM_WARPS, num_stages=3)
    assert build.spill_bytes == 0 and 0 < build.registers <= 255, build
