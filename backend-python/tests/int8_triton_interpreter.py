"""Runs the W8A16 Triton kernels (the tile kernel, the swap-AB kernel, the L2-slab product and the
dequantizers) under Triton's CPU interpreter against their torch twin and prints one JSON line
per case (test_int8_triton.py starts it in a child process, because
TRITON_INTERPRET must be set before the kernel is decorated).

    TRITON_INTERPRET=1 python tests/int8_triton_interpreter.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import triton_interpreter  # noqa: F401  (sets up the interpreter before the kernels are decorated)

from albatross import int8_triton
from albatross.quant import Int8Weight, int8_mm_torch, quantize

# No bf16: the interpreter computes on NumPy arrays, which have no bfloat16 (its conversions do not
# round as the GPU does); test_int8_cuda.py runs every kernel in bf16 on a GPU.
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
SMALL = int8_triton.TileConfig(16, 16, 32, group_m=2)
SMALL_SWAP = int8_triton.SwapConfig(16, 16, 32, group_n=2)
SMALL_SWAP_CF = int8_triton.SwapConfig(16, 16, 32, group_n=2, convert_first=True)

# (name, rows, K, N, stack, activations, config or None for the row count's default, strided rows)
CASES = [
    ("one row", 1, 64, 48, None, "fp32", SMALL, False),
    ("K and N off the tile", 17, 100, 40, None, "fp32", SMALL, False),
    ("fp16 bytes through the 1024 mantissa", 23, 96, 80, None, "fp16", SMALL, False),
    ("a stack of three (r/k/v)", 5, 64, 32, 3, "fp16", SMALL, False),
    ("rows of a wider tensor", 9, 64, 48, None, "fp16", SMALL, True),
    ("default tile for 16 rows", 16, 256, 64, None, "fp16", None, False),
    ("default tile for 64 rows", 64, 256, 128, None, "fp16", None, False),
    ("default tile for 256 rows", 200, 128, 256, None, "fp16", None, False),
    ("default tile for many rows", 300, 128, 256, None, "fp16", None, False),
]
# The same for the swap-AB kernel (K 100: the masked reduction; 64, 128: EVEN_K).
SWAP_CASES = [
    ("swap: one row", 1, 64, 48, None, "fp32", SMALL_SWAP, False),
    ("swap: K and N off the tile", 17, 100, 40, None, "fp32", SMALL_SWAP, False),
    ("swap: fp16 bytes through the 1024 mantissa", 23, 96, 80, None, "fp16", SMALL_SWAP, False),
    ("swap: a stack of three (r/k/v)", 5, 64, 32, 3, "fp16", SMALL_SWAP, False),
    ("swap: rows of a wider tensor", 9, 64, 48, None, "fp16", SMALL_SWAP, True),
    ("swap: convert first, K and N off the tile", 17, 100, 40, None, "fp32", SMALL_SWAP_CF, False),
    ("swap: convert first, fp16 stack", 23, 64, 80, 3, "fp16", SMALL_SWAP_CF, False),
    ("swap: default for 64 rows", 61, 128, 80, None, "fp16", None, False),
    ("swap: default for 200 rows", 200, 128, 72, None, "fp16", None, False),
]
# The L2-slab product: (name, rows, K, N, stack, activations, slab bytes, strided rows); the slabs
# are cut narrower than N, the last one ragged.
SLAB_CASES = [
    ("slab: four slabs, the last ragged", 7, 64, 200, None, "fp32", 64 * 48 * 4, False),
    ("slab: fp16, one slab", 9, 32, 48, None, "fp16", 1 << 20, False),
    ("slab: fp16 stack of three", 5, 48, 80, 3, "fp16", 3 * 48 * 32 * 2, False),
    ("slab: fp16 strided rows", 6, 64, 96, None, "fp16", 64 * 32 * 2, True),
]


def _operands(gen: torch.Generator, rows: int, K: int, N: int, stack: int | None, act: str, strided: bool) -> tuple[torch.Tensor, Int8Weight]:
    lead = () if stack is None else (stack,)
    weight = quantize(torch.randn(*lead, K, N, generator=gen))
    x = torch.randn(*lead, rows, 2 * K if strided else K, generator=gen).to(DTYPES[act])
    return (x[..., K // 2 : K // 2 + K] if strided else x), weight


def _report(name: str, act: str, y: torch.Tensor, x: torch.Tensor, weight: Int8Weight, **extra: object) -> None:
    expected = int8_mm_torch(x.float(), weight)
    error = float((y.float() - expected).abs().max() / expected.abs().max())
    print(json.dumps({"name": name, "dtype": str(y.dtype), "shape": list(y.shape), "expected_shape": list(expected.shape),
                      "act": act, "error": error, **extra}), flush=True)


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    for name, rows, K, N, stack, act, config, strided in CASES:
        x, weight = _operands(gen, rows, K, N, stack, act, strided)
        _report(name, act, int8_triton.w8a16_mm(x, weight.q, weight.scale, config), x, weight)
    for name, rows, K, N, stack, act, swap, strided in SWAP_CASES:
        x, weight = _operands(gen, rows, K, N, stack, act, strided)
        _report(name, act, int8_triton.w8a16_swap_mm(x, weight.q, weight.scale, swap), x, weight)
    for name, rows, K, N, stack, act, slab_bytes, strided in SLAB_CASES:
        x, weight = _operands(gen, rows, K, N, stack, act, strided)
        y = int8_triton.slab_mm(x, weight.q, weight.scale, slab_bytes)
        # each slab is the product with the twin's own dequantized columns, bit for bit
        dense = weight.dequantize(x.dtype)
        columns = min(N, max(16, slab_bytes // (x.element_size() * (stack or 1) * K) // 16 * 16))
        exact = all(
            torch.equal(y[..., s : s + columns], torch.matmul(x, dense[..., s : s + columns].contiguous()))
            for s in range(0, N, columns)
        )
        _report(name, act, y, x, weight, slabs=-(-N // columns), slab_exact=exact)
    for shape in [(64, 48), (3, 33, 80)]:  # the CUDA dequantize path's one-pass kernel: equal to the twin
        weight = quantize(torch.randn(*shape, generator=gen))
        for act, dtype in DTYPES.items():
            exact = torch.equal(int8_triton.dequantize(weight.q, weight.scale, dtype), weight.dequantize(dtype))
            print(json.dumps({"name": f"dequantize {list(shape)}", "act": act, "exact": exact}), flush=True)
            for start, width in ((0, shape[-1]), (16, 17), (shape[-1] - 5, 5)):  # the slab path's column kernel
                out = torch.empty(*shape[:-1], width, dtype=dtype)
                got = int8_triton.dequantize_columns(weight.q, weight.scale, start, out)
                exact = torch.equal(got, weight.dequantize(dtype)[..., start : start + width])
                print(json.dumps({"name": f"dequantize columns {start}:{start + width} of {list(shape)}", "act": act, "exact": exact}), flush=True)


if __name__ == "__main__":
    main()
