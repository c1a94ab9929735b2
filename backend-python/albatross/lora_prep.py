"""Where a block's LoRA up products and `wkv_prep` run as one kernel (`lora_prep_triton.py`):
calls of many prompt rows on an sm90 GPU, in fp16/bf16, when allowed. Everywhere else, and in
every decode step (the CUDA `wkv_decode_step` op takes those), the `bmm` then `ops.wkv_prep`.

Off by default until `bench/bench_lora_prep.py` has timed it on a GPU (docs/kernels.md).
"""

from __future__ import annotations

import torch

from albatross import ops, triton_paths
from albatross.triton_paths import TritonPath

FUSED_BY_DEFAULT = False
MIN_ROWS = 1024  # a placeholder until the benchmark shows the row count it wins from
_PATH = TritonPath(FUSED_BY_DEFAULT)


def set_fused_allowed(allowed: bool) -> None:
    """Let many-row calls take the fused kernel (benchmarks and tests compare)."""
    _PATH.set_allowed(allowed)


def applies(k: torch.Tensor, batch: ops.FlatBatch, lora_down: torch.Tensor) -> bool:
    """The fused kernel's preconditions for a call: many rows, not a decode step, 16-bit
    activations and LoRAs on a Hopper GPU, heads of 64 channels."""
    return (
        _PATH.allowed
        and not batch.single_token
        and k.shape[0] >= MIN_ROWS
        and k.dtype in triton_paths.DTYPES
        and lora_down.dtype == k.dtype
        and k.shape[1] % ops.HEAD_SIZE == 0
        and k.stride(1) == 1
        and triton_paths.hopper(k.device)
    )
