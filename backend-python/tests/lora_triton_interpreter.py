"""Runs the fused LoRA kernels (albatross/lora_triton.py) under Triton's CPU interpreter against
their twin (`loras.loras_torch`, the eager path) and prints one JSON line per case
(test_lora_triton.py starts it in a child process, because TRITON_INTERPRET must be set before
the kernels are decorated).

    TRITON_INTERPRET=1 python tests/lora_triton_interpreter.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import triton_interpreter  # noqa: F401  (sets up the interpreter before the kernels are decorated)

from albatross import lora_triton, loras

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
# (name, rows, C, stacked LoRAs, their padded rank R, gate rank G, dtype, mixes as a strided view)
CASES = [
    ("one row, three LoRAs", 1, 128, 3, 32, 48, "fp32", False),
    ("block 0: two LoRAs", 1, 128, 2, 32, 48, "fp32", False),
    ("two rows, ranks off the tiles", 2, 128, 3, 40, 72, "fp32", False),
    ("three rows, C off the tiles and the splits", 3, 100, 3, 24, 40, "fp32", False),
    ("four rows, fp16", 4, 192, 3, 32, 80, "fp16", False),
    ("one row, fp16, block 0", 1, 128, 2, 64, 64, "fp16", False),
    ("rows of a wider mix tensor", 2, 128, 3, 32, 48, "fp32", True),
    ("C wide enough for every split", 1, 512, 3, 32, 48, "fp16", False),
]


def main() -> None:
    generator = torch.Generator().manual_seed(8)

    def randn(*shape: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    for name, rows, C, n, R, G, act, strided in CASES:
        dtype = DTYPES[act]
        mixes = randn(6, rows + 2 if strided else rows, C, scale=1.0, dtype=dtype)
        if strided:
            mixes = mixes[:, 1 : rows + 1]
        down = randn(n, C, R, scale=C**-0.5, dtype=dtype)
        up = randn(n, R, C, scale=R**-0.5, dtype=dtype)
        g1 = randn(C, G, scale=C**-0.5, dtype=dtype)
        g2 = randn(G, C, scale=G**-0.5, dtype=dtype)
        lora, gate = lora_triton.fused_loras(mixes, down, up, g1, g2)
        want_lora, want_gate = loras.loras_torch(mixes, down, up, g1, g2)

        def error(got: torch.Tensor, want: torch.Tensor) -> float:
            return float((got.float() - want.float()).abs().max() / want.float().abs().max())

        print(json.dumps({
            "name": name, "act": act, "lora_shape": list(lora.shape), "want_lora_shape": list(want_lora.shape),
            "gate_shape": list(gate.shape), "want_gate_shape": list(want_gate.shape),
            "dtypes": [str(lora.dtype), str(gate.dtype)],
            "lora_error": error(lora, want_lora), "gate_error": error(gate, want_gate),
            "decay_error": error(lora[-2], want_lora[-2]),
        }), flush=True)


if __name__ == "__main__":
    main()
