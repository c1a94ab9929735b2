"""A block's residual layer norm followed by its token-shift mixes: `add_layer_norm` then
`shift_mix` (albatross/ops.py), or a one-launch form of the same: `ops.norm_mix_rows` for calls
with prompt chunks (below), or one of two for decode rows (each row one slot's single token),
where both kernels are launch-bound at batch 1 (128 launches a 7.2B step):

- `ops.norm_mix_decode`, the CUDA kernel (fused.cu) that runs the two kernels' own device code in
  one block per row: bit-identical to them, so it may serve every decode batch size without making
  a row's result depend on its batch. It takes every decode step on a GPU whose fused library has
  it, when the rows are as the model's always are (a multiple of 8 channels, up to 8192, 16-byte
  aligned: what the two ops' vectorised kernels need); `set_op_allowed(False)` turns it off. On by
  default since an H100 showed the bit-identity and the gain, with wkv_decode's CUDA op
  (tests/test_norm_mix_decode_cuda.py; docs/performance.md, session 12).
- `norm_mix_triton.norm_mix`, for 1-4 rows of fp16/bf16 with `set_fused_allowed(True)`: the same
  arithmetic in Triton, rounded differently.

The Triton form is off by default, though faster: on an H100 (7.2B, batch-1 CUDA graph, fused
LoRAs on) it is worth about 3% on its own, and with the one-launch WKV step it took fp16 from
149-157 to 158-165 tok/s and int8 from 202 to 219-221 (docs/performance.md, session 11;
`bench/bench_model.py --fused-norm-mix on,off`). But a row of 1-4 then rounds differently from
the same row in a batch of 5 or more (as accurate against fp32, other fp16 roundings), and with
both on, the GPU test that a seeded request samples the same tokens alone and in a crowd failed
once in three engine modes: the API promises the same output whatever else runs. The CUDA form
is the way to have both.

`ops.norm_mix_rows` (fused.cu) takes the other calls on a GPU (rows of prompt chunks, with
decode rows riding along): the two kernels' device code in one launch, bit-identical to them,
which writes the new residual to a new tensor instead of x (its blocks read rows that others
update). It saves the normed rows' round trip through memory: 19 row vectors of a 7.2B block's
two norms become 13. On by default (`set_rows_op_allowed(False)` turns it off) since an H100
showed the bit-identity and the gain: one 7.2B layer's norms at 64 x 512 rows 8-12% faster, the
64 x 512 prefill +0.3% (docs/performance.md, session 20; `bench/bench_norm_mix_rows.py`,
`bench/bench_model.py --norm-rows-op off,on,off,on`).
"""

from __future__ import annotations

import torch

from albatross import ops
from albatross.triton_paths import TritonPath

FUSED_BY_DEFAULT = False
_PATH = TritonPath(FUSED_BY_DEFAULT)
OP_BY_DEFAULT = True
_OP = ops.CudaOpSwitch("norm_mix_decode", OP_BY_DEFAULT)
ROWS_OP_BY_DEFAULT = True
_ROWS_OP = ops.CudaOpSwitch("norm_mix_rows", ROWS_OP_BY_DEFAULT)
_VEC = 8  # channels a thread moves in one 16-byte access
_MAX_C = 8192  # a row in registers: add_layer_norm's limit


def set_op_allowed(allowed: bool) -> None:
    """Let decode steps on a GPU take the CUDA `norm_mix_decode` op (benchmarks and tests compare)."""
    _OP.set_allowed(allowed)


def set_rows_op_allowed(allowed: bool) -> None:
    """Let calls with prompt chunks on a GPU take the CUDA `norm_mix_rows` op (benchmarks and tests compare)."""
    _ROWS_OP.set_allowed(allowed)


def op_applies(x: torch.Tensor, delta: torch.Tensor | None, operands: tuple[torch.Tensor, ...], batch: ops.FlatBatch) -> bool:
    """A decode step on a GPU whose fused library registered the op, with rows the two ops would
    give their vectorised kernels (so the op matches those): C a multiple of 8 up to 8192, and
    x, delta and `operands` (weight, bias, shift state, coefficients) 16-byte aligned."""
    return batch.single_token and _vector_rows(x, delta, operands) and _OP.usable()


def rows_op_applies(x: torch.Tensor, delta: torch.Tensor | None, operands: tuple[torch.Tensor, ...], batch: ops.FlatBatch) -> bool:
    """A call with prompt chunks on a GPU whose fused library registered the op, with a residual
    to add (the op writes the sum out of place) and rows as `op_applies` asks."""
    return not batch.single_token and delta is not None and _vector_rows(x, delta, operands) and _ROWS_OP.usable()


def _vector_rows(x: torch.Tensor, delta: torch.Tensor | None, operands: tuple[torch.Tensor, ...]) -> bool:
    if not (x.is_cuda and x.shape[1] % _VEC == 0 and x.shape[1] <= _MAX_C):
        return False
    shift = operands[2]
    aligned = all(t.data_ptr() % 16 == 0 for t in (x, *operands, *((delta,) if delta is not None else ())))
    return aligned and shift.stride(0) % _VEC == 0


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """The new residual `x + delta` (when given) and the token-shift mixes of its layer norm:
    `[K, T, C]` for coefficients `[K, C]`, `[T, C]` for a vector; each slot's shift vector becomes
    its last row's norm. The residual is x itself, updated in place, or a new tensor
    (`norm_mix_rows`); the caller goes on with the one returned."""
    operands = (weight, bias, shift_state, coefficients)
    if op_applies(x, delta, operands, batch):
        return x, ops.norm_mix_decode(x, delta, weight, bias, shift_state, batch.slot_idx, coefficients, ops.LAYER_NORM_EPS)
    if delta is not None and rows_op_applies(x, delta, operands, batch):
        x_new, mixes = ops.norm_mix_rows(x, delta, weight, bias, shift_state, batch.slot_idx, batch.cu_seqlens, coefficients, ops.LAYER_NORM_EPS)
        return x_new, mixes
    if fused_applies(x, batch):
        from albatross import norm_mix_triton

        return x, norm_mix_triton.norm_mix(x, delta, weight, bias, shift_state, batch.slot_idx, coefficients, ops.LAYER_NORM_EPS)
    return x, norm_mix_torch(x, delta, weight, bias, shift_state, batch, coefficients)


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
