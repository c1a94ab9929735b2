"""A block's residual layer norm followed by its token-shift mixes: `add_layer_norm` then
`shift_mix` (albatross/ops.py), or, for decode steps of 1-4 rows of fp16/bf16 on a GPU with
`set_fused_allowed(True)`, `norm_mix_triton.norm_mix`: the same arithmetic in one launch instead
of two, for batch-1 decode where both kernels are launch-bound (128 launches a 7.2B step).

Off by default, though faster: on an H100 (7.2B, batch-1 CUDA graph, fused LoRAs on) it is worth
about 3% on its own, and the two one-launch paths together took fp16 from 149-157 to 158-165
tok/s and int8 from 202 to 219-221 (docs/performance.md, session 11; `bench/bench_model.py
--fused-norm-mix on,off`). But a row of 1-4 then rounds differently from the same row in a batch of 5 or
more (as accurate against fp32, other fp16 roundings), and with both on the GPU test that a
seeded request samples the same tokens alone and in a crowd failed once in three engine modes:
the API promises the same output whatever else runs. Taking the kernel at every decode batch
size, so that a row's arithmetic does not depend on the batch, is the way to have both; it
waits for a batch-960 timing.
"""

from __future__ import annotations

import torch

from albatross import ops
from albatross.triton_paths import TritonPath

FUSED_BY_DEFAULT = False
_PATH = TritonPath(FUSED_BY_DEFAULT)


def set_fused_allowed(allowed: bool) -> None:
    """Let decode steps of 1-4 rows on a GPU take the one-launch Triton kernel (benchmarks and tests compare)."""
    _PATH.set_allowed(allowed)


def fused_applies(x: torch.Tensor, batch: ops.FlatBatch) -> bool:
    return batch.single_token and _PATH.applies(x, x.shape[0])


def norm_mix(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    shift_state: torch.Tensor,
    batch: ops.FlatBatch,
    coefficients: torch.Tensor,
) -> torch.Tensor:
    """`x += delta` in place (when given), then the token-shift mixes of `layer_norm(x)`:
    `[K, T, C]` for coefficients `[K, C]`, `[T, C]` for a vector; each slot's shift vector becomes
    its last row's norm."""
    if fused_applies(x, batch):
        from albatross import norm_mix_triton

        return norm_mix_triton.norm_mix(x, delta, weight, bias, shift_state, batch.slot_idx, coefficients, ops.LAYER_NORM_EPS)
    return norm_mix_torch(x, delta, weight, bias, shift_state, batch, coefficients)


def norm_mix_torch(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    shift_state: torch.Tensor,
    batch: ops.FlatBatch,
    coefficients: torch.Tensor,
) -> torch.Tensor:
    """The two ops one after the other: the twin, and the path everywhere the kernel does not apply."""
    h = ops.add_layer_norm(x, delta, weight, bias)
    return ops.shift_mix(h, shift_state, batch.slot_idx, batch.cu_seqlens, coefficients)
