# mypy: ignore-errors
# (the @triton.jit functions are Triton's language, not Python that mypy can check)
"""A block's four small LoRAs at 1-4 rows in two launches (issue 16, batch-1 decode).

The time-mix's value, decay and in-context-rate LoRAs (stacked, `[n, C, R]` down and `[n, R, C]`
up) and its gate (`g1` `[C, G]`, `g2` `[G, C]`) take six kernels today: two bmm, the decay's tanh,
two mm and the gate's sigmoid. At batch 1 each is launch-bound (a few us of GPU time for a few MB,
plus the gap before the next kernel in the graph), and a 7.2B step has 32 of each. Here:

1. `_down_kernel`: every down product at once, split over K so ~240 programs stream the 7.8 MB of a
   7.2B block's down matrices; each writes fp32 partial sums `[splits, rows, n * R + G]`.
2. `_up_kernel`: each program adds the splits' partials of its matrix in split order (so the result
   does not depend on scheduling), rounds to the activation dtype, applies tanh (decay) or sigmoid
   (gate) and rounds again, as the eager path's in-place ops do, then multiplies by its up matrix.

The twin is `albatross.loras.loras_torch` (the eager path); tests/lora_triton_interpreter.py runs
both kernels under Triton's CPU interpreter against it, and tests/test_lora_cuda.py on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from albatross.triton_paths import MAX_ROWS  # the rows the dispatch sends

ROWS_P = 16  # rows padded (masked) to tl.dot's smallest tile, so both kernels' loads are pipelined


@dataclass(frozen=True, slots=True)
class Tiles:
    """The two kernels' tile sizes and launch options (bench/bench_lora.py sweeps them)."""

    # bench_lora.py's sweep on an H100 (session 13; 7.2B block at 1 row, CUDA graph) found 14.4 us
    # against these tiles' 15.8 (down_block_k 128, up_block_n 128, up_block_k 64): 0.7% of a batch-1
    # step, and its up tiles take 134 registers in bf16. Kept as they are (docs/performance.md).
    splits: int = 8  # K pieces of the down products: a 7.2B block's 30 column tiles x 8 = 240 programs
    down_block_n: int = 32
    down_block_k: int = 64
    up_block_n: int = 64
    up_block_k: int = 32
    down_warps: int = 4
    up_gate_block_n: int = 16  # the gate's up product (rank G, ~3x the stack's): its own tiles
    up_gate_block_k: int = 32
    up_warps: int = 4
    stages: int = 3  # Triton's default


TILES = Tiles()


@triton.jit
def _down_kernel(
    x_ptr, down_ptr, g1_ptr, partial_ptr,
    rows, C, R, G, k_per_split,
    stride_xm, stride_xr,  # mixes [6, rows, C]: matrix, row (columns are contiguous)
    N_STACK: tl.constexpr, ROWS_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    stack_tiles = tl.cdiv(R, BLOCK_N)
    is_gate = tile >= N_STACK * stack_tiles
    matrix = tl.where(is_gate, N_STACK, tile // stack_tiles)  # N_STACK: the gate
    first = tl.where(is_gate, tile - N_STACK * stack_tiles, tile % stack_tiles) * BLOCK_N
    width = tl.where(is_gate, G, R)
    mix = 5 - N_STACK + matrix  # mixes are (r, k, v, w, a, g): the stack takes the n before g
    out_col = matrix * R  # the gate's columns follow the stack's
    if is_gate:
        w_ptr = g1_ptr
    else:
        w_ptr = down_ptr + matrix.to(tl.int64) * C * R
    offs_r = tl.arange(0, ROWS_P)
    offs_n = first + tl.arange(0, BLOCK_N)
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, C)
    acc = tl.zeros((ROWS_P, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        x = tl.load(x_ptr + mix * stride_xm + offs_r[:, None] * stride_xr + offs_k[None, :],
                    mask=(offs_r[:, None] < rows) & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + offs_k[:, None] * width + offs_n[None, :],
                    mask=k_ok[:, None] & (offs_n[None, :] < width), other=0.0)
        acc = tl.dot(x, w, acc)
    total = N_STACK * R + G
    out = partial_ptr + split * rows * total + offs_r[:, None] * total + out_col + offs_n[None, :]
    tl.store(out, acc, mask=(offs_r[:, None] < rows) & (offs_n[None, :] < width))


@triton.jit
def _up_tile(
    partial_ptr, u_ptr, out_ptr, rows, C, rank, total, in_col, first, activation,
    SPLITS: tl.constexpr, ROWS_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Columns [first, first + BLOCK_N) of one up product: its input (the splits' partial sums of
    columns [in_col, in_col + rank)) rounded, through `activation` (0 none, 1 tanh, 2 sigmoid),
    rounded, times `u` [rank, C]; the result rounded into `out` [rows, C]."""
    offs_r = tl.arange(0, ROWS_P)
    offs_n = first + tl.arange(0, BLOCK_N)
    acc = tl.zeros((ROWS_P, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, rank, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        h_mask = (offs_r[:, None] < rows) & (offs_k[None, :] < rank)
        h = tl.zeros((ROWS_P, BLOCK_K), dtype=tl.float32)
        for p in tl.static_range(SPLITS):  # unrolled, in split order: the sum does not depend on scheduling
            h += tl.load(partial_ptr + p * rows * total + offs_r[:, None] * total + in_col + offs_k[None, :], mask=h_mask, other=0.0)
        h = h.to(out_ptr.dtype.element_ty).to(tl.float32)  # the down product's output dtype, as eager
        if activation == 2:
            h = tl.sigmoid(h)
        elif activation == 1:
            h = 2.0 * tl.sigmoid(2.0 * h) - 1.0  # tanh
        u = tl.load(u_ptr + offs_k[:, None] * C + offs_n[None, :], mask=(offs_k[:, None] < rank) & (offs_n[None, :] < C), other=0.0)
        acc = tl.dot(h.to(out_ptr.dtype.element_ty), u, acc)  # rounded to the dtype, as eager
    out = out_ptr + offs_r[:, None] * C + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(offs_r[:, None] < rows) & (offs_n[None, :] < C))


@triton.jit
def _up_kernel(
    partial_ptr, up_ptr, g2_ptr, lora_ptr, gate_ptr,
    rows, C, R, G,
    N_STACK: tl.constexpr, SPLITS: tl.constexpr, ROWS_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GATE_BLOCK_N: tl.constexpr, GATE_BLOCK_K: tl.constexpr,
):
    # The gate's rank is ~3x the stack's (7.2B: 480 against 160), so its column tiles have their
    # own width: narrower tiles even out the programs' K loops. They come first in the grid, the
    # longest work starting first.
    program = tl.program_id(0)
    gate_tiles = tl.cdiv(C, GATE_BLOCK_N)
    total = N_STACK * R + G
    if program < gate_tiles:
        _up_tile(partial_ptr, g2_ptr, gate_ptr, rows, C, G, total, N_STACK * R, program * GATE_BLOCK_N, 2,
                 SPLITS, ROWS_P, GATE_BLOCK_N, GATE_BLOCK_K)
    else:
        stack_tiles = tl.cdiv(C, BLOCK_N)
        matrix = (program - gate_tiles) // stack_tiles
        first = ((program - gate_tiles) % stack_tiles) * BLOCK_N
        activation = tl.where(matrix == N_STACK - 2, 1, 0)  # the decay LoRA takes tanh
        _up_tile(partial_ptr, up_ptr + matrix.to(tl.int64) * R * C, lora_ptr + matrix.to(tl.int64) * rows * C,
                 rows, C, R, total, matrix * R, first, activation, SPLITS, ROWS_P, BLOCK_N, BLOCK_K)


def fused_loras(
    mixes: torch.Tensor, lora_down: torch.Tensor, lora_up: torch.Tensor, g1: torch.Tensor, g2: torch.Tensor,
    tiles: Tiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(lora `[n, rows, C]`, gate `[rows, C]`) from mixes `[6, rows, C]` (1-4 rows), as
    `loras.loras_torch` computes them; `tiles` None: TILES."""
    t = TILES if tiles is None else tiles
    n, C, R = lora_down.shape
    G = g1.shape[1]
    rows = mixes.shape[1]
    assert mixes.shape[0] == 6 and mixes.shape[2] == C and 1 <= rows <= MAX_ROWS, mixes.shape
    assert n >= 2 and lora_up.shape == (n, R, C) and g1.shape == (C, G) and g2.shape == (G, C)
    assert mixes.stride(2) == 1 and lora_down.is_contiguous() and lora_up.is_contiguous() and g1.is_contiguous() and g2.is_contiguous()
    assert len({mixes.dtype, lora_down.dtype, lora_up.dtype, g1.dtype, g2.dtype}) == 1, "one dtype"
    k_per_split = triton.cdiv(triton.cdiv(C, t.splits), t.down_block_k) * t.down_block_k
    splits = triton.cdiv(C, k_per_split)  # t.splits, or fewer for a narrow model
    # Splits past the last are zeros, so the up kernel can add t.splits of them unconditionally.
    allocate = torch.zeros if splits < t.splits else torch.empty
    partial = allocate((t.splits, rows, n * R + G), dtype=torch.float32, device=mixes.device)
    column_tiles = n * triton.cdiv(R, t.down_block_n) + triton.cdiv(G, t.down_block_n)
    _down_kernel[(column_tiles, splits)](
        mixes, lora_down, g1, partial, rows, C, R, G, k_per_split, mixes.stride(0), mixes.stride(1),
        N_STACK=n, ROWS_P=ROWS_P, BLOCK_N=t.down_block_n, BLOCK_K=t.down_block_k,
        num_warps=t.down_warps, num_stages=t.stages,
    )
    lora = torch.empty((n, rows, C), dtype=mixes.dtype, device=mixes.device)
    gate = torch.empty((rows, C), dtype=mixes.dtype, device=mixes.device)
    _up_kernel[(triton.cdiv(C, t.up_gate_block_n) + n * triton.cdiv(C, t.up_block_n),)](
        partial, lora_up, g2, lora, gate, rows, C, R, G,
        N_STACK=n, SPLITS=t.splits, ROWS_P=ROWS_P, BLOCK_N=t.up_block_n, BLOCK_K=t.up_block_k,
        GATE_BLOCK_N=t.up_gate_block_n, GATE_BLOCK_K=t.up_gate_block_k, num_warps=t.up_warps, num_stages=t.stages,
    )
    return lora, gate
