"""The time-mix's small LoRAs: value (blocks 1+), decay and in-context rate, stacked (`[n, C, R]`
down, `[n, R, C]` up, docs/model.md), and the gate (`g1`, `g2`).

`loras_torch` is the eager path and the twin: two bmm for the stack with the decay's tanh between,
two mm for the gate with its sigmoid. With `set_fused_allowed(True)`, 1-4 rows of fp16/bf16 on a
GPU take `lora_triton.fused_loras` instead: the same arithmetic in two launches instead of six,
for batch-1 decode, where each of those kernels is launch-bound. On by default: on the H200 (7.2B,
batch-1 CUDA graph) it took fp16 from 171 to 185 tok/s and int8 from 211 to 229
(docs/performance.md, session 10).
"""

from __future__ import annotations

import torch

from albatross import linear
from albatross.triton_paths import TritonPath

FUSED_BY_DEFAULT = True
_PATH = TritonPath(FUSED_BY_DEFAULT)


def set_fused_allowed(allowed: bool) -> None:
    """Let 1-4 rows on a GPU take the two-launch Triton kernels (benchmarks and tests compare)."""
    _PATH.set_allowed(allowed)


def fused_applies(mixes: torch.Tensor) -> bool:
    return _PATH.applies(mixes, mixes.shape[1])


def loras_torch(
    mixes: torch.Tensor, lora_down: torch.Tensor, lora_up: torch.Tensor, g1: torch.Tensor, g2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(lora `[n, rows, C]`: the stack's outputs in its order, gate `[rows, C]`) from the six token
    mixes `[6, rows, C]` (r, k, v, w, a, g): the stack takes (v, w, a), or (w, a) in block 0."""
    hidden, gate = hidden_and_gate(mixes, lora_down, g1, g2)
    return linear.bmm(hidden, lora_up), gate


def hidden_and_gate(mixes: torch.Tensor, lora_down: torch.Tensor, g1: torch.Tensor, g2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The stack's hidden rows `[n, rows, R]` (its down products, the decay's tanh applied) and the
    gate `[rows, C]`: all of the LoRAs but the stack's up products, which `lora_prep` can take
    together with `wkv_prep`."""
    stacked = lora_down.shape[0]
    hidden = linear.bmm(mixes[5 - stacked : 5], lora_down)
    hidden[-2].tanh_()  # the decay LoRA's nonlinearity; the others are linear
    return hidden, linear.mm(torch.sigmoid(linear.mm(mixes[5], g1)), g2)


def block_loras(
    mixes: torch.Tensor, lora_down: torch.Tensor, lora_up: torch.Tensor, g1: torch.Tensor, g2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if fused_applies(mixes):
        from albatross import lora_triton  # Triton is imported only where a GPU path runs

        return lora_triton.fused_loras(mixes, lora_down, lora_up, g1, g2)
    return loras_torch(mixes, lora_down, lora_up, g1, g2)
