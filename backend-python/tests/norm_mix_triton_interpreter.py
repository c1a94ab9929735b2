"""Runs the one-launch layer norm + token-shift mix (albatross/norm_mix_triton.py) under Triton's
CPU interpreter against its twin (`norm_mix.norm_mix_torch`: `add_layer_norm` then `shift_mix`)
and prints one JSON line per case (test_norm_mix_triton.py starts it in a child process, because
TRITON_INTERPRET must be set before the kernel is decorated).

    TRITON_INTERPRET=1 python tests/norm_mix_triton_interpreter.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import triton_interpreter  # noqa: F401  (sets up the interpreter before the kernels are decorated)

from albatross import norm_mix, norm_mix_triton, ops

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# (name, slots of the rows, C, mixes (0: a coefficient vector), with a residual delta, dtype)
CASES = [
    ("one row, six mixes", [3], 256, 6, True, "fp32"),
    ("one row, one mix as a vector", [0], 256, 0, True, "fp32"),
    ("block 0: no residual yet", [1], 128, 6, False, "fp32"),
    ("four rows in shuffled slots, C off a power of two", [5, 0, 7, 2], 192, 6, True, "fp32"),
    ("two rows, fp16", [4, 1], 320, 6, True, "fp16"),
    ("three rows, fp16, one mix", [2, 6, 0], 256, 0, True, "fp16"),
    ("one row, bf16", [7], 128, 6, True, "bf16"),
]
POOL_SLOTS, LAYERS = 8, 2


def main() -> None:
    generator = torch.Generator().manual_seed(12)

    def randn(*shape: int, dtype: torch.dtype, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale + shift).to(dtype)

    for name, slots, C, K, with_delta, act in CASES:
        dtype = DTYPES[act]
        rows = len(slots)
        x = randn(rows, C, dtype=dtype, scale=2.0, shift=0.5)  # off-centre rows: the mean matters
        delta = randn(rows, C, dtype=dtype) if with_delta else None
        weight = randn(C, dtype=dtype, scale=0.5, shift=1.0)
        bias = randn(C, dtype=dtype, scale=0.2)
        coefficients = torch.rand(K, C, generator=generator).to(dtype) if K else torch.rand(C, generator=generator).to(dtype)
        pool = randn(LAYERS, POOL_SLOTS, C, dtype=dtype)  # a layer's shift vectors are a view, as in StatePool
        batch = ops.FlatBatch.build(slots, [1] * rows, torch.device("cpu"))

        want_x, want_pool = x.clone(), pool.clone()
        want = norm_mix.norm_mix_torch(want_x, delta, weight, bias, want_pool[1], batch, coefficients)
        got = norm_mix_triton.norm_mix(x, delta, weight, bias, pool[1], batch.slot_idx, coefficients, ops.LAYER_NORM_EPS)

        def error(a: torch.Tensor, b: torch.Tensor) -> float:
            return float((a.float() - b.float()).abs().max() / b.float().abs().max())

        print(json.dumps({
            "name": name, "act": act, "shape": list(got.shape), "want_shape": list(want.shape), "dtype": str(got.dtype),
            "mix_error": error(got, want), "x_error": error(x, want_x), "shift_error": error(pool, want_pool),
            "other_layer_untouched": bool(torch.equal(pool[0], want_pool[0])),
        }), flush=True)


if __name__ == "__main__":
    main()
