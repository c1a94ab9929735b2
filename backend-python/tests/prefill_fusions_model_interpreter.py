"""Runs a small fp32 model's prefill on the CPU with the two prefill fusions' kernels
(albatross/relu_square_triton.py, albatross/lora_prep_triton.py) under Triton's CPU interpreter,
their dispatch forced on, against the same prefill without them, and prints one JSON line per
case: the model-level wiring (which rows take them, block 0's two LoRAs and v_first, the prefix
cache's captures) checked where no GPU is. In fp32 every rounding of the kernels is a no-op, so
the two paths differ only in the order of fp32 sums (test_prefill_fusions_model.py starts it in a
child process, because TRITON_INTERPRET must be set before the kernels are decorated).

    TRITON_INTERPRET=1 python tests/prefill_fusions_model_interpreter.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import triton_interpreter  # noqa: F401  (sets up the interpreter before the kernels are decorated)

from albatross import linear, lora_prep, lora_prep_triton, ops, relu_square_triton
from albatross.model import RWKV7
from albatross.random_checkpoint import CheckpointShape, random_state_dict

SMALL = relu_square_triton.Tiles(block_m=32, block_n=64, block_k=32, group_m=2, stages=2, warps=4)


def run(model: RWKV7, relu: bool, prep: bool, calls: list[str]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    real_applies, real_takes = lora_prep.applies, linear.takes_fused_relu_square

    def prep_applies(k: torch.Tensor, batch: ops.FlatBatch, down: torch.Tensor) -> bool:
        taken = prep and not batch.single_token
        calls.append("prep") if taken else None
        return taken

    def relu_takes(x: torch.Tensor, weight: object) -> bool:
        taken = relu and isinstance(weight, torch.Tensor) and x.shape[0] > 1
        calls.append("relu") if taken else None
        return taken

    lora_prep.applies, linear.takes_fused_relu_square = prep_applies, relu_takes
    try:
        pool = model.new_pool(3)
        prompts = [[(7 * i + 13 * s) % 65000 + 1 for i in range(n)] for s, n in enumerate((40, 21, 9))]
        logits, states = model.forward_saving(pool, [0, 1, 2], prompts, [[16, 32], [], [4]])
        decoded = model.forward(pool, [0, 1, 2], [[5], [6], [7]])  # decode rows: neither fusion
        return torch.cat([logits.flatten(), decoded.flatten()]), [s.wkv for slot in states for s in slot] + [pool.wkv.clone()]
    finally:
        lora_prep.applies, linear.takes_fused_relu_square = real_applies, real_takes


def main() -> None:
    relu_square_triton.TILES = SMALL
    relu_square_triton._sm_count = lambda device: 3  # the interpreter's "GPU": a small persistent grid
    lora_prep_triton.TILES = lora_prep_triton.Tiles(block_m=16, block_k=16)
    model = RWKV7.from_state_dict(random_state_dict(CheckpointShape(n_layer=3, n_embd=128), seed=4), "cpu", torch.float32, progress=False)
    base_logits, base_states = run(model, False, False, [])
    for name, relu, prep in (("relu^2 fused", True, False), ("LoRA + prep fused", False, True), ("both", True, True)):
        calls: list[str] = []
        logits, states = run(model, relu, prep, calls)
        print(json.dumps({
            "name": name, "relu_calls": calls.count("relu"), "prep_calls": calls.count("prep"),
            "logits": float((logits - base_logits).abs().max() / base_logits.abs().max()),
            "states": max(float((s - b).abs().max() / b.abs().max()) for s, b in zip(states, base_states)),
            "captures": len(states) - 1,
        }), flush=True)


if __name__ == "__main__":
    main()
