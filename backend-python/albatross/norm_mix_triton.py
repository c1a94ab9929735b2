# mypy: ignore-errors
# (the @triton.jit function is Triton's language, not Python that mypy can check)
"""A block's residual layer norm and the token-shift mixes after it, in one launch, for decode
steps of 1-4 rows (issue 16, batch-1 decode).

Each block starts its time mix with `add_layer_norm` then `shift_mix` (six mixes), and its channel
mix with the same pair (one mix): four kernels a block, 128 in a 7.2B step, each a few us of
launch-bound work at batch 1. When every row is one slot's single token (a decode step), a row's
previous token is its slot's saved shift vector, so both fit one program per row:

    x += delta (rounded to the dtype, stored)       h = layer_norm(x) (fp32, rounded to the dtype)
    prev = shift[slot]; shift[slot] = h             out[k] = h + (prev - h) * coefficients[k]

The arithmetic is the CUDA kernels' (fp32 from stored values, each stored result rounded once);
only the layer norm's sums are added in another order. The twin is the pair of ops
(`albatross.norm_mix.norm_mix_torch`); tests/norm_mix_triton_interpreter.py runs the kernel under
Triton's CPU interpreter against it, tests/test_norm_mix_cuda.py on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from albatross.triton_paths import launch_dependents


@triton.jit
def _norm_mix_kernel(
    x_ptr, delta_ptr, weight_ptr, bias_ptr, shift_ptr, slot_ptr, coef_ptr, out_ptr,
    C, eps, stride_x, stride_delta, stride_shift, stride_out_k, stride_out_row,
    HAS_DELTA: tl.constexpr, K: tl.constexpr, BLOCK_C: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr,
):
    if LAUNCH_DEPENDENTS:  # the next kernel (a GEMV launched to overlap it, albatross/cuda/pdl.cuh) may start now
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    live = offs < C
    x_row = x_ptr + row.to(tl.int64) * stride_x + offs
    x = tl.load(x_row, mask=live, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row.to(tl.int64) * stride_delta + offs, mask=live, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(x_ptr.dtype.element_ty)  # as stored
        # x (and below the shift row) is read and then written in place. Where C is small enough
        # that several warps hold the same element, one warp could store before another loaded:
        # the barrier orders every read before the write (wkv_decode_triton.py saw that race).
        tl.debug_barrier()
        tl.store(x_row, x, mask=live)
    xf = x.to(tl.float32)
    mean = tl.sum(xf, axis=0) / C
    centred = tl.where(live, xf - mean, 0.0)
    variance = tl.sum(centred * centred, axis=0) / C
    weight = tl.load(weight_ptr + offs, mask=live, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + offs, mask=live, other=0.0).to(tl.float32)
    h = (centred * tl.rsqrt(variance + eps) * weight + bias).to(shift_ptr.dtype.element_ty)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    shift_row = shift_ptr + slot * stride_shift + offs
    prev = tl.load(shift_row, mask=live, other=0.0).to(tl.float32)
    tl.debug_barrier()
    tl.store(shift_row, h, mask=live)
    hf = h.to(tl.float32)
    for k in tl.static_range(K):
        coef = tl.load(coef_ptr + k * C + offs, mask=live, other=0.0).to(tl.float32)
        mixed = hf + (prev - hf) * coef
        tl.store(out_ptr + k * stride_out_k + row.to(tl.int64) * stride_out_row + offs, mixed.to(out_ptr.dtype.element_ty), mask=live)


def norm_mix(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    shift_state: torch.Tensor,
    slot_idx: torch.Tensor,
    coefficients: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """`shift_mix(add_layer_norm(x, delta, weight, bias), shift_state, ...)` for rows that are each
    one slot's single token: `[K, rows, C]` for coefficients `[K, C]`, `[rows, C]` for `[C]`.
    `x` is updated in place, as is each row's slot of `shift_state`."""
    rows, C = x.shape
    assert x.stride(1) == 1 and shift_state.stride(1) == 1 and slot_idx.numel() == rows
    assert delta is None or (delta.shape == x.shape and delta.stride(1) == 1)
    coef = coefficients.reshape(-1, C).contiguous()
    K = coef.shape[0]
    out = torch.empty((K, rows, C), dtype=x.dtype, device=x.device)
    if rows:
        block = triton.next_power_of_2(C)
        _norm_mix_kernel[(rows,)](
            x, delta if delta is not None else x, weight, bias, shift_state, slot_idx, coef, out,
            C, eps, x.stride(0), delta.stride(0) if delta is not None else 0, shift_state.stride(0), out.stride(0), out.stride(1),
            HAS_DELTA=delta is not None, K=K, BLOCK_C=block, LAUNCH_DEPENDENTS=launch_dependents(x.device), num_warps=max(1, min(16, block // 256)),
        )  # fmt: skip
    return out if coefficients.dim() > 1 else out[0]
