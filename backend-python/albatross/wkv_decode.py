"""A block's WKV step: `wkv_prep`, the WKV op (by `wkv_dispatch`) and `gn_bonus_gate`, or, for
decode steps of 1-4 rows of fp16/bf16 on a GPU with `set_fused_allowed(True)`,
`wkv_decode_triton.prep_wkv_gate`: the same arithmetic in one launch instead of three, for
batch-1 decode where each is launch-bound (64 launches fewer a 7.2B step).

Off by default until the H200 has timed it (`bench/bench_model.py --fused-wkv on,off`).
"""

from __future__ import annotations

import importlib.util

import torch

from albatross import ops, wkv_dispatch

FUSED_BY_DEFAULT = False
MAX_ROWS = 4
_fused_allowed = FUSED_BY_DEFAULT
_TRITON = importlib.util.find_spec("triton") is not None  # CUDA builds of torch ship it
_DTYPES = (torch.float16, torch.bfloat16)


def set_fused_allowed(allowed: bool) -> None:
    """Let decode steps of 1-4 rows on a GPU take the one-launch Triton kernel (benchmarks and tests compare)."""
    global _fused_allowed
    _fused_allowed = allowed


def fused_applies(k: torch.Tensor, batch: ops.FlatBatch) -> bool:
    return _fused_allowed and _TRITON and k.is_cuda and k.dtype in _DTYPES and batch.single_token and k.shape[0] <= MAX_ROWS


def prep_wkv_gate(
    state: torch.Tensor,
    batch: ops.FlatBatch,
    r: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    w_lora: torch.Tensor,
    a_lora: torch.Tensor,
    v_lora: torch.Tensor | None,
    v_first: torch.Tensor | None,
    w0: torch.Tensor,
    a0: torch.Tensor,
    v0: torch.Tensor | None,
    k_k: torch.Tensor,
    k_a: torch.Tensor,
    r_k: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor,
) -> torch.Tensor:
    """The time mix's output before its projection `[T, C]`; k and v (blocks 1+) are updated in
    place as `wkv_prep` does, and the slots' WKV states advance. `v_lora`, `v_first` and `v0` are
    None in block 0, which has no value residual."""
    if fused_applies(k, batch):
        from albatross import wkv_decode_triton

        return wkv_decode_triton.prep_wkv_gate(
            state, batch.slot_idx, r, k, v, g, w_lora, a_lora, v_lora, v_first, w0, a0, v0, k_k, k_a, r_k, ln_weight, ln_bias,
            ops.GROUP_NORM_EPS,
        )  # fmt: skip
    return prep_wkv_gate_torch(state, batch, r, k, v, g, w_lora, a_lora, v_lora, v_first, w0, a0, v0, k_k, k_a, r_k, ln_weight, ln_bias)


def prep_wkv_gate_torch(
    state: torch.Tensor,
    batch: ops.FlatBatch,
    r: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    w_lora: torch.Tensor,
    a_lora: torch.Tensor,
    v_lora: torch.Tensor | None,
    v_first: torch.Tensor | None,
    w0: torch.Tensor,
    a0: torch.Tensor,
    v0: torch.Tensor | None,
    k_k: torch.Tensor,
    k_a: torch.Tensor,
    r_k: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor,
) -> torch.Tensor:
    """The three ops one after the other: the twin, and the path everywhere the kernel does not apply."""
    w, a, b = ops.wkv_prep(k, v, w_lora, a_lora, v_lora, v_first, w0, a0, v0, k_k, k_a)
    y = wkv_dispatch.wkv7(state, batch, r, w, k, v, a, b)  # sequential or chunked kernel, by the call's lengths
    return ops.gn_bonus_gate(y, r, k, v, g, r_k, ln_weight, ln_bias)
