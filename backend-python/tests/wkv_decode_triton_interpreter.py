"""Runs the one-launch decode WKV step (albatross/wkv_decode_triton.py) under Triton's CPU
interpreter against its twin (`wkv_decode.prep_wkv_gate_torch`: `wkv_prep`, `wkv7`,
`gn_bonus_gate`) and prints one JSON line per case (test_wkv_decode_triton.py starts it in a
child process, because TRITON_INTERPRET must be set before the kernel is decorated).

    TRITON_INTERPRET=1 python tests/wkv_decode_triton_interpreter.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import triton_interpreter  # noqa: F401  (sets up the interpreter before the kernels are decorated)

from albatross import ops, wkv_decode, wkv_decode_triton

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
N = 64
POOL_SLOTS = 6
# (name, slots of the rows, heads, block 0 (no value residual), activation dtype, state dtype)
CASES = [
    ("one row, block 1+", [2], 2, False, "fp32", "fp32"),
    ("one row, block 0", [0], 2, True, "fp32", "fp32"),
    ("four rows in shuffled slots", [4, 0, 5, 1], 2, False, "fp32", "fp32"),
    ("two rows, fp16, fp16 state", [3, 1], 3, False, "fp16", "fp16"),
    ("three rows, fp16, fp32 state, block 0", [5, 2, 0], 2, True, "fp16", "fp32"),
    ("one row, bf16, bf16 state", [1], 2, False, "bf16", "bf16"),
]


def main() -> None:
    generator = torch.Generator().manual_seed(14)

    def randn(*shape: int, dtype: torch.dtype, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale + shift).to(dtype)

    for name, slots, H, block0, act, state_act in CASES:
        dtype, state_dtype = DTYPES[act], DTYPES[state_act]
        rows, C = len(slots), H * N
        mix = randn(3, rows, C, dtype=dtype)  # r, k, v as the model has them: views of one product
        r, k, v = mix.unbind(0)
        g = torch.sigmoid(randn(rows, C, dtype=torch.float32)).to(dtype)
        lora = randn(3, rows, C, dtype=dtype, scale=0.5)  # value, decay, in-context rate
        v_first = randn(rows, C, dtype=dtype)
        w0 = randn(C, dtype=dtype, scale=0.5, shift=-1.0)
        a0 = randn(C, dtype=dtype, scale=0.5)
        v0 = randn(C, dtype=dtype, scale=0.5)
        k_k = randn(C, dtype=dtype, scale=0.2, shift=0.8)
        k_a = randn(C, dtype=dtype, scale=0.2, shift=1.0)
        r_k = randn(C, dtype=dtype, scale=0.3)
        ln_w = randn(C, dtype=dtype, scale=0.3, shift=1.0)
        ln_b = randn(C, dtype=dtype, scale=0.1)
        state = randn(POOL_SLOTS, H, N, N, dtype=state_dtype, scale=0.5)
        value = (None, None, None) if block0 else (lora[0], v_first, v0)
        batch = ops.FlatBatch.build(slots, [1] * rows, torch.device("cpu"))

        want_state, want_mix = state.clone(), mix.clone()
        wr, wk, wv = want_mix.unbind(0)
        weights = wkv_decode.StepWeights(w0, a0, value[2], k_k, k_a, r_k, ln_w, ln_b)
        want = wkv_decode.prep_wkv_gate_torch(want_state, batch, (wr, wk, wv), g, (value[0], lora[1], lora[2]), value[1], weights)
        got = wkv_decode_triton.prep_wkv_gate(state, batch.slot_idx, (r, k, v), g, (value[0], lora[1], lora[2]), value[1], weights, ops.GROUP_NORM_EPS)

        def error(a: torch.Tensor, b: torch.Tensor) -> float:
            return float((a.float() - b.float()).abs().max() / b.float().abs().max())

        others = [s for s in range(POOL_SLOTS) if s not in slots]
        print(json.dumps({
            "name": name, "act": act, "state": state_act, "shape": list(got.shape), "want_shape": list(want.shape), "dtype": str(got.dtype),
            "out_error": error(got, want), "k_error": error(k, wk), "v_error": error(v, wv), "r_untouched": bool(torch.equal(r, wr)),
            "state_error": error(state[slots], want_state[slots]), "other_slots_untouched": bool(torch.equal(state[others], want_state[others])),
        }), flush=True)


if __name__ == "__main__":
    main()
