# mypy: ignore-errors
# (the @triton.jit function is Triton's language, not Python that mypy can check)
"""A block's stacked LoRA up products and `wkv_prep` in one kernel, for many-row calls (issue 16,
prefill).

The time mix's value (blocks 1+), decay and in-context-rate LoRAs end in one `bmm` of their
hidden rows `[n, rows, R]` by `lora_up [n, R, C]`, which writes `[n, rows, C]` in 16 bits; then
`wkv_prep` reads those three outputs again beside k, v and v_first, and writes k and v (in place),
w, -kk and kk * a. At a 7.2B 64 x 512 prefill that is 14 passes of 268 MB a layer: the up product
~0.25 ms a layer and `wkv_prep` 31.8 ms of the 855 ms call on an H100 (docs/performance.md,
"Session 22"). Here one program per (row tile, head) computes the three up products of its 64
channels into fp32 accumulators (K = R is small: the tiles are read once, the work is memory
bound) and runs `wkv_prep`'s arithmetic on them as its epilogue, so the LoRA outputs are never
stored: 8 passes instead of 14.

Numerics: each accumulator is rounded to the activation dtype first, as the `bmm` stores it, and
then goes through `prep8`'s (fused.cu) arithmetic in fp32, each output rounded once, so a row gets
the roundings of the unfused path whichever path its call takes; it differs from it only where
the fp32 sums (the products', the head's norm) are added in another order and round to a
neighbouring value, as cuBLAS's own kernels differ from one row count to another (docs/api.md's
seed promise; docs/kernels.md).

The twin is `ops.wkv_prep_torch(k, v, *the bmm's outputs, ...)`; tests/lora_prep_triton_interpreter.py
runs the kernel under Triton's CPU interpreter against it, tests/test_lora_prep_triton_cuda.py on
a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from albatross.ops import HEAD_SIZE

# A program's channels: one head, so the kk norm is a sum over its tile's columns.
_HEAD = tl.constexpr(HEAD_SIZE)


@dataclass(frozen=True, slots=True)
class Tiles:
    block_m: int = 64  # rows a program
    block_k: int = 64  # of the rank R, a step of the products
    warps: int = 4
    stages: int = 2

    def label(self) -> str:
        return f"{self.block_m} rows x{self.block_k} st{self.stages} w{self.warps}"


TILES = Tiles()
# What bench/bench_lora_prep.py times against TILES (sm90 builds without spills: the compile test).
CANDIDATES = (
    TILES,
    Tiles(block_m=128, warps=8),
    Tiles(block_m=32),
    Tiles(block_k=128),
    Tiles(stages=3),
)


@triton.jit
def _up(hidden_ptr, up_ptr, m, rows, cols, live_rows, R, stride_hm, stride_hr, stride_um, stride_ur,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr):
    """Stack matrix m's up product for the tile, rounded as the bmm stores it, in fp32."""
    acc = tl.zeros((BLOCK_M, _HEAD), dtype=tl.float32)
    for k0 in range(0, R, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < R
        h = tl.load(hidden_ptr + m * stride_hm + rows[:, None].to(tl.int64) * stride_hr + ks[None, :],
                    mask=live_rows[:, None] & k_ok[None, :], other=0.0)
        u = tl.load(up_ptr + m * stride_um + ks[:, None].to(tl.int64) * stride_ur + cols[None, :], mask=k_ok[:, None], other=0.0)
        acc = tl.dot(h, u, acc)
    return acc.to(DTYPE).to(tl.float32)


# The row count and the stack's matrix stride (rows x R) vary by call: one build for all of them.
@triton.jit(do_not_specialize=["rows_total", "stride_hm"])
def _lora_prep_kernel(
    hidden_ptr, up_ptr, k_ptr, v_ptr, v_first_ptr, w0_ptr, a0_ptr, v0_ptr, k_k_ptr, k_a_ptr, w_ptr, a_ptr, b_ptr,
    rows_total, R, C, stride_hm, stride_hr, stride_um, stride_ur, stride_k, stride_v, stride_first, stride_out,
    HAS_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * _HEAD + tl.arange(0, _HEAD)
    live = rows < rows_total
    dtype = k_ptr.dtype.element_ty
    # The stack is (v, w, a) in blocks 1+ and (w, a) in block 0.
    first_m = 1 if HAS_V else 0
    w_lora = _up(hidden_ptr, up_ptr, first_m, rows, cols, live, R, stride_hm, stride_hr, stride_um, stride_ur, BLOCK_M, BLOCK_K, dtype)
    a_lora = _up(hidden_ptr, up_ptr, first_m + 1, rows, cols, live, R, stride_hm, stride_hr, stride_um, stride_ur, BLOCK_M, BLOCK_K, dtype)

    r64 = rows[:, None].to(tl.int64)
    tile = live[:, None]
    k_at = k_ptr + r64 * stride_k + cols[None, :]
    k = tl.load(k_at, mask=tile, other=0.0).to(tl.float32)
    kk = k * tl.load(k_k_ptr + cols).to(tl.float32)[None, :]
    inv = 1.0 / tl.maximum(tl.sqrt(tl.sum(kk * kk, axis=1)), 1e-12)
    a = 1.0 / (1.0 + tl.exp(-(tl.load(a0_ptr + cols).to(tl.float32)[None, :] + a_lora)))
    kk = kk * inv[:, None]
    k_a = tl.load(k_a_ptr + cols).to(tl.float32)[None, :]
    tl.store(k_at, (k * (1.0 + (a - 1.0) * k_a)).to(dtype), mask=tile)
    if HAS_V:
        v_lora = _up(hidden_ptr, up_ptr, 0, rows, cols, live, R, stride_hm, stride_hr, stride_um, stride_ur, BLOCK_M, BLOCK_K, dtype)
        v_at = v_ptr + r64 * stride_v + cols[None, :]
        v = tl.load(v_at, mask=tile, other=0.0).to(tl.float32)
        first = tl.load(v_first_ptr + r64 * stride_first + cols[None, :], mask=tile, other=0.0).to(tl.float32)
        gate = 1.0 / (1.0 + tl.exp(-(tl.load(v0_ptr + cols).to(tl.float32)[None, :] + v_lora)))
        tl.store(v_at, (v + (first - v) * gate).to(dtype), mask=tile)
    z = -(tl.load(w0_ptr + cols).to(tl.float32)[None, :] + w_lora)
    softplus = tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(z)))  # torch's softplus threshold
    out = r64 * stride_out + cols[None, :]
    tl.store(w_ptr + out, (-softplus - 0.5).to(dtype), mask=tile)
    tl.store(a_ptr + out, (-kk).to(dtype), mask=tile)
    tl.store(b_ptr + out, (kk * a).to(dtype), mask=tile)


def lora_prep(
    hidden: torch.Tensor,
    lora_up: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    v_first: torch.Tensor | None,
    w0: torch.Tensor,
    a0: torch.Tensor,
    v0: torch.Tensor | None,
    k_k: torch.Tensor,
    k_a: torch.Tensor,
    tiles: Tiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`ops.wkv_prep(k, v, *linear.bmm(hidden, lora_up), ...)` in one kernel: hidden `[n, rows, R]`
    (n = 3: value, decay, in-context rate; n = 2 in block 0, where v_first and v0 are None and v is
    left as it is), k and v `[rows, C]` updated in place; returns w, -kk and kk * a `[rows, C]`.
    Rows and C need unit column strides (`lora_prep.applies` checks)."""
    tiles = tiles or TILES
    n, rows, R = hidden.shape
    C = k.shape[1]
    has_v = n == 3
    w, a, b = (torch.empty((rows, C), dtype=k.dtype, device=k.device) for _ in range(3))
    if rows == 0:
        return w, a, b
    first = v_first if has_v else k  # not read without the value residual
    grid = (triton.cdiv(rows, tiles.block_m), C // HEAD_SIZE)
    _lora_prep_kernel[grid](
        hidden, lora_up, k, v, first, w0, a0, v0 if has_v else w0, k_k, k_a, w, a, b,
        rows, R, C, hidden.stride(0), hidden.stride(1), lora_up.stride(0), lora_up.stride(1),
        k.stride(0), v.stride(0), first.stride(0), w.stride(0),
        HAS_V=has_v, BLOCK_M=tiles.block_m, BLOCK_K=tiles.block_k, num_warps=tiles.warps, num_stages=tiles.stages,
    )
    return w, a, b
