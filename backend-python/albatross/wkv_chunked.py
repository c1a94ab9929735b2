"""The WKV-7 recurrence in chunked-parallel form: the torch twin of the Triton prefill kernel.

Same contract as `ops.wkv7` (state slots updated in place, flat rows, `[T, C]` output); the
result equals the sequential recurrence's in exact arithmetic. Per head, with the state S
indexed [value, key], a token does `S_t = S_{t-1} (diag(d_t) + a_t b_t^T) + v_t k_t^T` and
`y_t = S_t r_t`. Writing `z_t = S_{t-1} a_t` turns a chunk of L tokens into a diagonal-decay
recurrence with two rank-1 inputs, so with the chunk's cumulative log decay `c_t = sum(log d)`
(inclusive, per channel; `c_{-1} = 0`), `Ra_t = a_t exp(c_{t-1})`, `Rr_t = r_t exp(c_t)`,
`Bi_t = b_t exp(-c_t)`, `Ki_t = k_t exp(-c_t)`:

    M_ab = strict_tril(Ra Bi^T)  M_ak = strict_tril(Ra Ki^T)  M_rb = tril(Rr Bi^T)  M_rk = tril(Rr Ki^T)
    T  = (I - M_ab)^-1   W = T Ra   U = T M_ak V   Q = Rr + M_rb W   Yv = M_rb U + M_rk V
    Z  = W S0^T + U                                rows z_t, one column per value row of S
    Y  = Q S0^T + Yv
    S1 = S0 diag(exp(c_last)) + Z^T (Bi exp(c_last)) + V^T (Ki exp(c_last))

Everything on the first line depends on the inputs only (the kernel computes it for every chunk
in a parallel pass first); the state goes from chunk to chunk through four small matrix
products, in fp32.

Rounding: every pair factor `exp(c_t - c_tau)` is formed as the product of two per-token factors,
each term with its own few-ulp error, so nothing cancels; but `exp(-c)` overflows once a chunk's
decay span `-c_last` passes ~88. The model's decays are `exp(w)` with `w <= -0.5` (wkv_prep), so
a 16-token chunk spans at most 9.7; a chunk (slot, head) whose span exceeds `SPAN_LIMIT` (only
inputs far outside the model's range) takes the token-by-token recurrence instead, so the op is
exact for every finite input.

A 16-bit state is read once and rounded once per call, as in the sequential kernel.
"""

from __future__ import annotations

import torch

CHUNK = 16
SPAN_LIMIT = 60.0  # exp(60) ~ 1e26: the per-token factors and their products stay finite in fp32
HEAD = 64
FACTORS = 6  # what the kernel's parallel pass keeps per (row, head): W, Q, Bd, Kd, U, Yv, each 64 floats


def scratch_bytes(rows: int, channels: int) -> int:
    """The most device memory the Triton kernel's scratch takes in a call of `rows` rows: the fp32
    factors (FACTORS x 64 a row and head) and, per chunk (at most one a row), its decays and span."""
    heads = channels // HEAD
    return 4 * rows * (FACTORS * channels + heads * (HEAD + 1))


def wkv7_chunked_torch(
    state: torch.Tensor,
    slot_idx: torch.Tensor,
    cu_seqlens: torch.Tensor,
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    single_token: bool = False,
    chunk: int = CHUNK,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """`ops.wkv7` by chunks of `chunk` tokens, in `compute_dtype` (fp32 like the kernel, or
    float64 to study the algorithm's own rounding). Slots run side by side; a slot shorter than
    the longest is padded with tokens that change nothing (decay 1, zero inputs)."""
    del single_token  # one row per slot is just a chunk of one token here
    B, H, N, _ = state.shape
    total = r.shape[0]
    bounds = cu_seqlens.tolist()
    lengths = [bounds[s + 1] - bounds[s] for s in range(len(bounds) - 1)]
    y = torch.zeros(total, H * N, dtype=compute_dtype, device=state.device)
    live = [s for s, n in enumerate(lengths) if n > 0]
    if not live:
        return y.to(r.dtype)
    chunks = max(-(-lengths[s] // chunk) for s in live)
    padded = chunks * chunk
    # Gather rows into [slots, padded, H, N]; padding rows point at an all-zero row (index total).
    index = torch.full((len(live), padded), total, dtype=torch.int64)
    for row, s in enumerate(live):
        index[row, : lengths[s]] = torch.arange(bounds[s], bounds[s + 1])
    index = index.to(state.device)

    def rows(x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        x = x.to(compute_dtype).view(total, H, N)
        x = torch.cat([x, torch.full((1, H, N), fill, dtype=compute_dtype, device=x.device)])
        return x[index].view(len(live), chunks, chunk, H, N).permute(1, 0, 3, 2, 4)  # [chunks, S, H, L, N]

    log_decay = -torch.exp(rows(w, fill=-torch.inf))  # padding: w = -inf, decay exactly 1
    rr, kk, vv, aa, bb = rows(r), rows(k), rows(v), rows(a), rows(b)
    pool_rows = slot_idx.to(torch.int64)[torch.tensor(live, dtype=torch.int64, device=state.device)]
    S = state.index_select(0, pool_rows).to(compute_dtype)  # [S, H, N(value), N(key)]
    out = torch.zeros(chunks, len(live), H, chunk, N, dtype=compute_dtype, device=state.device)
    for c in range(chunks):
        S, out[c] = _chunk_step(S, log_decay[c], rr[c], kk[c], vv[c], aa[c], bb[c])
    state.index_copy_(0, pool_rows, S.to(state.dtype))
    # Scatter back: [chunks, S, H, L, N] -> [S, padded, H*N] -> flat rows.
    per_slot = out.permute(1, 0, 3, 2, 4).reshape(len(live), padded, H * N)
    valid = index < total
    y[index[valid]] = per_slot[valid]
    return y.to(r.dtype)


def _chunk_step(
    S: torch.Tensor, log_decay: torch.Tensor, r: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk for all slots and heads: inputs `[S, H, L, N]`, state `[S, H, N, N]`; returns
    the new state and the chunk's outputs `[S, H, L, N]`."""
    L = r.shape[-2]
    c = torch.cumsum(log_decay, dim=-2)  # inclusive
    c_prev = c - log_decay  # exclusive: c_{t-1}
    c_last = c[..., -1:, :]
    Ra, Rr = a * torch.exp(c_prev), r * torch.exp(c)
    inv = torch.exp(-c)
    Bi, Ki = b * inv, k * inv
    strict = torch.ones(L, L, dtype=torch.bool, device=S.device).tril(-1)
    lower = torch.ones(L, L, dtype=torch.bool, device=S.device).tril()
    M_ab = (Ra @ Bi.mT).masked_fill(~strict, 0)
    M_ak = (Ra @ Ki.mT).masked_fill(~strict, 0)
    M_rb = (Rr @ Bi.mT).masked_fill(~lower, 0)
    M_rk = (Rr @ Ki.mT).masked_fill(~lower, 0)
    # What does not depend on the state (the kernel's parallel pass), in its order of products.
    T = unit_lower_inverse(M_ab)
    W = T @ Ra
    U = T @ (M_ak @ v)
    Q = Rr + M_rb @ W
    Yv = M_rb @ U + M_rk @ v
    decay_all = torch.exp(c_last)  # the chunk's whole decay; b exp(c_last - c) = Bi exp(c_last)
    # The state's part (the kernel's scan).
    St = S.mT
    Z = W @ St + U  # [S, H, L, Nv]: z_t = S_{t-1} a_t
    Y = Q @ St + Yv
    S_new = S * decay_all + Z.mT @ (Bi * decay_all) + v.mT @ (Ki * decay_all)
    span = (-c_last.squeeze(-2)).amax(dim=-1)  # [S, H]: the chunk's largest decay span
    unsafe = ~(span <= SPAN_LIMIT)  # NaN-safe: a NaN span takes the exact path too
    if bool(unsafe.any()):
        S_seq, Y_seq = _sequential_chunk(S, log_decay, r, k, v, a, b)
        pick = unsafe[..., None, None]
        S_new, Y = torch.where(pick, S_seq, S_new), torch.where(pick, Y_seq, Y)
    return S_new, Y


def _sequential_chunk(
    S: torch.Tensor, log_decay: torch.Tensor, r: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token-by-token recurrence over one chunk (the fallback for extreme decays)."""
    decay = torch.exp(log_decay)
    ys = []
    for t in range(r.shape[-2]):
        sa = S @ a[..., t, :, None]
        S = S * decay[..., t, None, :] + sa @ b[..., t, None, :] + v[..., t, :, None] @ k[..., t, None, :]
        ys.append((S @ r[..., t, :, None]).squeeze(-1))
    return S, torch.stack(ys, dim=-2)


def unit_lower_inverse(M: torch.Tensor) -> torch.Tensor:
    """`(I - M)^-1` for strictly lower-triangular `M [..., L, L]`, by forward substitution row by
    row: `T[t] = e_t + M[t, :t] @ T[:t]` (the order the kernel uses)."""
    L = M.shape[-1]
    T = torch.eye(L, dtype=M.dtype, device=M.device).expand(M.shape).clone()
    for t in range(1, L):
        T[..., t, :] = T[..., t, :] + (M[..., t, None, :t] @ T[..., :t, :]).squeeze(-2)
    return T
