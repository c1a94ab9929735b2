"""The key product with relu^2 in its epilogue (albatross/relu_square_triton.py), as Triton builds
it for sm90 without a GPU (the compiler and ptxas come with the triton wheel): its products are
Hopper wgmma fed by TMA loads, with no register spills, in shared memory that fits, at the tiles
the dispatch launches and at every tile shape the benchmark times. test_relu_square_triton_cuda.py runs it on a GPU; bench/bench_ffn_key.py
times it against cuBLAS and the relu_square pass."""

from __future__ import annotations

import pytest

from albatross import relu_square_triton
from albatross.relu_square_triton import CANDIDATES, TILES, Tiles
from triton_sm90 import SM90_SHARED_BYTES, compile_sm90


def _signature(tiles: Tiles, dtype: str) -> tuple[dict[str, str], dict[str, object]]:
    out_block = tiles.block_n // 2 if tiles.split_epilogue else tiles.block_n
    signature = {
        "x_desc": f"tensordesc<{dtype}[{tiles.block_m}, {tiles.block_k}]>",
        "w_desc": f"tensordesc<{dtype}[{tiles.block_k}, {tiles.block_n}]>",
        "out_desc": f"tensordesc<{dtype}[{tiles.block_m}, {out_block}]>",
        "out_ptr": f"*{dtype}",
        **dict.fromkeys(("M", "N", "K"), "i32"),
        **dict.fromkeys(("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "PROGRAMS", "SPLIT_EPILOGUE", "WARP_SPECIALIZE"), "constexpr"),
    }
    constants = {"BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k, "GROUP_M": tiles.group_m,
                 "PROGRAMS": 132, "SPLIT_EPILOGUE": tiles.split_epilogue, "WARP_SPECIALIZE": tiles.warp_specialize}  # fmt: skip
    return signature, constants


@pytest.mark.parametrize(("tiles", "dtype"), [(TILES, "bf16")] + [(tiles, "fp16") for tiles in CANDIDATES], ids=lambda v: v.label() if isinstance(v, Tiles) else v)
def test_the_products_are_wgmma_on_tma_loads_without_spills(tiles: Tiles, dtype: str) -> None:
    signature, constants = _signature(tiles, dtype)
    build = compile_sm90(relu_square_triton._product_relu_square_kernel, signature, constants, num_warps=tiles.warps,
                         num_stages=tiles.stages, unspecialized=("M",))  # fmt: skip
    assert build.wgmma > 0, build
    tma_loads = sum(n for op, n in build.memory_ops.items() if op.startswith("cp.async.bulk.tensor") and "mbarrier" in op)
    tma_stores = sum(n for op, n in build.memory_ops.items() if op.startswith("cp.async.bulk.tensor") and "bulk_group" in op)
    assert tma_loads > 0 and (tma_stores > 0) != tiles.warp_specialize, build.memory_ops
    # warp-specialized: a loading warp group and two computing ones, whatever the launch asked for
    assert build.warps == (12 if tiles.warp_specialize else tiles.warps), build.warps
    assert build.spill_bytes == 0 and 0 < build.registers <= 255, build
    assert build.shared_bytes <= SM90_SHARED_BYTES, build
    # per_sm programs share an SM: 228 KB, less 1 KB the system keeps for each block
    assert tiles.per_sm * (build.shared_bytes + 1024) <= 228 * 1024, (tiles.label(), build.shared_bytes)
