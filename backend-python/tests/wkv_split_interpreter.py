"""Runs a forward call split between the WKV kernels (wkv_dispatch.run_parts: the chunked Triton
kernel under Triton's CPU interpreter on its run of long slots, the sequential twin on the slots
around it) against the sequential twin over the whole call, and prints one JSON line per case
(test_wkv_chunked.py starts it in a child process: TRITON_INTERPRET must be set first).

    TRITON_INTERPRET=1 python tests/wkv_split_interpreter.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from albatross import ops, wkv_dispatch
from wkv_reference import wkv_inputs

import triton_interpreter  # noqa: F401  (sets up the interpreter before the kernels are decorated)

from albatross import wkv_chunked_triton

POLICY = wkv_dispatch.ChunkedPolicy(min_tokens=20, max_long_heads=4)  # short enough for the interpreter
CASES = [  # (name, lengths, heads, cuts per slot or None)
    ("decode rows, then a long slot", [1, 1, 40, 1], 1, None),
    ("short slots around two long ones", [3, 40, 33, 1, 1], 2, None),
    ("one long slot alone", [41], 1, None),
    # the prefix cache's states inside a long chunk: 3 tokens on the sequential kernel, then the
    # chunked kernel copies the state out after its chunks 0 and 2 (cuts 19 and 51)
    ("captures inside a long slot", [1, 70, 1], 2, ((), (3, 19, 51), ())),
    ("captures off the chunk ends: sequential pieces", [70, 1], 1, ((5, 30), ())),
]


def run_case(name: str, lengths: list[int], heads: int, cuts: tuple[tuple[int, ...], ...] | None) -> dict:
    gen = torch.Generator().manual_seed(len(name))
    inputs = wkv_inputs(lengths, heads, torch.float32, gen)
    pool = len(lengths) + 3
    slots = torch.randperm(pool, generator=gen)[: len(lengths)].tolist()
    batch = ops.FlatBatch.build(slots, lengths, torch.device("cpu"))
    policy_lengths = batch.lengths if cuts is None else tuple(wkv_dispatch._policy_length(n, c) for n, c in zip(batch.lengths, cuts))
    run = POLICY.chunked_run(policy_lengths, heads)
    parts = wkv_dispatch.split_parts(batch, run, wkv_chunked_triton.chunk_offsets, cuts)
    state = torch.randn(pool, heads, 64, 64, generator=gen) * 0.3
    split_state, whole_state = state.clone(), state.clone()
    count = sum(len(c) for c in cuts) if cuts else 0
    captures = torch.full((count, heads, 64, 64), float("nan"))

    def chunked(*args: object, **options: object) -> torch.Tensor:
        return wkv_chunked_triton.wkv7_chunked_triton(*args, precision="ieee", **options)  # type: ignore[arg-type]

    split_y = wkv_dispatch.run_parts(split_state, parts, tuple(inputs), chunked, ops.wkv7, captures)
    whole_y = ops.wkv7_torch(whole_state, batch.slot_idx, batch.cu_seqlens, *inputs)
    capture_diff, index, start = 0.0, 0, 0
    for call_slot, length in enumerate(lengths):
        for cut in cuts[call_slot] if cuts else ():
            alone = state.clone()
            one = ops.FlatBatch.build([slots[call_slot]], [cut], torch.device("cpu"))
            ops.wkv7_torch(alone, one.slot_idx, one.cu_seqlens, *(x[start : start + cut] for x in inputs))
            capture_diff = max(capture_diff, (captures[index] - alone[slots[call_slot]]).abs().max().item())
            index += 1
        start += length
    return {
        "case": name,
        "parts": [(p.chunked, p.row_start, p.row_stop) for p in parts],
        "y_diff": (split_y - whole_y).abs().max().item(),
        "y_scale": whole_y.abs().max().item(),
        "state_diff": (split_state - whole_state).abs().max().item(),
        "state_scale": whole_state.abs().max().item(),
        "capture_diff": capture_diff,
    }


if __name__ == "__main__":
    for case in CASES:
        print(json.dumps(run_case(*case)), flush=True)
