# mypy: disable-error-code="no-untyped-def, attr-defined"
# (the @triton.jit functions are Triton's language, not Python that mypy can check)
"""The chunked-parallel WKV-7 prefill as Triton kernels (the algorithm and its torch twin:
`albatross.wkv_chunked`). Importing this module needs triton; nothing is compiled until the
first call on a GPU (Triton caches the build per shape class).

Two launches per call:
1. `_chunk_prepare_kernel`, one program per (slot, chunk, head): everything of a chunk that does
   not depend on the state it starts from, which is all of the chunk's L x L work. The unit
   lower-triangular inverse `T = (I - M_ab)^-1` by forward substitution, then the chunk's "WY"
   factors `W = T Ra`, `U = T M_ak V`, `Q = Rr + M_rb W`, `Yv = M_rb U + M_rk V` and the decayed
   keys `Bd = Bi exp(c_last)`, `Kd = Ki exp(c_last)`, into an fp32 scratch `[H, 6, rows, N]`
   indexed by the call's rows, so a slot of one token (a decode row riding along) takes one row,
   not a chunk (with the chunk's decay `exp(c_last)` and decay span beside, per chunk). Every
   chunk of every slot runs in parallel.
2. `_chunk_scan_kernel`, one program per (slot, head, block of BV value rows): the state rows in
   registers (fp32), the slot's chunks in order, each four small products on the state:
   `Z = W S^T + U`, `Y = Q S^T + Yv`, `S = S diag(exp(c_last)) + Z^T Bd + V^T Kd`. A chunk whose
   decay span exceeds `SPAN_LIMIT` (inputs far outside the model's range) runs token by token
   instead. The value rows of the state are independent, so splitting them across programs buys
   parallelism for one long prompt at the cost of reading the chunk's factors once per block.
   With `CAPTURE` (a separate build) it also stores the state rows after chunks the caller names,
   the prefix cache's states inside a long chunk (albatross/wkv_dispatch.py).

The first form of this kernel did the chunk's L x L products inside the scan, eleven products a
chunk one after another; the H200 timed it at 2.4 ms a layer for 1 x 4,096 (64 heads) against
3.8 for the sequential kernel. A segmented variant (each slot's segments in parallel through
their affine maps of the state) measured 2.2x slower than it and less accurate, and was removed
(docs/performance.md, "Session 7").

All products accumulate in fp32. The default `input_precision="tf32x3"` (three tf32 tensor-core
products per product, fp32-accurate) measured both faster and more accurate on the H200 than
"ieee" (FMA) in the first form (docs/performance.md, "Chunked WKV prefill").
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from albatross import ops
from albatross.wkv_chunked import CHUNK, FACTORS, HEAD, SPAN_LIMIT

# The prepare kernel's warps a program. A program holds one chunk (16 x 64 tiles); with 8 warps
# most of them idled through its small products and the row-by-row substitution. An H100, one
# layer of 64 heads, tf32x3 (docs/performance.md, "Session 16"): 1 x 4,096 took 1.64 ms with 8
# warps, 1.07 with 4, 0.86 with 2 and 1.50 with 1; the final-state error was the same (2.69e-6).
PREPARE_WARPS = 2

# Triton compiles a kernel again for every new combination of its arguments' specializations: an
# integer's divisibility by 16 and a pointer's 16-byte alignment. The call's small int32 index
# tensors (slots, row bounds, chunk offsets, capture marks) are slices of one host copy at any
# element offset, and the row count is any number, so a server met new combinations for minutes,
# each a compile of seconds with the worker stalled (on an H100, long prompts' first tokens after
# 5-7 s at 1 request/s: docs/performance.md, "Session 24"). These are read a scalar at a time, so
# their specialization buys nothing: it is off, and the variants left are the constexpr ones that
# DeviceStep.warm_long_prefill builds at load.
_PREPARE_INDEX_ARGS = ["cu_ptr", "chunk_offsets_ptr", "total"]
_SCAN_INDEX_ARGS = [*_PREPARE_INDEX_ARGS, "slot_idx_ptr", "chunk_capture_ptr"]


@triton.jit(do_not_specialize=_PREPARE_INDEX_ARGS)
def _chunk_prepare_kernel(
    r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr,
    stride_r, stride_w, stride_k, stride_v, stride_a, stride_b,
    cu_ptr, chunk_offsets_ptr, factors_ptr, decay_ptr, span_ptr, total,
    H: tl.constexpr, N: tl.constexpr, L: tl.constexpr, F: tl.constexpr, PRECISION: tl.constexpr,
    SQUARING: tl.constexpr, LOG2_L: tl.constexpr,
):  # fmt: skip
    s, j, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0 = tl.load(cu_ptr + s)
    t1 = tl.load(cu_ptr + s + 1)
    start = t0 + j * L
    if start < t1:
        t_idx = tl.arange(0, L)
        kj = tl.arange(0, N)
        rows = start + t_idx
        mask = (rows < t1)[:, None]
        rows64 = rows.to(tl.int64)
        cols = h * N + kj
        w = tl.load(w_ptr + rows64[:, None] * stride_w + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + rows64[:, None] * stride_a + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + rows64[:, None] * stride_b + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + rows64[:, None] * stride_k + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + rows64[:, None] * stride_v + cols[None, :], mask=mask, other=0.0).to(tl.float32)  # [L, N(value)]
        log_decay = tl.where(mask, -tl.exp(w), 0.0)  # padding rows: decay 1
        c = tl.cumsum(log_decay, axis=0)
        c_last = tl.sum(log_decay, axis=0)  # [N]
        inv_c = tl.exp(-c)
        Ra = a * tl.exp(c - log_decay)
        Rr = r * tl.exp(c)
        Bi = b * inv_c
        Ki = k * inv_c
        strict = t_idx[:, None] > t_idx[None, :]
        lower = t_idx[:, None] >= t_idx[None, :]
        M = tl.where(strict, tl.dot(Ra, tl.trans(Bi), input_precision=PRECISION), 0.0)
        T = tl.where(t_idx[:, None] == t_idx[None, :], 1.0, 0.0)  # I
        if SQUARING:
            # M is strictly lower triangular, so M^L = 0 and (I - M)^-1 = (I + M)(I + M^2)(I + M^4)...
            # up to M^(L/2): log2(L) - 1 pairs of L x L products instead of L - 1 dependent rows.
            T = T + M
            P = M
            for _ in tl.static_range(1, LOG2_L):
                P = tl.dot(P, P, input_precision=PRECISION)
                T = T + tl.dot(T, P, input_precision=PRECISION)
        else:
            # Forward substitution, row by row: T[t] = e_t + M[t, :t] @ T[:t] (T starts as I).
            for t in tl.static_range(1, L):
                m_row = tl.sum(tl.where(t_idx[:, None] == t, M, 0.0), axis=0)  # M[t, :], zero from t on
                new_row = tl.sum(m_row[:, None] * T, axis=0)
                T = tl.where(t_idx[:, None] == t, T + new_row[None, :], T)
        M_ak = tl.where(strict, tl.dot(Ra, tl.trans(Ki), input_precision=PRECISION), 0.0)
        M_rb = tl.where(lower, tl.dot(Rr, tl.trans(Bi), input_precision=PRECISION), 0.0)
        M_rk = tl.where(lower, tl.dot(Rr, tl.trans(Ki), input_precision=PRECISION), 0.0)
        W = tl.dot(T, Ra, input_precision=PRECISION)  # z_t = (W S^T)_t + U_t
        U = tl.dot(T, tl.dot(M_ak, v, input_precision=PRECISION), input_precision=PRECISION)
        Q = Rr + tl.dot(M_rb, W, input_precision=PRECISION)  # y_t = (Q S^T)_t + Yv_t
        Yv = tl.dot(M_rb, U, input_precision=PRECISION) + tl.dot(M_rk, v, input_precision=PRECISION)
        decay_all = tl.exp(c_last)  # the chunk's whole decay; b exp(c_last - c) = Bi exp(c_last)
        plane = tl.cast(total, tl.int64) * N  # one factor of one head: [total, N]
        base = factors_ptr + h * (F * plane) + rows64[:, None] * N + kj[None, :]
        tl.store(base, W, mask=mask)
        tl.store(base + plane, Q, mask=mask)
        tl.store(base + 2 * plane, Bi * decay_all[None, :], mask=mask)
        tl.store(base + 3 * plane, Ki * decay_all[None, :], mask=mask)
        tl.store(base + 4 * plane, U, mask=mask)
        tl.store(base + 5 * plane, Yv, mask=mask)
        key = (tl.load(chunk_offsets_ptr + s) + j).to(tl.int64) * H + h
        tl.store(decay_ptr + key * N + kj, decay_all)
        tl.store(span_ptr + key, tl.max(-c_last, axis=0))


@triton.jit(do_not_specialize=_SCAN_INDEX_ARGS)
def _chunk_scan_kernel(
    state_ptr, slot_idx_ptr, cu_ptr, chunk_offsets_ptr, factors_ptr, decay_ptr, span_ptr, y_ptr,
    r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr,
    stride_r, stride_w, stride_k, stride_v, stride_a, stride_b, stride_y,
    span_limit, total, capture_ptr, chunk_capture_ptr,
    H: tl.constexpr, N: tl.constexpr, L: tl.constexpr, BV: tl.constexpr, F: tl.constexpr, PRECISION: tl.constexpr,
    KEY_MAJOR: tl.constexpr, CAPTURE: tl.constexpr,
):  # fmt: skip
    # KEY_MAJOR: the program holds its state rows transposed, [N(key), BV], so every product takes
    # the state and the factors as they are (Bd and Kd are loaded transposed) and no computed tile
    # is transposed on the way; otherwise [BV, N], the state's own layout.
    # CAPTURE: after chunk g (the call's chunk index) the state rows also go to capture
    # `chunk_capture[g]` of `capture_ptr` ([captures, H, N, N]) where that is not -1.
    s, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0 = tl.load(cu_ptr + s)
    t1 = tl.load(cu_ptr + s + 1)
    if t1 > t0:
        vi = vb * BV + tl.arange(0, BV)  # this program's value rows
        kj = tl.arange(0, N)
        t_idx = tl.arange(0, L)
        slot = tl.load(slot_idx_ptr + s).to(tl.int64)
        if KEY_MAJOR:
            state_offsets = ((slot * H + h) * N + vi[None, :]) * N + kj[:, None]  # [N, BV]
        else:
            state_offsets = ((slot * H + h) * N + vi[:, None]) * N + kj[None, :]  # [BV, N]
        S = tl.load(state_ptr + state_offsets).to(tl.float32)
        cols = h * N + kj
        vcols = h * N + vi
        plane = tl.cast(total, tl.int64) * N  # one factor of one head: [total, N]
        head_factors = factors_ptr + h * (F * plane)
        key = tl.load(chunk_offsets_ptr + s).to(tl.int64) * H + h
        if CAPTURE:
            chunk = (key - h) // H  # the call's index of this slot's chunk (counted on below)
        # The chunk's factors are loaded one chunk ahead (the loads of chunk i + 1 are in flight
        # while chunk i's products run), so a step waits on its products, not on memory.
        W, Q, Bd, Kd, U, Yv, decay_all, v, span = _scan_operands(
            head_factors, plane, decay_ptr, span_ptr, v_ptr, stride_v, key, t0, t1, t_idx, kj, vi, vcols, N, KEY_MAJOR
        )
        for start in range(t0, t1, L):
            rows = start + t_idx
            mask = (rows < t1)[:, None]
            rows64 = rows.to(tl.int64)
            nW, nQ, nBd, nKd, nU, nYv, n_decay, n_v, n_span = _scan_operands(
                head_factors, plane, decay_ptr, span_ptr, v_ptr, stride_v, key + H, start + L, t1, t_idx, kj, vi, vcols, N, KEY_MAJOR
            )
            if span <= span_limit:
                if KEY_MAJOR:  # S is [N, BV]; Bd and Kd came [N, L]
                    Z = tl.dot(W, S, input_precision=PRECISION) + U  # [L, BV]: z_t = S_{t-1} a_t
                    Y = tl.dot(Q, S, input_precision=PRECISION) + Yv
                    S = S * decay_all[:, None]
                    S += tl.dot(Bd, Z, input_precision=PRECISION)
                    S += tl.dot(Kd, v, input_precision=PRECISION)
                else:
                    St = tl.trans(S)  # [N, BV]
                    Z = tl.dot(W, St, input_precision=PRECISION) + U
                    Y = tl.dot(Q, St, input_precision=PRECISION) + Yv
                    S = S * decay_all[None, :]
                    S += tl.dot(tl.trans(Z), Bd, input_precision=PRECISION)
                    S += tl.dot(tl.trans(v), Kd, input_precision=PRECISION)
                tl.store(y_ptr + rows64[:, None] * stride_y + vcols[None, :], Y.to(y_ptr.dtype.element_ty), mask=mask)
            else:
                for t in range(0, L):
                    row = start + t
                    if row < t1:
                        row64 = row.to(tl.int64)
                        r_t = tl.load(r_ptr + row64 * stride_r + cols).to(tl.float32)
                        w_t = tl.load(w_ptr + row64 * stride_w + cols).to(tl.float32)
                        k_t = tl.load(k_ptr + row64 * stride_k + cols).to(tl.float32)
                        a_t = tl.load(a_ptr + row64 * stride_a + cols).to(tl.float32)
                        b_t = tl.load(b_ptr + row64 * stride_b + cols).to(tl.float32)
                        v_t = tl.load(v_ptr + row64 * stride_v + vcols).to(tl.float32)
                        if KEY_MAJOR:
                            sa = tl.sum(S * a_t[:, None], axis=0)
                            S = S * tl.exp(-tl.exp(w_t))[:, None] + b_t[:, None] * sa[None, :] + k_t[:, None] * v_t[None, :]
                            y_t = tl.sum(S * r_t[:, None], axis=0)
                        else:
                            sa = tl.sum(S * a_t[None, :], axis=1)
                            S = S * tl.exp(-tl.exp(w_t))[None, :] + sa[:, None] * b_t[None, :] + v_t[:, None] * k_t[None, :]
                            y_t = tl.sum(S * r_t[None, :], axis=1)
                        tl.store(y_ptr + row64 * stride_y + vcols, y_t.to(y_ptr.dtype.element_ty))
            if CAPTURE:
                capture = tl.load(chunk_capture_ptr + chunk).to(tl.int64)
                if capture >= 0:
                    if KEY_MAJOR:
                        capture_offsets = ((capture * H + h) * N + vi[None, :]) * N + kj[:, None]
                    else:
                        capture_offsets = ((capture * H + h) * N + vi[:, None]) * N + kj[None, :]
                    tl.store(capture_ptr + capture_offsets, S.to(capture_ptr.dtype.element_ty))
            W, Q, Bd, Kd, U, Yv, decay_all, v, span = nW, nQ, nBd, nKd, nU, nYv, n_decay, n_v, n_span
            key += H
            if CAPTURE:
                chunk += 1
        tl.store(state_ptr + state_offsets, S.to(state_ptr.dtype.element_ty))


@triton.jit
def _scan_operands(
    head_factors, plane, decay_ptr, span_ptr, v_ptr, stride_v, key, start, t1, t_idx, kj, vi, vcols, N: tl.constexpr, KEY_MAJOR: tl.constexpr
):  # fmt: skip
    """What the scan's step for the chunk at row `start` reads (zeros, and a span that takes the
    fast path, past the slot's end): the six factors (with KEY_MAJOR, Bd and Kd as [N, L]), the
    chunk's decay and span, its values."""
    rows = start + t_idx
    live = rows < t1
    mask = live[:, None]
    rows64 = rows.to(tl.int64)
    by_key = head_factors + rows64[:, None] * N + kj[None, :]  # [L, N]
    by_value = head_factors + rows64[:, None] * N + vi[None, :]  # [L, BV]
    W = tl.load(by_key, mask=mask, other=0.0)
    Q = tl.load(by_key + plane, mask=mask, other=0.0)
    if KEY_MAJOR:
        by_key_t = head_factors + rows64[None, :] * N + kj[:, None]  # [N, L]
        Bd = tl.load(by_key_t + 2 * plane, mask=live[None, :], other=0.0)
        Kd = tl.load(by_key_t + 3 * plane, mask=live[None, :], other=0.0)
    else:
        Bd = tl.load(by_key + 2 * plane, mask=mask, other=0.0)
        Kd = tl.load(by_key + 3 * plane, mask=mask, other=0.0)
    U = tl.load(by_value + 4 * plane, mask=mask, other=0.0)
    Yv = tl.load(by_value + 5 * plane, mask=mask, other=0.0)
    any_row = start < t1
    decay_all = tl.load(decay_ptr + key * N + kj, mask=any_row, other=1.0)
    span = tl.load(span_ptr + key, mask=any_row, other=0.0)
    v = tl.load(v_ptr + rows64[:, None] * stride_v + vcols[None, :], mask=mask, other=0.0).to(tl.float32)
    return W, Q, Bd, Kd, U, Yv, decay_all, v, span


def chunk_offsets(lengths: tuple[int, ...] | list[int], chunk: int = CHUNK) -> list[int]:
    """Index of each slot's first chunk in the scratch (prefix sums of ceil(n / chunk))."""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + -(-n // chunk))
    return offsets


def wkv7_chunked_triton(
    state: torch.Tensor,
    slot_idx: torch.Tensor,
    cu_seqlens: torch.Tensor,
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    lengths: tuple[int, ...] | list[int],
    offsets: torch.Tensor | None = None,
    block_values: int = 32,
    precision: str = "tf32x3",
    num_warps: int = 4,
    chunk: int = CHUNK,
    key_major: bool = False,
    captures: torch.Tensor | None = None,
    chunk_captures: torch.Tensor | None = None,
    prepare_warps: int = PREPARE_WARPS,
    prepare_precision: str | None = None,
    prepare_inverse: str = "substitution",
) -> torch.Tensor:
    """`ops.wkv7` by chunks of `chunk` tokens. `lengths` are the host-side token counts of the
    slots (they size the launch without a device sync); `offsets` the device int32 form of
    `chunk_offsets(lengths, chunk)` when the caller keeps one per batch (built here otherwise).
    `key_major` runs the scan on transposed state rows (the kernel's comment says why; 2-8% slower
    on an H100, so off: docs/kernels.md). `state` is updated in place. `captures` ([n, H, N, N], the state's dtype) with
    `chunk_captures` (device int32, one entry per chunk of the call in `offsets` order: a capture
    index or -1) also copies a slot's state after those chunks (prefix-cache checkpoints).
    `prepare_warps` and `prepare_precision` (default: `precision`) are the prepare kernel's, and
    `prepare_inverse` how it inverts a chunk's `I - M`: "substitution" (row by row, the twin's
    order) or "squaring" (products of `I + M^(2^k)`: 4% faster on an H100, but off because its
    powers cancel on aligned keys; docs/kernels.md, "Chunked WKV prefill")."""
    if prepare_inverse not in ("substitution", "squaring"):
        raise ValueError(f"prepare_inverse must be substitution or squaring, got {prepare_inverse!r}")
    _check(state, slot_idx, cu_seqlens, (r, w, k, v, a, b), lengths, block_values, chunk)
    if (captures is None) != (chunk_captures is None):
        raise ValueError("captures and chunk_captures go together")
    if captures is not None and (captures.dim() != 4 or captures.shape[1:] != state.shape[1:] or captures.dtype != state.dtype):
        raise ValueError(f"captures must be [n, {state.shape[1]}, 64, 64] of the state's dtype, got {tuple(captures.shape)} {captures.dtype}")
    total, C = r.shape
    H = state.shape[1]
    y = torch.empty(total, C, dtype=r.dtype, device=r.device)
    slots = len(lengths)
    longest = max(lengths, default=0)
    if slots == 0 or longest == 0:
        return y
    host_offsets = chunk_offsets(lengths, chunk)
    if offsets is None:
        offsets = ops.host_to_device(torch.tensor(host_offsets, dtype=torch.int32), r.device)
    chunks = host_offsets[-1]
    factors = torch.empty(H, FACTORS, total, HEAD, dtype=torch.float32, device=r.device)  # by row: no padding
    decay = torch.empty(chunks, H, HEAD, dtype=torch.float32, device=r.device)
    span = torch.empty(chunks, H, dtype=torch.float32, device=r.device)
    inputs = (r, w, k, v, a, b)
    strides = tuple(x.stride(0) for x in inputs)
    with torch.cuda.device(r.device) if r.is_cuda else contextlib.nullcontext():  # Triton launches on the current device
        _chunk_prepare_kernel[(slots, -(-longest // chunk), H)](
            *inputs, *strides, cu_seqlens, offsets, factors, decay, span, total,
            H=H, N=HEAD, L=chunk, F=FACTORS, PRECISION=prepare_precision or precision,
            SQUARING=prepare_inverse == "squaring", LOG2_L=chunk.bit_length() - 1, num_warps=prepare_warps,
        )  # fmt: skip
        capture = captures is not None
        _chunk_scan_kernel[(slots, H, HEAD // block_values)](
            state, slot_idx, cu_seqlens, offsets, factors, decay, span, y, *inputs, *strides, y.stride(0), SPAN_LIMIT, total,
            captures if capture else state, chunk_captures if capture else offsets,
            H=H, N=HEAD, L=chunk, BV=block_values, F=FACTORS, PRECISION=precision, KEY_MAJOR=key_major, CAPTURE=capture,
            num_warps=num_warps,
        )  # fmt: skip
    return y


def _check(
    state: torch.Tensor,
    slot_idx: torch.Tensor,
    cu_seqlens: torch.Tensor,
    inputs: tuple[torch.Tensor, ...],
    lengths: tuple[int, ...] | list[int],
    block_values: int,
    chunk: int,
) -> None:
    if state.dim() != 4 or state.shape[2:] != (HEAD, HEAD) or not state.is_contiguous():
        raise ValueError(f"state must be a contiguous [slots, heads, 64, 64] tensor, got {tuple(state.shape)}")
    total, C = inputs[0].shape
    if C != state.shape[1] * HEAD:
        raise ValueError(f"inputs have {C} channels for {state.shape[1]} heads of 64")
    for x in inputs:
        if x.shape != (total, C) or x.stride(1) != 1 or x.dtype != inputs[0].dtype:
            raise ValueError("r, w, k, v, a, b must be [T, C] rows of one dtype with unit column stride")
    if slot_idx.dtype != torch.int32 or cu_seqlens.dtype != torch.int32 or cu_seqlens.numel() != slot_idx.numel() + 1:
        raise ValueError("slot_idx and cu_seqlens must be int32, with len(cu_seqlens) == len(slot_idx) + 1")
    if len(lengths) != slot_idx.numel() or sum(lengths) != total:
        raise ValueError(f"lengths {len(lengths)} slots / {sum(lengths)} rows do not match the inputs")
    if block_values not in (16, 32, 64):
        raise ValueError(f"block_values must be 16, 32 or 64, got {block_values}")
    if chunk not in (16, 32, 64):
        raise ValueError(f"chunk must be 16, 32 or 64 tokens, got {chunk}")
