"""Runs the fused LoRA up products + `wkv_prep` (albatross/lora_prep_triton.py) under Triton's CPU
interpreter against the unfused path's arithmetic, and prints one JSON line per case
(test_lora_prep_triton.py starts it in a child process, because TRITON_INTERPRET must be set
before the kernel is decorated).

The reference is the CUDA path's: the up products rounded to fp16 as the bmm stores them, then
`wkv_prep`'s arithmetic in fp32 from those fp16 values, each output rounded once (the op's torch
twin on fp32 copies), so only the order of the fp32 sums can differ.

    TRITON_INTERPRET=1 python tests/lora_prep_triton_interpreter.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import triton_interpreter  # noqa: F401  (sets up the interpreter before the kernel is decorated)

from albatross import lora_prep_triton, ops
from albatross.lora_prep_triton import Tiles

# (name, rows, heads, stacked LoRAs, rank, tiles, k/v as rows of a wider tensor)
CASES = [
    ("blocks 1+: three LoRAs", 64, 2, 3, 32, Tiles(block_m=32, block_k=16), False),
    ("block 0: two LoRAs, v untouched", 40, 2, 2, 32, Tiles(block_m=32, block_k=16), False),
    ("rows and rank off the tiles", 37, 1, 3, 40, Tiles(block_m=16, block_k=32), False),
    ("one row", 1, 2, 3, 32, Tiles(block_m=16, block_k=16), False),
    ("k and v as rows of the r/k/v stack", 20, 2, 3, 32, Tiles(block_m=16, block_k=16), True),
]


def main() -> None:
    generator = torch.Generator().manual_seed(41)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).half()

    for name, rows, heads, n, R, tiles, strided in CASES:
        C = heads * ops.HEAD_SIZE
        if strided:  # k and v views of a [3, rows, C] product, as the model's unbind gives them
            stack = randn(3, rows, C)
            k, v = stack[1], stack[2]
        else:
            k, v = randn(rows, C), randn(rows, C)
        hidden = randn(n, rows, R)
        up = randn(n, R, C, scale=R**-0.5)
        v_first = randn(rows, C) if n == 3 else None
        w0, a0, k_k, k_a = randn(C), randn(C), randn(C), (torch.rand(C, generator=generator)).half()
        v0 = randn(C) if n == 3 else None

        lora = (hidden.float() @ up.float()).half()  # as the bmm stores it
        v_lora = lora[0] if n == 3 else None
        ref_k, ref_v = k.float().clone(), v.float().clone()
        want = ops.wkv_prep_torch(
            ref_k, ref_v, lora[-2].float(), lora[-1].float(), None if v_lora is None else v_lora.float(),
            None if v_first is None else v_first.float(), w0.float(), a0.float(), None if v0 is None else v0.float(),
            k_k.float(), k_a.float(),
        )  # fmt: skip
        v_before = v.clone()
        got = lora_prep_triton.lora_prep(hidden, up, k, v, v_first, w0, a0, v0, k_k, k_a, tiles)

        def compare(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
            want16 = want.half()
            return {
                "differ": float((got != want16).double().mean()),
                "worst": float((got.double() - want16.double()).abs().max() / want16.double().abs().max()),
            }

        print(json.dumps({
            "name": name, "dtypes": sorted({str(t.dtype) for t in (*got, k, v)}),
            "w": compare(got[0], want[0]), "a": compare(got[1], want[1]), "b": compare(got[2], want[2]),
            "k": compare(k, ref_k), "v": compare(v, ref_v),
            "v_untouched": bool(torch.equal(v, v_before)), "stacked": n,
        }), flush=True)


if __name__ == "__main__":
    main()
