"""Runs the chunked WKV Triton kernels under Triton's CPU interpreter against their torch twin
and prints one JSON line per case (test_wkv_chunked.py starts it in a child process, because
TRITON_INTERPRET must be set before the kernels are decorated).

    TRITON_INTERPRET=1 python tests/wkv_chunked_interpreter.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from albatross.wkv_chunked import wkv7_chunked_torch
from wkv_reference import flat_batch_args, wkv_inputs

import triton_interpreter  # noqa: F401  (sets up the interpreter before the kernels are decorated)

from albatross.wkv_chunked_triton import wkv7_chunked_triton

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# (name, lengths, heads, activations, state, value block, log-decay scale or None, strided rows,
# chunk length, key-major scan, the prepare pass's inverse)
CASES = [
    ("one token", [1], 1, "fp32", "fp32", 16, None, False, 16),
    ("one chunk exactly", [16], 2, "fp32", "fp32", 32, None, False, 16),
    ("one past a chunk", [17], 1, "fp32", "fp32", 64, None, False, 16),
    ("mixed slots, an empty one", [5, 1, 130, 0, 17], 2, "fp16", "fp32", 16, None, False, 16),
    ("fp16 state", [33, 2], 1, "fp16", "fp16", 32, None, False, 16),
    ("bf16 state", [40], 1, "bf16", "bf16", 16, None, False, 16),
    ("strided rows", [20, 9], 1, "fp16", "fp32", 16, None, True, 16),
    ("decays outside the model's range", [40, 3], 1, "fp32", "fp32", 64, 3.0, False, 16),
    ("257 tokens", [257], 1, "fp16", "fp32", 64, None, False, 16),  # 4,097 runs on the GPU (test_wkv_chunked_cuda.py)
    ("chunks of 32: mixed slots, an empty one", [70, 0, 5, 32], 2, "fp32", "fp32", 16, None, False, 32),
    ("chunks of 32: decays outside the model's range", [50, 3], 1, "fp32", "fp32", 32, 3.0, False, 32),
    ("chunks of 64: fp16 state, strided rows", [130, 1], 1, "fp16", "fp16", 32, None, True, 64),
    ("key-major: mixed slots, an empty one", [5, 1, 130, 0, 17], 2, "fp32", "fp32", 16, None, False, 16, True),
    ("key-major: bf16 state, strided rows", [40, 9], 1, "bf16", "bf16", 32, None, True, 16, True),
    ("key-major: decays outside the model's range", [40, 3], 1, "fp32", "fp32", 64, 3.0, False, 16, True),
    ("key-major: chunks of 32, fp16 state", [70, 2], 1, "fp16", "fp16", 16, None, False, 32, True),
    # the prepare pass inverting I - M by squaring instead of row by row
    ("squaring: mixed slots, an empty one", [5, 1, 130, 0, 17], 2, "fp32", "fp32", 16, None, False, 16, False, "squaring"),
    ("squaring: decays outside the model's range", [40, 3], 1, "fp32", "fp32", 64, 3.0, False, 16, False, "squaring"),
    ("squaring: chunks of 32", [70, 0, 5, 32], 2, "fp32", "fp32", 16, None, False, 32, False, "squaring"),
    ("squaring: chunks of 64, fp16 state", [130, 1], 1, "fp16", "fp16", 32, None, True, 64, False, "squaring"),
]


def run_case(
    name: str, lengths: list[int], heads: int, act: str, state_dtype: str, block: int, scale: float | None, strided: bool, chunk: int,
    key_major: bool = False, inverse: str = "substitution",
) -> dict:
    gen = torch.Generator().manual_seed(len(name))
    inputs = wkv_inputs(lengths, heads, DTYPES[act], gen, log_decay_scale=scale)
    if strided:  # rows of a wider tensor, as the r/k/v views of one bmm output are
        inputs = [torch.cat([x, torch.zeros_like(x)], dim=1)[:, : x.shape[1]] for x in inputs]
    pool = len(lengths) + 2
    slot_idx, cu = flat_batch_args(lengths, pool, gen)
    state = (torch.randn(pool, heads, 64, 64, generator=gen) * 0.3).to(DTYPES[state_dtype])
    twin_state = state.clone()
    twin_y = wkv7_chunked_torch(twin_state, slot_idx, cu, *inputs, chunk=chunk)
    kernel_state = state.clone()
    kernel_y = wkv7_chunked_triton(kernel_state, slot_idx, cu, *inputs, lengths=lengths, block_values=block, chunk=chunk, key_major=key_major,
                                   prepare_inverse=inverse)
    untouched = [s for s in range(pool) if s not in slot_idx.tolist()]
    return {
        "case": name,
        "act_dtype": act,
        "state_dtype": state_dtype,
        "y_diff": (kernel_y.double() - twin_y.double()).abs().max().item(),
        "y_scale": twin_y.double().abs().max().item(),
        "state_diff": (kernel_state.double() - twin_state.double()).abs().max().item(),
        "state_scale": twin_state.double().abs().max().item(),
        "untouched_equal": bool(torch.equal(kernel_state[untouched], state[untouched])),
        "finite": bool(torch.isfinite(kernel_y).all() and torch.isfinite(kernel_state).all()),
    }


if __name__ == "__main__":
    for case in CASES:
        print(json.dumps(run_case(*case)), flush=True)
