# mypy: ignore-errors
# (the @triton.jit function is Triton's language, not Python that mypy can check)
"""A block's WKV step for decode rows of 1-4 tokens in one launch (issue 16, batch-1 decode):
`wkv_prep`, `wkv7` and `gn_bonus_gate` (albatross/ops.py), three kernels a block today, each a
few us of launch-bound work at batch 1 (96 in a 7.2B step). When every row is one slot's single
token, one program per (row, head) can do all three, since a head's 64 channels and its 64 x 64
state are all that each step touches:

    prep     kk = normalize(k * k_k); a = sigmoid(a0 + a_lora); k *= 1 + (a - 1) * k_a;
             v += (v_first - v) * sigmoid(v0 + v_lora) (blocks 1+); w = -softplus(-(w0 + w_lora)) - 0.5
    step     S = S * exp(-exp(w)) + (S @ -kk) (kk * a)^T + v k^T;  y = S @ r
    output   (group_norm(y) + sum(r * k * r_k) * v) * g

Every value the three ops store in the activation dtype (k, v, w, -kk, kk * a, y) is rounded
where they round it; the arithmetic is fp32; only sums are added in another order. k and v are
updated in place as `wkv_prep` does. The twin is the three ops one after the other
(`albatross.wkv_decode.prep_wkv_gate_torch`); tests/wkv_decode_triton_interpreter.py runs the
kernel under Triton's CPU interpreter against it, tests/test_wkv_decode_cuda.py on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from albatross.triton_paths import launch_dependents
from albatross.wkv_decode import StepWeights

# A program's 64 x 64 state over 8 warps: 16 floats a thread. With 4 warps sm90's build of the fp16
# state with the value residual spilled (tests/test_decode_triton_sm90_compile.py).
NUM_WARPS = 8


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _prep_wkv_gate_kernel(
    r_ptr, k_ptr, v_ptr, g_ptr, w_lora_ptr, a_lora_ptr, v_lora_ptr, v_first_ptr,
    w0_ptr, a0_ptr, v0_ptr, k_k_ptr, k_a_ptr, r_k_ptr, ln_w_ptr, ln_b_ptr,
    state_ptr, slot_ptr, out_ptr,
    stride_r, stride_k, stride_v, stride_g, stride_wl, stride_al, stride_vl, stride_vf, stride_out, stride_state,
    eps,
    HAS_VALUE_LORA: tl.constexpr, N: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr,
):
    if LAUNCH_DEPENDENTS:  # the next kernel (a GEMV launched to overlap it, albatross/cuda/pdl.cuh) may start now
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    act = k_ptr.dtype.element_ty
    j = tl.arange(0, N)
    c = head * N + j

    # k and v are updated in place. A 64-wide vector is held by every warp, and a warp runs ahead
    # of the others: one that stored its result before a slower one loaded the input would feed it
    # the result (seen on an H100: 5-14% off, differing run to run). So every read of k and v
    # comes before the barrier and every write after it.
    k = tl.load(k_ptr + row * stride_k + c).to(tl.float32)
    v = tl.load(v_ptr + row * stride_v + c)
    tl.debug_barrier()

    # prep (wkv_prep): each stored result rounded to the activation dtype
    kk = k * tl.load(k_k_ptr + c).to(tl.float32)
    kk = kk / tl.maximum(tl.sqrt(tl.sum(kk * kk, axis=0)), 1e-12)
    a = _sigmoid(tl.load(a0_ptr + c).to(tl.float32) + tl.load(a_lora_ptr + row * stride_al + c).to(tl.float32))
    k_new = (k * (1.0 + (a - 1.0) * tl.load(k_a_ptr + c).to(tl.float32))).to(act)
    tl.store(k_ptr + row * stride_k + c, k_new)
    if HAS_VALUE_LORA:
        vf = v.to(tl.float32)
        first = tl.load(v_first_ptr + row * stride_vf + c).to(tl.float32)
        gate = _sigmoid(tl.load(v0_ptr + c).to(tl.float32) + tl.load(v_lora_ptr + row * stride_vl + c).to(tl.float32))
        v = (vf + (first - vf) * gate).to(act)
        tl.store(v_ptr + row * stride_v + c, v)
    z = -(tl.load(w0_ptr + c).to(tl.float32) + tl.load(w_lora_ptr + row * stride_wl + c).to(tl.float32))
    softplus = tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))  # torch's threshold
    w = (-softplus - 0.5).to(act).to(tl.float32)
    a_vec = (-kk).to(act).to(tl.float32)
    b_vec = (kk * a).to(act).to(tl.float32)
    k32 = k_new.to(tl.float32)
    v32 = v.to(tl.float32)

    # step (wkv7): S[i, j], i the value channel, j the key channel, in the state's dtype
    slot = tl.load(slot_ptr + row).to(tl.int64)
    i = tl.arange(0, N)
    s_ptrs = state_ptr + slot * stride_state + head * N * N + i[:, None] * N + j[None, :]
    S = tl.load(s_ptrs).to(tl.float32)
    sa = tl.sum(S * a_vec[None, :], axis=1)
    decay = tl.exp(-tl.exp(w))
    S = S * decay[None, :] + sa[:, None] * b_vec[None, :] + v32[:, None] * k32[None, :]
    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty))
    r = tl.load(r_ptr + row * stride_r + c).to(tl.float32)
    y = tl.sum(S * r[None, :], axis=1).to(act).to(tl.float32)  # [N] over i: the op returns y in the activation dtype

    # output (gn_bonus_gate)
    mean = tl.sum(y, axis=0) / N
    centred = y - mean
    rstd = tl.rsqrt(tl.sum(centred * centred, axis=0) / N + eps)
    bonus = tl.sum(r * k32 * tl.load(r_k_ptr + c).to(tl.float32), axis=0)
    ci = head * N + i
    normed = centred * rstd * tl.load(ln_w_ptr + ci).to(tl.float32) + tl.load(ln_b_ptr + ci).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g + ci).to(tl.float32)
    tl.store(out_ptr + row * stride_out + ci, ((normed + bonus * v32) * g).to(act))


def prep_wkv_gate(
    state: torch.Tensor,
    slot_idx: torch.Tensor,
    rkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    g: torch.Tensor,
    loras: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor],
    v_first: torch.Tensor | None,
    weights: StepWeights,
    eps: float,
) -> torch.Tensor:
    """`wkv_decode.prep_wkv_gate` for rows that are each one slot's single token: the output
    `[rows, C]`; k, v and each row's slot of `state` `[B, H, N, N]` are updated in place."""
    r, k, v = rkv
    v_lora, w_lora, a_lora = loras
    rows, C = k.shape
    B, H, N, _ = state.shape
    assert H * N == C and state.stride(1) == N * N and state.stride(2) == N and state.stride(3) == 1
    has_value_lora = v_lora is not None
    assert has_value_lora == (v_first is not None) == (weights.v0 is not None), "the value LoRA, v_first and v0 go together"
    operands = [r, k, v, g, w_lora, a_lora] + ([v_lora, v_first] if has_value_lora else [])
    assert all(t.stride(1) == 1 for t in operands), "rows with unit column stride"
    out = torch.empty((rows, C), dtype=k.dtype, device=k.device)
    if rows:
        _prep_wkv_gate_kernel[(rows, H)](
            r, k, v, g, w_lora, a_lora, v_lora if has_value_lora else v, v_first if has_value_lora else v,
            weights.w0, weights.a0, weights.v0 if has_value_lora else weights.w0, weights.k_k, weights.k_a, weights.r_k,
            weights.ln_weight, weights.ln_bias, state, slot_idx, out,
            r.stride(0), k.stride(0), v.stride(0), g.stride(0), w_lora.stride(0), a_lora.stride(0),
            v_lora.stride(0) if has_value_lora else 0, v_first.stride(0) if has_value_lora else 0, out.stride(0), state.stride(0),
            eps, HAS_VALUE_LORA=has_value_lora, N=N, LAUNCH_DEPENDENTS=launch_dependents(k.device), num_warps=NUM_WARPS,
        )  # fmt: skip
    return out
