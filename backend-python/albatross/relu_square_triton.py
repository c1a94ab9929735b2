# mypy: ignore-errors
# (the @triton.jit functions are Triton's language, not Python that mypy can check)
"""The channel mix's key product with its `relu(.)^2` in the product's epilogue (issue 16, prefill).

The channel mix is `relu(xk @ W_key)^2 @ W_value`. cuBLAS writes the key product's `[rows, F]`
result (F = 4 C) in 16 bits, then `relu_square` reads it and writes it again: at a 7.2B 64 x 512
prefill that pass moves 2 GB a layer, 22.6 ms of the 855 ms call on an H100 (docs/performance.md,
"Session 22"). Here one persistent kernel computes the product on the tensor cores (TMA loads,
Hopper `wgmma`, fp32 accumulators) and squares the positive part of each accumulator before its
only store, so the pass and its 2 GB are gone. Whether that pays depends on the product running
as fast as cuBLAS's; `bench/bench_ffn_key.py` times both and `linear.mm_relu_square` takes this
kernel only where it was measured to win.

Numerics: the epilogue rounds each fp32 accumulator to the activation dtype first, as cuBLAS
stores the product, and then squares its positive part in fp32 and rounds again, as `relu_square`
does; `max(k, 0)` is IEEE maxNum, so a NaN gives 0 as the CUDA kernel's `fmaxf` does. So a row
gets the unfused path's roundings whichever path its call takes, and differs from it only as
cuBLAS's own kernels differ from one row count to another (the order of the fp32 sums): the API's
promise that a seed gives the same output whatever else runs (docs/api.md) holds as it does
today. Squaring the unrounded accumulator would be more exact, but would move a row's logits by
an fp16 rounding whenever its call crossed the row threshold (the batch-1 Triton paths were
turned off for that, docs/kernels.md).

The twin is `relu_square_torch(x @ W)`; tests/relu_square_triton_interpreter.py runs the kernel
under Triton's CPU interpreter against it, tests/test_relu_square_triton_cuda.py on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from albatross import triton_paths, wkv_dispatch


@dataclass(frozen=True, slots=True)
class Tiles:
    """One launch configuration (bench/bench_ffn_key.py sweeps them)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8  # row tiles walked together, so neighbouring programs share weight columns in L2
    stages: int = 3
    warps: int = 8
    split_epilogue: bool = True  # store the tile as two halves: half the epilogue's shared memory
    # Programs an SM: at 2, tiles small enough for two to share an SM's shared memory, so one's
    # epilogue (its stores) overlaps the other's products.
    per_sm: int = 1
    # Triton's Hopper warp specialization of the product loop (`warps` 4: a loading warp group and
    # two computing ones, 12 warps in all); the tile is then stored without TMA.
    warp_specialize: bool = False

    def label(self) -> str:
        label = f"{self.block_m}x{self.block_n}x{self.block_k} st{self.stages} w{self.warps} g{self.group_m}"
        label += " ws" if self.warp_specialize else (" split" if self.split_epilogue else "")
        return label + (f" x{self.per_sm}/SM" if self.per_sm > 1 else "")


TILES = Tiles()
# What bench/bench_ffn_key.py times against TILES: the usual Hopper GEMM shapes that fit sm90's
# shared memory without spills (tests/test_relu_square_triton_cuda.py runs each one).
CANDIDATES = (
    TILES,
    Tiles(stages=4),
    Tiles(split_epilogue=False),
    Tiles(group_m=16),
    Tiles(block_n=128, stages=4),
    Tiles(block_n=128, stages=4, warps=4),
    Tiles(block_m=256, block_n=128, stages=3),
    Tiles(block_n=128, stages=3, warps=4, per_sm=2),
    Tiles(block_n=128, stages=3, warps=8, per_sm=2),
    Tiles(warps=4, warp_specialize=True),
    Tiles(block_n=128, stages=4, warps=4, warp_specialize=True),
)


@triton.jit
def _tile_of(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of the persistent loop's `tile`: GROUP_M row tiles at a time, each
    group walked column by column."""
    in_group = GROUP_M * tiles_n
    first_m = (tile // in_group) * GROUP_M
    rows_here = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (tile % in_group) % rows_here, (tile % in_group) // rows_here


# M (the call's rows) is not specialized: every row count runs one build (TMA bounds the tiles).
@triton.jit(do_not_specialize=["M"])
def _product_relu_square_kernel(
    x_desc, w_desc, out_desc, out_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROGRAMS: tl.constexpr, SPLIT_EPILOGUE: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    # The epilogue recomputes its tile from its own counter, so the compiler sees no dependence
    # between one tile's stores and the next tile's loads (it may start those loads early).
    done = tl.program_id(0) - PROGRAMS
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=not WARP_SPECIALIZE):
        tile_m, tile_n = _tile_of(tile, tiles_m, tiles_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # WARP_SPECIALIZE: Triton's Hopper warp specialization, one warp group issuing the TMA
        # loads and two computing (the launch's 4 warps become 12).
        for kk in tl.range(k_tiles, warp_specialize=WARP_SPECIALIZE):
            a = x_desc.load([tile_m * BLOCK_M, kk * BLOCK_K])
            b = w_desc.load([kk * BLOCK_K, tile_n * BLOCK_N])
            acc = tl.dot(a, b, acc)
        done += PROGRAMS
        tile_m, tile_n = _tile_of(done, tiles_m, tiles_n, GROUP_M)
        dtype = out_ptr.dtype.element_ty
        acc = tl.maximum(acc.to(dtype).to(tl.float32), 0.0)  # the product as stored, then relu_square
        acc = acc * acc
        if WARP_SPECIALIZE:  # the pass refuses a TMA store after the loop; plain masked stores
            rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
            live = (rows[:, None] < M) & (cols[None, :] < N)
            tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(dtype), mask=live)
        elif SPLIT_EPILOGUE:
            left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            out_desc.store([tile_m * BLOCK_M, tile_n * BLOCK_N], left.to(dtype))
            out_desc.store([tile_m * BLOCK_M, tile_n * BLOCK_N + BLOCK_N // 2], right.to(dtype))
        else:
            out_desc.store([tile_m * BLOCK_M, tile_n * BLOCK_N], acc.to(dtype))


def _sm_count(device: torch.device) -> int:
    return wkv_dispatch.multiprocessors(triton_paths.device_index(device))


def product_relu_square(x: torch.Tensor, weight: torch.Tensor, tiles: Tiles | None = None, programs: int | None = None) -> torch.Tensor:
    """`relu(x @ weight)^2` for x `[M, K]` and weight `[K, N]` of one 16-bit dtype, rows 16-byte
    aligned (`linear.takes_fused_relu_square` checks). `programs`: the persistent grid (a
    constant of the build, so a fixed one), the GPU's SM count unless given (the interpreter
    tests give a small one)."""
    tiles = tiles or TILES  # read at the call: benchmarks set the module's TILES
    M, K = x.shape
    N = weight.shape[1]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    x_desc = TensorDescriptor(x, [M, K], [x.stride(0), 1], [tiles.block_m, tiles.block_k])
    w_desc = TensorDescriptor(weight, [K, N], [weight.stride(0), 1], [tiles.block_k, tiles.block_n])
    out_block = tiles.block_n // 2 if tiles.split_epilogue else tiles.block_n
    out_desc = TensorDescriptor(out, [M, N], [N, 1], [tiles.block_m, out_block])
    if programs is None:  # per_sm programs an SM; those left without a tile end at once
        programs = tiles.per_sm * _sm_count(x.device)
    _product_relu_square_kernel[(programs,)](
        x_desc, w_desc, out_desc, out, M, N, K,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        PROGRAMS=programs, SPLIT_EPILOGUE=tiles.split_epilogue, WARP_SPECIALIZE=tiles.warp_specialize,
        num_warps=tiles.warps, num_stages=tiles.stages,
    )
    return out
