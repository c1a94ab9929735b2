# mypy: disable-error-code="no-untyped-def"
# (the @triton.jit functions are Triton's language, not Python that mypy can check)
"""The W8A16 tile kernel (Triton): `y = (x @ q) * scale` for more rows than the GEMV takes.

Each program owns a `BLOCK_M x BLOCK_N` tile of y: it walks K in `BLOCK_K` steps, loads an
activation tile and an int8 weight tile, converts the weights to the activation dtype in
registers and feeds both to the tensor cores (`tl.dot`, fp32 accumulation); the per-channel scale
multiplies the finished tile once. The weights are read once per row block, as int8.

fp16 weights are made from bytes without the int-to-float unit: a byte b, biased to b + 128, is
placed in the mantissa of 1024.0 in fp16 (`0x6400 | (b + 128)` = 1024 + b + 128, exact) and 1152
is subtracted. bf16 has too few mantissa bits for that and converts directly.

`w8a16_mm(x, q, scale)` picks the tile shape by row count (`CONFIGS`, measured on the H200:
docs/performance.md, "int8 weights"); `config=` overrides it for benchmarks. The twin is
`albatross.quant.int8_mm_torch`; tests run the kernel under Triton's CPU interpreter against it.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def config_for(rows: int) -> TileConfig:
    for most, config in CONFIGS:
        if rows <= most:
            return config
    return CONFIGS[-1][1]


@triton.jit
def _w8a16_kernel(
    x_ptr, q_ptr, scale_ptr, y_ptr,
    M, N, K,
    stride_xb, stride_xm, stride_qb, stride_sb, stride_yb, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    MAGIC_FP16: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    batch = tl.program_id(1)
    blocks_m = tl.cdiv(M, BLOCK_M)
    blocks_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * blocks_n
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size

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


def w8a16_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, config: TileConfig | None = None) -> torch.Tensor:
    """x `[M, K]` @ q `[K, N]` (or `[B, M, K]` @ `[B, K, N]`) times `scale [N]` (`[B, N]`)."""
    batched = q.dim() == 3
    if x.dim() != q.dim() or x.shape[-1] != q.shape[-2] or (batched and x.shape[0] != q.shape[0]):
        raise ValueError(f"cannot multiply x {list(x.shape)} by q {list(q.shape)}")
    if q.dtype != torch.int8 or not q.is_contiguous() or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError("q must be contiguous int8 and scale contiguous fp32")
    if x.stride(-1) != 1:
        raise ValueError("x must have unit stride along its last dimension")
    B = q.shape[0] if batched else 1
    M, K, N = x.shape[-2], q.shape[-2], q.shape[-1]
    y = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    tile = config or config_for(M)
    grid = (triton.cdiv(M, tile.block_m) * triton.cdiv(N, tile.block_n), B)
    _w8a16_kernel[grid](
        x, q, scale, y,
        M, N, K,
        x.stride(0) if batched else 0, x.stride(-2), K * N if batched else 0, N if batched else 0,
        y.stride(0) if batched else 0, y.stride(-2),
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
        MAGIC_FP16=x.dtype == torch.float16,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip
    return y


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
