"""Runs the key product with its relu^2 epilogue (albatross/relu_square_triton.py) under Triton's
CPU interpreter and prints one JSON line per case: how it differs from the unfused path
(`relu_square_torch` of the fp32 product rounded to fp16), and both paths' errors against float64
(test_relu_square_triton.py starts it in a child process, because TRITON_INTERPRET must be set
before the kernel is decorated).

    TRITON_INTERPRET=1 python tests/relu_square_triton_interpreter.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import triton_interpreter  # noqa: F401  (sets up the interpreter before the kernel is decorated)

from albatross import ops, relu_square_triton
from albatross.relu_square_triton import Tiles

# fp16 only: Triton 3.6's interpreter returns garbage for bf16 through tensor descriptors (the GPU tests
# run bf16)
DTYPES = {"fp16": torch.float16}
SMALL = Tiles(block_m=32, block_n=32, block_k=16, group_m=2, stages=2, warps=4)
# (name, M, K, N, dtype, tiles, programs, x as rows of a wider tensor)
CASES = [
    ("tiles exactly", 64, 32, 64, "fp16", SMALL, 4, False),
    ("every size off the tiles", 70, 40, 96, "fp16", SMALL, 5, False),
    ("fewer programs than tiles, groups cut short", 100, 48, 64, "fp16", Tiles(32, 32, 16, 3, 2, 4), 3, False),
    ("one row", 1, 32, 64, "fp16", SMALL, 4, False),
    ("whole tile stored at once", 50, 32, 64, "fp16", Tiles(32, 32, 16, 2, 2, 4, split_epilogue=False), 2, False),
    ("rows of a wider tensor", 33, 32, 64, "fp16", SMALL, 4, True),
    ("more programs than tiles", 20, 16, 32, "fp16", SMALL, 7, False),
    ("warp-specialized: masked plain stores", 70, 40, 96, "fp16", Tiles(32, 32, 16, 2, 2, 4, warp_specialize=True), 5, False),
]


def main() -> None:
    generator = torch.Generator().manual_seed(31)
    for name, M, K, N, act, tiles, programs, wide in CASES:
        dtype = DTYPES[act]
        x = torch.randn(M, K + 8 if wide else K, generator=generator).to(dtype)
        if wide:
            x = x[:, 8:]  # row stride K + 8, 16-byte aligned start
        weight = (torch.randn(K, N, generator=generator) * K**-0.5).to(dtype)
        got = relu_square_triton.product_relu_square(x, weight, tiles, programs)
        exact = torch.relu(x.double() @ weight.double()).square()
        unfused = ops.relu_square_torch((x.float() @ weight.float()).to(dtype))  # cuBLAS rounds the product, then the pass
        scale = float(exact.abs().max())
        print(json.dumps({
            "name": name, "act": act, "shape": list(got.shape), "want_shape": [M, N], "dtype": str(got.dtype),
            "error": float((got.double() - exact).abs().max()) / scale,
            "unfused_error": float((unfused.double() - exact).abs().max()) / scale,
            # against the unfused path: elements that differ, and the largest difference relative
            # to the element (a product that rounds to the neighbouring fp16 value, squared)
            "mismatch_fraction": float((got != unfused).double().mean()),
            "worst_mismatch": float(((got.double() - unfused.double()).abs() / (unfused.double().abs() + 2.0**-24)).max()),
            # relu's zeros stay zeros; a zero elsewhere only where the square is below fp16's least
            # subnormal (2**-24), which rounds to 0
            "negatives": int((got < 0).sum()), "missed_zeros": int(((exact == 0) & (got != 0)).sum()),
            "spurious_zeros": int(((got == 0) & (exact >= 2.0**-24)).sum()),
        }), flush=True)


if __name__ == "__main__":
    main()
