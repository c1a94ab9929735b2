# mypy: disable-error-code="no-untyped-def"
# (the @triton.jit functions are Triton's language, not Python that mypy can check)
"""The W8A16 Triton kernels: `y = (x @ q) * scale` for more rows than the GEMV takes, and the
dequantization the cuBLAS paths multiply with.

Each program owns a `BLOCK_M x BLOCK_N` tile of y: it walks K in `BLOCK_K` steps, loads an
activation tile and an int8 weight tile, converts the weights to the activation dtype in
registers and feeds both to the tensor cores (`tl.dot`, fp32 accumulation); the per-channel scale
multiplies the finished tile once. The weights are read once per row block, as int8.

fp16 weights are made from bytes without the int-to-float unit: a byte b, biased to b + 128, is
placed in the mantissa of 1024.0 in fp16 (`0x6400 | (b + 128)` = 1024 + b + 128, exact) and 1152
is subtracted. bf16 has too few mantissa bits for that and converts directly.

`w8a16_mm(x, q, scale)` picks the tile shape by row count (`CONFIGS`, measured on the H200:
docs/performance.md, "int8 weights"); `config=` overrides it for benchmarks.

`w8a16_swap_mm` computes the transpose, `y^T = (scale * q^T) x^T`: the int8 tile is the LEFT operand
of `tl.dot`. On Hopper wgmma takes its left operand from registers and its right one from shared
memory, so the converted weights feed the tensor cores directly and the products chain
asynchronously; with the weights on the right (`w8a16_mm`) the converted tile goes back through
shared memory and each step waits for its product (both seen in the kernels' sm90 TTGIR). Each
program owns `BLOCK_N` output channels x `BLOCK_M` rows; `SWAP_CONFIGS` lists the shapes the
benchmark measures, `SWAP_DEFAULTS` the one taken by row count.

`slab_mm` dequantizes a slab of output columns small enough to stay in L2, multiplies it with
torch's product (cuBLAS), and goes on to the next slab: the same fp32 product and one rounding as
`dequantize`, so every slab equals the twin's dequantized columns bit for bit.

The twin of all of them is `albatross.quant.int8_mm_torch`; tests run them under Triton's CPU
interpreter against it. None syncs with the host or sizes anything by data, so all are captured in
the decode CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import triton
import triton.language as tl


@dataclass(frozen=True, slots=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8  # row blocks that walk one column block together (weight tiles stay in L2)


# (most rows, config), first match wins. Small row counts are bandwidth-bound: narrow column
# blocks give every SM a program; large ones are compute-bound: wide tiles reuse each load.
CONFIGS: tuple[tuple[int, TileConfig], ...] = (
    (16, TileConfig(16, 32, 256, num_warps=4, num_stages=4)),
    (64, TileConfig(64, 64, 128, num_warps=4, num_stages=4)),
    (256, TileConfig(64, 128, 64, num_warps=4, num_stages=4)),
    (1 << 62, TileConfig(128, 128, 64, num_warps=8, num_stages=3)),
)


_Value = TypeVar("_Value")


def first_fit(table: Sequence[tuple[int, _Value]], rows: int) -> _Value:
    """The value of a (most rows, value) table's first entry that holds `rows` (else its last)."""
    return next((value for most, value in table if rows <= most), table[-1][1])


def config_for(rows: int) -> TileConfig:
    return first_fit(CONFIGS, rows)


# The row count M is any number a step brings (a prefill chunk's rows), and Triton compiles a kernel
# again for each new specialization of an integer argument: M == 1, M divisible by 16, or neither.
# Each compile of these wgmma kernels held an int8 server's worker for seconds at a new step size
# (the chunked WKV kernels' stalls, docs/performance.md "Session 24"). M only bounds row masks and
# tile counts, never an address's alignment: unspecialized, the sm90 builds differ only by a few
# integer instructions outside the loads (tests/test_int8_sm90_compile.py checks every load and
# copy is the same), so it is left unspecialized.
_ROWS_ARGS = ["M"]


@triton.jit
def _grouped_tile(pid, blocks_grouped, blocks_other, GROUP: tl.constexpr):
    """Program `pid`'s (grouped, other) tile indices: GROUP neighbouring tiles of the grouped
    dimension run for each tile of the other in turn, so the other operand's tiles are reused
    from L2 by a group of programs."""
    in_group = GROUP * blocks_other
    first = (pid // in_group) * GROUP
    group_size = tl.minimum(blocks_grouped - first, GROUP)
    return first + (pid % in_group) % group_size, (pid % in_group) // group_size


@triton.jit(do_not_specialize=_ROWS_ARGS)
def _w8a16_kernel(
    x_ptr, q_ptr, scale_ptr, y_ptr,
    M, N, K,
    stride_xb, stride_xm, stride_qb, stride_sb, stride_yb, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    MAGIC_FP16: tl.constexpr,
):  # fmt: skip
    batch = tl.program_id(1)
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    x_tile = x_ptr + batch * stride_xb + rows[:, None] * stride_xm + ks[None, :]
    q_tile = q_ptr + batch * stride_qb + ks[:, None] * N + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks + k0 < K
        a = tl.load(x_tile, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(q_tile, mask=k_ok[:, None] & col_ok[None, :], other=0)
        if MAGIC_FP16:
            bits = (b.to(tl.int16) + 128) | 0x6400
            w = bits.to(tl.float16, bitcast=True) - 1152.0
        else:
            w = b.to(a.dtype)
        acc = tl.dot(a, w, acc)
        x_tile += BLOCK_K
        q_tile += BLOCK_K * N
    scale = tl.load(scale_ptr + batch * stride_sb + cols, mask=col_ok, other=0.0)
    out = (acc * scale[None, :]).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + batch * stride_yb + rows[:, None] * stride_ym + cols[None, :], out, mask=row_ok[:, None] & col_ok[None, :])


def _check_operands(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    batched = q.dim() == 3
    if x.dim() != q.dim() or x.shape[-1] != q.shape[-2] or (batched and x.shape[0] != q.shape[0]):
        raise ValueError(f"cannot multiply x {list(x.shape)} by q {list(q.shape)}")
    if q.dtype != torch.int8 or not q.is_contiguous() or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError("q must be contiguous int8 and scale contiguous fp32")
    if x.stride(-1) != 1:
        raise ValueError("x must have unit stride along its last dimension")


def _product_frame(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor
) -> tuple[int, int, int, int, torch.Tensor, tuple[int, int, int, int, int, int]]:
    """Both kernels' frame: the checked operands' (B, M, K, N), the output y, and the strides
    (x's batch and row, q's batch, scale's batch, y's batch and row; 0 for an unbatched operand)."""
    _check_operands(x, q, scale)
    batched = q.dim() == 3
    B = q.shape[0] if batched else 1
    M, K, N = x.shape[-2], q.shape[-2], q.shape[-1]
    y = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    strides = (x.stride(0) if batched else 0, x.stride(-2), K * N if batched else 0, N if batched else 0,
               y.stride(0) if batched else 0, y.stride(-2))  # fmt: skip
    return B, M, K, N, y, strides


def w8a16_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, config: TileConfig | None = None) -> torch.Tensor:
    """x `[M, K]` @ q `[K, N]` (or `[B, M, K]` @ `[B, K, N]`) times `scale [N]` (`[B, N]`)."""
    B, M, K, N, y, strides = _product_frame(x, q, scale)
    if M == 0:
        return y
    tile = config or config_for(M)
    grid = (triton.cdiv(M, tile.block_m) * triton.cdiv(N, tile.block_n), B)
    _w8a16_kernel[grid](
        x, q, scale, y,
        M, N, K, *strides,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
        MAGIC_FP16=x.dtype == torch.float16,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip
    return y


# ---------------------------------------------------------------------------------------------
# Swap-AB: the weights on the left


@dataclass(frozen=True, slots=True)
class SwapConfig:
    block_n: int  # output channels a program owns (wgmma's M: 64 per warp group)
    block_m: int  # activation rows a program owns (wgmma's N)
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    group_n: int = 8  # channel blocks that walk the row blocks together (the x tiles stay in L2)
    # How the int8 tile reaches wgmma's registers. False: Triton stages q^T's tile in shared memory
    # and reads it back one byte per element. True: the tile as stored (wide loads), converted,
    # then transposed as fp16 through shared memory (stmatrix / ldmatrix, a barrier per step).
    convert_first: bool = False

    @property
    def name(self) -> str:
        return f"{self.block_n}x{self.block_m}x{self.block_k} w{self.num_warps} s{self.num_stages}" + (" cf" if self.convert_first else "")


# Every shape the benchmark measures (`bench_int8.py kernels`). All compile for sm90 with the
# weights in wgmma's registers, pipelined loads, no register spills and under 227 KB of shared
# memory (128 x 256 x 64 with 4 warps spills: it is left out). The last four are the first
# layout's best guesses again with `convert_first`.
SWAP_CONFIGS: tuple[SwapConfig, ...] = (
    SwapConfig(64, 32, 128, num_warps=4, num_stages=4),
    SwapConfig(64, 64, 128, num_warps=4, num_stages=4),
    SwapConfig(64, 64, 64, num_warps=4, num_stages=5),
    SwapConfig(64, 128, 128, num_warps=4, num_stages=4),
    SwapConfig(64, 128, 64, num_warps=8, num_stages=5),
    SwapConfig(128, 64, 64, num_warps=4, num_stages=4),
    SwapConfig(128, 64, 128, num_warps=8, num_stages=4),
    SwapConfig(128, 128, 64, num_warps=4, num_stages=4),
    # (128 x 128 x 64 with 8 warps and 4 stages left out: on the H200 it wrote NaN from 256 rows on.)
    SwapConfig(128, 128, 128, num_warps=8, num_stages=3),
    SwapConfig(64, 256, 64, num_warps=8, num_stages=4),
    SwapConfig(128, 256, 64, num_warps=8, num_stages=3),
    SwapConfig(128, 256, 64, num_warps=8, num_stages=4),
    SwapConfig(64, 64, 128, num_warps=4, num_stages=4, convert_first=True),
    SwapConfig(64, 128, 128, num_warps=4, num_stages=4, convert_first=True),
    SwapConfig(128, 128, 64, num_warps=8, num_stages=4, convert_first=True),
    SwapConfig(128, 256, 64, num_warps=8, num_stages=3, convert_first=True),
)
# (most rows, config), first match wins: few rows want narrow channel blocks so every SM has a
# program; many rows want wide tiles that reuse each load.
# The H200's fastest per row count over the three 7.2B shapes (docs/performance.md, "Session 5").
SWAP_DEFAULTS: tuple[tuple[int, SwapConfig], ...] = (
    (32, SwapConfig(64, 32, 128, num_warps=4, num_stages=4)),
    (64, SwapConfig(64, 64, 128, num_warps=4, num_stages=4)),
    (256, SwapConfig(64, 128, 128, num_warps=4, num_stages=4)),
    (1024, SwapConfig(128, 256, 64, num_warps=8, num_stages=3)),
    (1 << 62, SwapConfig(128, 256, 64, num_warps=8, num_stages=4)),
)


def swap_config_for(rows: int) -> SwapConfig:
    return first_fit(SWAP_DEFAULTS, rows)


@triton.jit(do_not_specialize=_ROWS_ARGS)
def _w8a16_swap_kernel(
    x_ptr, q_ptr, scale_ptr, y_ptr,
    M, N, K,
    stride_xb, stride_xm, stride_qb, stride_sb, stride_yb, stride_ym,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
    MAGIC_FP16: tl.constexpr, EVEN_K: tl.constexpr, CONVERT_FIRST: tl.constexpr,
):  # fmt: skip
    batch = tl.program_id(1)
    pid_n, pid_m = _grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(M, BLOCK_M), GROUP_N)

    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < N
    row_ok = rows < M
    if CONVERT_FIRST:  # q's tile as stored, [BLOCK_K, BLOCK_N]
        q_tile = q_ptr + batch * stride_qb + ks[:, None] * N + cols[None, :]
    else:  # q^T's tile, [BLOCK_N, BLOCK_K]
        q_tile = q_ptr + batch * stride_qb + cols[:, None] + ks[None, :] * N
    x_tile = x_ptr + batch * stride_xb + rows[None, :] * stride_xm + ks[:, None]  # [BLOCK_K, BLOCK_M] of x^T
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:  # the model's K: no mask along the reduction
            if CONVERT_FIRST:
                b8 = tl.load(q_tile, mask=col_ok[None, :], other=0)
            else:
                b8 = tl.load(q_tile, mask=col_ok[:, None], other=0)
            xt = tl.load(x_tile, mask=row_ok[None, :], other=0.0)
        else:
            k_ok = ks + k0 * BLOCK_K < K
            if CONVERT_FIRST:
                b8 = tl.load(q_tile, mask=k_ok[:, None] & col_ok[None, :], other=0)
            else:
                b8 = tl.load(q_tile, mask=col_ok[:, None] & k_ok[None, :], other=0)
            xt = tl.load(x_tile, mask=k_ok[:, None] & row_ok[None, :], other=0.0)
        if MAGIC_FP16:
            w = ((b8.to(tl.int16) + 128) | 0x6400).to(tl.float16, bitcast=True) - 1152.0
        else:
            w = b8.to(xt.dtype)
        if CONVERT_FIRST:
            w = tl.trans(w)
        acc = tl.dot(w, xt, acc)
        q_tile += BLOCK_K * N
        x_tile += BLOCK_K
    scale = tl.load(scale_ptr + batch * stride_sb + cols, mask=col_ok, other=0.0)
    out = (acc * scale[:, None]).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + batch * stride_yb + rows[None, :] * stride_ym + cols[:, None], out, mask=col_ok[:, None] & row_ok[None, :])


def w8a16_swap_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, config: SwapConfig | None = None) -> torch.Tensor:
    """`w8a16_mm`'s product, computed as `y^T = (scale * q^T) x^T` (same operands, same result)."""
    B, M, K, N, y, strides = _product_frame(x, q, scale)
    if M == 0:
        return y
    tile = config or swap_config_for(M)
    grid = (triton.cdiv(N, tile.block_n) * triton.cdiv(M, tile.block_m), B)
    _w8a16_swap_kernel[grid](
        x, q, scale, y,
        M, N, K, *strides,
        BLOCK_N=tile.block_n, BLOCK_M=tile.block_m, BLOCK_K=tile.block_k, GROUP_N=tile.group_n,
        MAGIC_FP16=x.dtype == torch.float16, EVEN_K=K % tile.block_k == 0, CONVERT_FIRST=tile.convert_first,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip
    return y


# ---------------------------------------------------------------------------------------------
# Dequantization


@triton.jit
def _dequantize_kernel(q_ptr, scale_ptr, out_ptr, total, N, KN, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < total
    q = tl.load(q_ptr + offsets, mask=ok, other=0)
    scale = tl.load(scale_ptr + (offsets // KN) * N + offsets % N, mask=ok, other=0.0)
    tl.store(out_ptr + offsets, (q.to(tl.float32) * scale).to(out_ptr.dtype.element_ty), mask=ok)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`Int8Weight.dequantize` in one pass (read a byte, write `dtype`): the same fp32 product and
    one rounding, so the result equals the twin's bit for bit."""
    if q.dtype != torch.int8 or not q.is_contiguous() or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError("q must be contiguous int8 and scale contiguous fp32")
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    total = q.numel()
    if total:
        block = 4096
        _dequantize_kernel[(triton.cdiv(total, block),)](q, scale, out, total, q.shape[-1], q.shape[-2] * q.shape[-1], BLOCK=block)
    return out


@triton.jit
def _dequantize_columns_kernel(
    q_ptr, scale_ptr, out_ptr, K, N, start, width, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr
):  # fmt: skip
    """`out[b, k, c] = q[b, k, start + c] * scale[b, start + c]` for c < width: one slab of
    columns of a row-major `[B, K, N]` q, written contiguous `[B, K, width]`."""
    ks = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    cs = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    batch = tl.program_id(2).to(tl.int64)
    ok = (ks < K)[:, None] & (cs < width)[None, :]
    q = tl.load(q_ptr + batch * K * N + ks[:, None].to(tl.int64) * N + start + cs[None, :], mask=ok, other=0)
    scale = tl.load(scale_ptr + batch * N + start + cs, mask=cs < width, other=0.0)
    out = (q.to(tl.float32) * scale[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + batch * K * width + ks[:, None].to(tl.int64) * width + cs[None, :], out, mask=ok)


def dequantize_columns(q: torch.Tensor, scale: torch.Tensor, start: int, out: torch.Tensor) -> torch.Tensor:
    """Columns `start : start + width` of `q * scale` into `out [..., K, width]` (contiguous), in
    out's dtype: the same fp32 product and one rounding as `dequantize`."""
    if q.dtype != torch.int8 or not q.is_contiguous() or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError("q must be contiguous int8 and scale contiguous fp32")
    K, N, width = q.shape[-2], q.shape[-1], out.shape[-1]
    if not out.is_contiguous() or out.shape[:-1] != q.shape[:-1] or not 0 <= start <= start + width <= N:
        raise ValueError(f"cannot write columns {start}:{start + width} of q {list(q.shape)} into {list(out.shape)}")
    stack = q.shape[0] if q.dim() == 3 else 1
    if K and width:
        block_k, block_w = 32, 128
        grid = (triton.cdiv(K, block_k), triton.cdiv(width, block_w), stack)
        _dequantize_columns_kernel[grid](q, scale, out, K, N, start, width, BLOCK_K=block_k, BLOCK_W=block_w)
    return out


def slab_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, slab_bytes: int) -> torch.Tensor:
    """`x @ (q * scale)` a slab of output columns at a time: each slab (at most `slab_bytes` of the
    activation dtype, all matrices of a stack together) is dequantized into one reused buffer and
    multiplied by torch's product straight into its columns of y, so the dequantized weights are
    read back from L2 instead of memory."""
    _check_operands(x, q, scale)
    K, N = q.shape[-2], q.shape[-1]
    stack = q.shape[0] if q.dim() == 3 else 1
    y = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    columns = max(16, slab_bytes // (x.element_size() * stack * max(1, K)) // 16 * 16)
    columns = min(columns, N)
    buffer = torch.empty(stack * K * columns, dtype=x.dtype, device=x.device)
    product = torch.mm if q.dim() == 2 else torch.bmm
    for start in range(0, N, columns):
        width = min(columns, N - start)
        dense = buffer[: stack * K * width].view(*q.shape[:-1], width)
        dequantize_columns(q, scale, start, dense)
        product(x, dense, out=y[..., start : start + width])
    return y
