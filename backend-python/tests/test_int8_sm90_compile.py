"""The swap-AB kernel's design holds in what Triton builds for sm90, checked without a GPU (the
compiler and ptxas come with the triton wheel): for the row-count defaults, in fp16 and bf16, the
weights are wgmma's register operand with products left in flight, the loads are pipelined, no
register spills and the shared memory fits. test_int8_cuda.py measures nothing; bench_int8.py
kernels times every config on the GPU. Checked here: the defaults and one `convert_first` config
(`SWAP_CONFIGS` all pass too: run with INT8_SM90_ALL=1)."""

from __future__ import annotations

import os

import pytest

from albatross import int8_triton
from triton_sm90 import SM90_SHARED_BYTES, compile_sm90

_CHECKED = (*(c for _, c in int8_triton.SWAP_DEFAULTS), next(c for c in int8_triton.SWAP_CONFIGS if c.convert_first))
CONFIGS = int8_triton.SWAP_CONFIGS if os.environ.get("INT8_SM90_ALL") == "1" else tuple(dict.fromkeys(_CHECKED))


def _signature(dtype: str, constexprs: dict[str, object]) -> dict[str, str]:
    """Both int8 kernels' arguments (the same pointers and integers), then their constexprs."""
    pointers = {"x_ptr": f"*{dtype}", "q_ptr": "*i8", "scale_ptr": "*fp32", "y_ptr": f"*{dtype}"}
    integers = dict.fromkeys(("M", "N", "K", "stride_xb", "stride_xm", "stride_qb", "stride_sb", "stride_yb", "stride_ym"), "i32")
    return {**pointers, **integers, **dict.fromkeys(constexprs, "constexpr")}


def _swap_constexprs(config: int8_triton.SwapConfig, dtype: str) -> dict[str, object]:
    return {"BLOCK_N": config.block_n, "BLOCK_M": config.block_m, "BLOCK_K": config.block_k, "GROUP_N": config.group_n,
            "MAGIC_FP16": dtype == "fp16", "EVEN_K": True, "CONVERT_FIRST": config.convert_first}  # fmt: skip


def _tile_constexprs(config: int8_triton.TileConfig, dtype: str) -> dict[str, object]:
    return {"BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k, "GROUP_M": config.group_m, "MAGIC_FP16": dtype == "fp16"}


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name.replace(" ", "-"))
def test_the_weights_feed_wgmma_from_registers(config: int8_triton.SwapConfig, dtype: str) -> None:
    constexprs = _swap_constexprs(config, dtype)
    build = compile_sm90(
        int8_triton._w8a16_swap_kernel, _signature(dtype, constexprs), constexprs, config.num_warps, config.num_stages,
        unspecialized=int8_triton._ROWS_ARGS,
    )  # fmt: skip
    assert build.wgmma > 0 and build.left_in_registers, build
    assert build.most_in_flight >= 1, f"every product waited for: {build}"
    assert build.async_copies > 0, f"loads not pipelined: {build}"
    assert build.spill_bytes == 0 and 0 < build.registers <= 255, build
    assert build.shared_bytes <= SM90_SHARED_BYTES, build


_ROW_BUILDS = [
    *[("swap", config) for _, config in int8_triton.SWAP_DEFAULTS],
    *[("tile", config) for _, config in int8_triton.CONFIGS],
]


@pytest.mark.parametrize(("kernel", "config"), _ROW_BUILDS, ids=[f"{k}-{c.block_m}x{c.block_n}x{c.block_k}" for k, c in _ROW_BUILDS])
def test_the_row_count_unspecialized_keeps_every_load_and_store(kernel: str, config: int8_triton.TileConfig | int8_triton.SwapConfig) -> None:
    """Both kernels take the row count M unspecialized (`_ROWS_ARGS`: a step's rows are any
    number, and each new specialization was a compile of seconds on the worker's thread). What
    that may cost is in the build: the loads, stores, async copies and products must be the ones
    of the build for a multiple of 16 rows, the same instructions at the same widths."""
    if kernel == "swap":
        assert isinstance(config, int8_triton.SwapConfig)
        fn, constexprs = int8_triton._w8a16_swap_kernel, _swap_constexprs(config, "fp16")
    else:
        assert isinstance(config, int8_triton.TileConfig)
        fn, constexprs = int8_triton._w8a16_kernel, _tile_constexprs(config, "fp16")
    signature = _signature("fp16", constexprs)
    assert int8_triton._ROWS_ARGS == ["M"]
    aligned = compile_sm90(fn, signature, constexprs, config.num_warps, config.num_stages)
    any_rows = compile_sm90(fn, signature, constexprs, config.num_warps, config.num_stages, unspecialized=int8_triton._ROWS_ARGS)
    assert any_rows.memory_ops == aligned.memory_ops
    assert sum(any_rows.memory_ops.values()) > 0 and any(op.startswith("ld.global") or op.startswith("cp.async") for op in any_rows.memory_ops)
    assert any_rows.spill_bytes == aligned.spill_bytes == 0 and any_rows.shared_bytes == aligned.shared_bytes
