"""Which implementation multiplies activations by an int8 weight, by the call's row count.

- 1-4 rows on a GPU: the split-K GEMV kernel (`albatross/cuda/int8_gemv.cu`), which reads each
  weight byte once and dequantizes in registers, so a batch-1 decode step reads half the bytes of
  fp16 weights;
- up to `TILE_MAX_ROWS` rows on a GPU: the Triton tile kernel (`albatross/int8_triton.py`), int8
  tiles converted to the activation dtype in registers and fed to the tensor cores;
- more rows, or no kernel: dequantize to the activation dtype, then the float product (cuBLAS on a
  GPU; the torch twin `quant.int8_mm_torch` on the CPU). Large matrices are dequantized a slab of
  columns at a time, so the temporary stays under `DEQUANTIZE_SLAB` elements.

The thresholds are the measured crossovers (docs/performance.md, "int8 weights"); every path is
tested against the twin.
"""

from __future__ import annotations

import importlib.util

import torch

from albatross import linear, ops
from albatross.quant import Int8Weight, int8_mm_torch

GEMV_MAX_ROWS = 4
TILE_MAX_ROWS = 1024
DEQUANTIZE_SLAB = 1 << 25  # elements of one dequantized temporary (64 MB in fp16)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)

_allowed = {"gemv": True, "tile": True}  # benchmarks switch paths off to compare
_gemv_loaded = False  # latched once the int8 library has registered the op's CUDA kernel
_triton = importlib.util.find_spec("triton") is not None


def set_allowed(gemv: bool | None = None, tile: bool | None = None) -> None:
    """Let products take the GEMV or the tile kernel (both by default), or keep them off."""
    if gemv is not None:
        _allowed["gemv"] = gemv
    if tile is not None:
        _allowed["tile"] = tile


def gemv_enabled() -> bool:
    """Allowed, and the int8 library loaded (cuda_ops.enable_cuda_kernels). A loaded kernel stays
    registered, so True is remembered; until then each call asks the dispatcher."""
    global _gemv_loaded
    if not _gemv_loaded:
        _gemv_loaded = torch._C._dispatch_has_kernel_for_dispatch_key(f"{ops.NAMESPACE}::int8_gemv", "CUDA")
    return _allowed["gemv"] and _gemv_loaded


def tile_enabled() -> bool:
    """Allowed, and Triton installed (it comes with CUDA builds of torch) with a GPU to run on."""
    return _allowed["tile"] and _triton and torch.cuda.is_available()


def enabled() -> dict[str, bool]:
    return {"gemv": gemv_enabled(), "tile": tile_enabled()}


def dequantize_above_rows(device_type: str) -> int:
    """The most rows a product takes without dequantizing a slab (for the memory plan)."""
    if device_type != "cuda":
        return 0
    return TILE_MAX_ROWS if tile_enabled() else GEMV_MAX_ROWS if gemv_enabled() else 0


def path_for(x: torch.Tensor, weight: Int8Weight) -> str:
    """"gemv", "tile" or "dequantize": what `int8_mm` runs for these operands."""
    if not (x.is_cuda and x.dtype in _KERNEL_DTYPES and x.stride(-1) == 1):
        return "dequantize"
    rows = x.shape[-2]
    if rows <= GEMV_MAX_ROWS and weight.q.shape[-1] % 16 == 0 and gemv_enabled():
        return "gemv"
    if rows <= TILE_MAX_ROWS and tile_enabled():
        return "tile"
    return "dequantize"


def int8_gemv(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """The CUDA kernel: x `[R, K]` or `[B, R, K]`, R <= 4."""
    return ops.int8_gemv(x, weight.q, weight.scale, linear.counters(x.device))


def int8_tile(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    from albatross import int8_triton  # Triton is imported only where a GPU path runs

    return int8_triton.w8a16_mm(x, weight.q, weight.scale)


def _dense_product(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    if x.is_cuda and tile_enabled():  # one Triton pass, equal to the twin's dequantization
        from albatross import int8_triton

        q, scale = weight.q.contiguous(), weight.scale.contiguous()
        dense = int8_triton.dequantize(q, scale, x.dtype)
        return torch.mm(x, dense) if dense.dim() == 2 else torch.bmm(x, dense)
    return int8_mm_torch(x, weight)


def int8_dequantized(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """Dequantize-then-matmul, a slab of output columns at a time for large matrices."""
    K, N = weight.q.shape[-2], weight.q.shape[-1]
    stack = weight.q.shape[0] if weight.q.dim() == 3 else 1
    if stack * K * N <= DEQUANTIZE_SLAB:
        return _dense_product(x, weight)
    columns = max(16, DEQUANTIZE_SLAB // (stack * K) // 16 * 16)
    parts = [
        _dense_product(x, Int8Weight(weight.q[..., start : start + columns], weight.scale[..., start : start + columns]))
        for start in range(0, N, columns)
    ]
    return torch.cat(parts, dim=-1)


_PATHS = {"gemv": int8_gemv, "tile": int8_tile, "dequantize": int8_dequantized}


def int8_mm(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """`x @ W` for an int8 `W`: `[R, K] -> [R, N]`, `[B, R, K] -> [B, R, N]` for a stack."""
    if x.dim() != weight.q.dim() or x.shape[-1] != weight.q.shape[-2]:
        raise ValueError(f"cannot multiply x {list(x.shape)} by an int8 weight {list(weight.q.shape)}")
    return _PATHS[path_for(x, weight)](x, weight)
