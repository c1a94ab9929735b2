"""Which implementation multiplies activations by an int8 weight, by the call's row count.

The paths (all on a GPU with fp16/bf16 activations; anything else takes "dequantize"):
- "gemv", 1-`GEMV_MAX_ROWS` rows: the split-K GEMV kernel (`albatross/cuda/int8_gemv.cu`), which
  reads each weight byte once and dequantizes in registers, so a batch-1 decode step reads half
  the bytes of fp16 weights;
- "tile": the Triton tile kernel (`int8_triton.w8a16_mm`), int8 tiles converted in registers and
  fed to the tensor cores as the right operand;
- "swap": the swap-AB Triton kernel (`int8_triton.w8a16_swap_mm`), the weights as the left operand
  (on Hopper, straight from registers into wgmma);
- "slab": dequantize `L2_SLAB_BYTES` of output columns at a time into a buffer that stays in L2,
  multiply each with cuBLAS (`int8_triton.slab_mm`);
- "dequantize": dequantize the matrix (a slab of at most `DEQUANTIZE_SLAB` elements at a time),
  then the float product (cuBLAS on a GPU; the torch twin `quant.int8_mm_torch` on the CPU).

Above the GEMV's rows, `ROW_PATHS` (first match) picks the path: the one table of thresholds,
from the measured crossovers (docs/performance.md, "int8 weights"; `bench_int8.py kernels` prints
the table its figures suggest). Every path is tested against the twin.
"""

from __future__ import annotations

import importlib.util

import torch

from albatross import linear, ops
from albatross.quant import Int8Weight, int8_mm_torch

# Measured on the H200 (docs/performance.md, "Session 5"; 7.2B products, CUDA graphs over rotated
# weights): at 1 row the GEMV runs at 1.03-1.53x of fp16 cuBLAS, at 4 rows 0.48-0.83x where the
# tile kernel runs at 0.75-0.90x; 2 rows (not measured) stays with the GEMV, whose cost barely
# grows from 1 row to 2. From 5 to 1,024 rows the swap-AB kernel with SWAP_DEFAULTS' configs beats
# the tile kernel everywhere (64 rows 0.61-1.13x against 0.39-0.96x; 960 rows 0.81-0.83x against
# 0.50-0.52x); above, the 16 MB slab path (0.82-0.93x at 4,096 rows against 0.67-0.90x).
GEMV_MAX_ROWS = 2
# (most rows, path) for more rows than the GEMV takes, first match wins.
ROW_PATHS: tuple[tuple[int, str], ...] = ((1024, "swap"), (1 << 62, "slab"))
DEQUANTIZE_SLAB = 1 << 25  # elements of one dequantized temporary (64 MB in fp16)
L2_SLAB_BYTES = 16 << 20  # one "slab" path buffer: inside the H200's 50 MB L2 with x and y beside it (16 MB beat 8 and 2)
PATHS = ("gemv", "tile", "swap", "slab", "dequantize")
_TRITON_PATHS = ("tile", "swap", "slab")
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)

_allowed = dict.fromkeys(PATHS, True)  # benchmarks and tests switch paths off to compare
_gemv_loaded = False  # latched once the int8 library has registered the op's CUDA kernel
_triton = importlib.util.find_spec("triton") is not None


def set_allowed(gemv: bool | None = None, tile: bool | None = None, swap: bool | None = None, slab: bool | None = None) -> None:
    """Let products take a kernel path (all are allowed by default), or keep it off: a path that is
    off falls back to "dequantize"."""
    for path, allowed in (("gemv", gemv), ("tile", tile), ("swap", swap), ("slab", slab)):
        if allowed is not None:
            _allowed[path] = allowed


def gemv_enabled() -> bool:
    """Allowed, and the int8 library loaded (cuda_ops.enable_cuda_kernels). A loaded kernel stays
    registered, so True is remembered; until then each call asks the dispatcher."""
    global _gemv_loaded
    if not _gemv_loaded:
        _gemv_loaded = torch._C._dispatch_has_kernel_for_dispatch_key(f"{ops.NAMESPACE}::int8_gemv", "CUDA")
    return _allowed["gemv"] and _gemv_loaded


def triton_enabled(path: str = "tile") -> bool:
    """A Triton path ("tile", "swap", "slab"): allowed, and Triton installed (it comes with CUDA
    builds of torch) with a GPU to run on."""
    return _allowed[path] and _triton and torch.cuda.is_available()


def tile_enabled() -> bool:
    return triton_enabled("tile")


def enabled() -> dict[str, bool]:
    return {"gemv": gemv_enabled(), **{path: triton_enabled(path) for path in _TRITON_PATHS}}


def row_path(rows: int) -> str:
    """`ROW_PATHS`' path for `rows` (more than the GEMV takes), or "dequantize" where that path is off."""
    path = next((path for most, path in ROW_PATHS if rows <= most), "dequantize")
    return path if path == "dequantize" or triton_enabled(path) else "dequantize"


def dequantize_above_rows(device_type: str) -> int:
    """The most rows a product takes without a dequantized temporary (for the memory plan): the
    GEMV's, then the kernel entries of `ROW_PATHS` up to the first that dequantizes."""
    if device_type != "cuda":
        return 0
    most = GEMV_MAX_ROWS if gemv_enabled() else 0
    for bound, _ in ROW_PATHS:
        if row_path(bound) in ("slab", "dequantize"):
            break
        most = max(most, bound)
    return most


def path_for(x: torch.Tensor, weight: Int8Weight) -> str:
    """One of `PATHS`: what `int8_mm` runs for these operands."""
    if not (x.is_cuda and x.dtype in _KERNEL_DTYPES and x.stride(-1) == 1):
        return "dequantize"
    rows = x.shape[-2]
    if rows <= GEMV_MAX_ROWS and weight.q.shape[-1] % 16 == 0 and gemv_enabled():
        return "gemv"
    return row_path(rows)


def int8_gemv(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """The CUDA kernel: x `[R, K]` or `[B, R, K]`, R <= 4."""
    return ops.int8_gemv(x, weight.q, weight.scale, linear.counters(x.device))


def int8_tile(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    from albatross import int8_triton  # Triton is imported only where a GPU path runs

    return int8_triton.w8a16_mm(x, weight.q, weight.scale)


def int8_swap(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    from albatross import int8_triton

    return int8_triton.w8a16_swap_mm(x, weight.q, weight.scale)


def int8_slab(x: torch.Tensor, weight: Int8Weight, slab_bytes: int | None = None) -> torch.Tensor:
    from albatross import int8_triton

    return int8_triton.slab_mm(x, weight.q, weight.scale, L2_SLAB_BYTES if slab_bytes is None else slab_bytes)


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


_PATHS = {"gemv": int8_gemv, "tile": int8_tile, "swap": int8_swap, "slab": int8_slab, "dequantize": int8_dequantized}


def int8_mm(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """`x @ W` for an int8 `W`: `[R, K] -> [R, N]`, `[B, R, K] -> [B, R, N]` for a stack."""
    if x.dim() != weight.q.dim() or x.shape[-1] != weight.q.shape[-2]:
        raise ValueError(f"cannot multiply x {list(x.shape)} by an int8 weight {list(weight.q.shape)}")
    return _PATHS[path_for(x, weight)](x, weight)
