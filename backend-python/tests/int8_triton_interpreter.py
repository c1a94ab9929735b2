"""Runs the W8A16 Triton tile kernel under Triton's CPU interpreter against its torch twin and
prints one JSON line per case (test_int8_triton.py starts it in a child process, because
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
from albatross.quant import int8_mm_torch, quantize

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
SMALL = int8_triton.TileConfig(16, 16, 32, group_m=2)

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


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    for name, rows, K, N, stack, act, config, strided in CASES:
        lead = () if stack is None else (stack,)
        weight = quantize(torch.randn(*lead, K, N, generator=gen))
        dtype = DTYPES[act]
        x = torch.randn(*lead, rows, 2 * K if strided else K, generator=gen).to(dtype)
        if strided:
            x = x[..., K // 2 : K // 2 + K]
        y = int8_triton.w8a16_mm(x, weight.q, weight.scale, config)
        expected = int8_mm_torch(x.float(), weight)
        error = float((y.float() - expected).abs().max() / expected.abs().max())
        print(json.dumps({"name": name, "dtype": str(y.dtype), "shape": list(y.shape), "expected_shape": list(expected.shape),
                          "act": act, "error": error}), flush=True)
    for shape in [(64, 48), (3, 33, 80)]:  # the CUDA dequantize path's one-pass kernel: equal to the twin
        weight = quantize(torch.randn(*shape, generator=gen))
        for act, dtype in DTYPES.items():
            exact = torch.equal(int8_triton.dequantize(weight.q, weight.scale, dtype), weight.dequantize(dtype))
            print(json.dumps({"name": f"dequantize {list(shape)}", "act": act, "exact": exact}), flush=True)


if __name__ == "__main__":
    main()
