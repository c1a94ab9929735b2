"""A block's WKV step: `wkv_prep`, the WKV op (by `wkv_dispatch`) and `gn_bonus_gate`, or one of
two one-launch forms of the same step for decode rows (each row one slot's single token):

- `ops.wkv_decode_step`, the CUDA kernel (fused.cu) that runs the three kernels' own device code in
  one block per head and two rows (one with an fp32 state): bit-identical to the three ops, so it
  may serve every decode batch size without making a row's result depend on its batch. It takes
  every decode step on a GPU whose fused library has it (`set_step_op_allowed(False)` turns it off). On by default since an
  H100 showed the bit-identity (tests/test_wkv_decode_step_cuda.py, `bench/batch_drift.py`) and,
  with norm_mix's CUDA op, 151-154 -> 155-159 tok/s for fp16 and 197 -> 208 for int8 at batch 1,
  equal at 64 and 960 (docs/performance.md, session 12; `bench/bench_model.py --decode-ops on,off`).
- `wkv_decode_triton.prep_wkv_gate`, for 1-4 rows of fp16/bf16 with `set_fused_allowed(True)`:
  the same arithmetic in Triton, rounded differently (below).

The Triton form is off by default, though faster: on an H100 (7.2B, batch-1 CUDA graph, fused
LoRAs on) it is worth about 3% on its own, and with the one-launch norm + mix it took fp16 from
149-157 to 158-165 tok/s and int8 from 202 to 219-221 (docs/performance.md, session 11;
`bench/bench_model.py --fused-wkv on,off`). But a row of 1-4 then rounds differently from the
same row in a batch of 5 or more (as accurate against fp32, other fp16 roundings), and with both
on, the GPU test that a seeded request samples the same tokens alone and in a crowd failed once
in three engine modes: the API promises the same output whatever else runs. The CUDA form is the
way to have both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from albatross import ops, wkv_dispatch
from albatross.triton_paths import TritonPath

FUSED_BY_DEFAULT = False
_PATH = TritonPath(FUSED_BY_DEFAULT)
STEP_OP_BY_DEFAULT = True
_STEP_OP = ops.CudaOpSwitch("wkv_decode_step", STEP_OP_BY_DEFAULT)


def set_step_op_allowed(allowed: bool) -> None:
    """Let decode steps on a GPU take the CUDA `wkv_decode_step` op (benchmarks and tests compare)."""
    _STEP_OP.set_allowed(allowed)


def step_op_applies(k: torch.Tensor, batch: ops.FlatBatch) -> bool:
    """A decode step on a GPU whose fused library registered the op, with the op allowed."""
    return batch.single_token and k.is_cuda and _STEP_OP.usable()


def set_fused_allowed(allowed: bool) -> None:
    """Let decode steps of 1-4 rows on a GPU take the one-launch Triton kernel (benchmarks and tests compare)."""
    _PATH.set_allowed(allowed)


def fused_applies(k: torch.Tensor, batch: ops.FlatBatch) -> bool:
    return batch.single_token and _PATH.applies(k, k.shape[0])


@dataclass(frozen=True, slots=True)
class StepWeights:
    """A block's vectors the WKV step reads (`[C]` each); `v0` is None in block 0."""

    w0: torch.Tensor
    a0: torch.Tensor
    v0: torch.Tensor | None
    k_k: torch.Tensor
    k_a: torch.Tensor
    r_k: torch.Tensor
    ln_weight: torch.Tensor
    ln_bias: torch.Tensor


def prep_wkv_gate(
    state: torch.Tensor,
    batch: ops.FlatBatch,
    rkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    g: torch.Tensor,
    loras: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor],
    v_first: torch.Tensor | None,
    weights: StepWeights,
    saving: tuple[tuple[tuple[int, ...], ...], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The time mix's output before its projection `[T, C]`, from r, k, v, the gate g and the
    (value, decay, in-context rate) LoRA outputs; k and v (blocks 1+) are updated in place as
    `wkv_prep` does, and the slots' WKV states advance. The value LoRA, `v_first` and `weights.v0`
    are None in block 0, which has no value residual. `saving` (cuts, captures): the WKV states
    to capture inside the call (wkv_dispatch.wkv7), which only the three ops' path does."""
    if saving is not None:
        return prep_wkv_gate_torch(state, batch, rkv, g, loras, v_first, weights, saving)
    if step_op_applies(rkv[1], batch):
        r, k, v = rkv
        v_lora, w_lora, a_lora = loras
        w = weights
        return ops.wkv_decode_step(
            state, batch.slot_idx, r, k, v, g, w_lora, a_lora, v_lora, v_first, w.w0, w.a0, w.v0, w.k_k, w.k_a, w.r_k,
            w.ln_weight, w.ln_bias, ops.GROUP_NORM_EPS,
        )
    if fused_applies(rkv[1], batch):
        from albatross import wkv_decode_triton

        return wkv_decode_triton.prep_wkv_gate(state, batch.slot_idx, rkv, g, loras, v_first, weights, ops.GROUP_NORM_EPS)
    return prep_wkv_gate_torch(state, batch, rkv, g, loras, v_first, weights)


def prep_wkv_gate_torch(
    state: torch.Tensor,
    batch: ops.FlatBatch,
    rkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    g: torch.Tensor,
    loras: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor],
    v_first: torch.Tensor | None,
    weights: StepWeights,
    saving: tuple[tuple[tuple[int, ...], ...], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The three ops one after the other: the twin, and the path everywhere the kernel does not apply."""
    r, k, v = rkv
    v_lora, w_lora, a_lora = loras
    w, a, b = ops.wkv_prep(k, v, w_lora, a_lora, v_lora, v_first, weights.w0, weights.a0, weights.v0, weights.k_k, weights.k_a)
    return wkv_gate(state, batch, r, (w, k, v, a, b), g, weights, saving)


def wkv_gate(
    state: torch.Tensor,
    batch: ops.FlatBatch,
    r: torch.Tensor,
    prepared: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    g: torch.Tensor,
    weights: StepWeights,
    saving: tuple[tuple[tuple[int, ...], ...], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The WKV op and `gn_bonus_gate` on `wkv_prep`'s results (w, k, v, -kk, kk * a): the rest of
    the step after the prep, which `lora_prep` may have run fused with the LoRA up products."""
    w, k, v, a, b = prepared
    cuts, captures = saving if saving is not None else (None, None)
    y = wkv_dispatch.wkv7(state, batch, r, w, k, v, a, b, cuts=cuts, captures=captures)  # by the call's lengths
    return ops.gn_bonus_gate(y, r, k, v, g, weights.r_k, weights.ln_weight, weights.ln_bias)
