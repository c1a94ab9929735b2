"""Reference walks of the WKV recurrence for one slot (docs/kernels.md, "WKV kernel"), shared by the
CPU and GPU tests of the scaled walk:

- `walk`: the plain recurrence in any float dtype (float64: the reference);
- `scaled_walk`: the scaled walk's arithmetic in float32 as the kernel orders its decisions (rows
  divided by the running decay product P per key entry; a head folds P back in on a chunk's first
  token and whenever its new P would fall below `SCALED_FLOOR` for any entry; the chunk ends by
  multiplying the rows by P). Its sums run in torch's order, not the kernel's, so it pins the
  algorithm (accuracy, fold rule), not the kernel's bits.

Inputs are one slot's `[T, H, N]` rows (r, w, k, v, a, b) and its `[H, N, N]` state."""

from __future__ import annotations

import torch

SCALED_FLOOR = 2.0**-20  # wkv7.cu's SCALED_FLOOR


def walk(state: torch.Tensor, inputs: list[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(final state, y [T, H, N]) of the plain recurrence computed in `dtype`."""
    S = state.to(dtype).clone()
    r, w, k, v, a, b = (x.to(dtype) for x in inputs)
    decay = torch.exp(-torch.exp(w))
    ys = []
    for t in range(r.shape[0]):
        sa = S @ a[t].unsqueeze(-1)
        S = S * decay[t].unsqueeze(-2) + sa @ b[t].unsqueeze(-2) + v[t].unsqueeze(-1) @ k[t].unsqueeze(-2)
        ys.append((S @ r[t].unsqueeze(-1)).squeeze(-1))
    return S, torch.stack(ys)


def scaled_walk(state: torch.Tensor, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(final state, y [T, H, N], folds per head [H]) of the scaled walk in float32."""
    S = state.float().clone()
    r, w, k, v, a, b = (x.float() for x in inputs)
    heads = S.shape[0]
    P = torch.ones(heads, S.shape[-1])
    folds = torch.zeros(heads, dtype=torch.int64)
    ys = []
    for t in range(r.shape[0]):
        decay = torch.exp(-torch.exp(w[t]))
        product = P * decay
        # per head: fold on the chunk's first token, or when some entry's product is low (or NaN)
        fold = torch.full((heads,), t == 0) | ~(product >= SCALED_FLOOR).all(-1)
        folds += fold
        sa = S @ (P * a[t]).unsqueeze(-1)
        f = fold[:, None, None]
        plain = S * product.unsqueeze(-2) + sa @ b[t].unsqueeze(-2) + v[t].unsqueeze(-1) @ k[t].unsqueeze(-2)
        inverse = 1.0 / torch.where(fold[:, None], torch.ones_like(product), product)
        scaled = S + v[t].unsqueeze(-1) @ (k[t] * inverse).unsqueeze(-2) + sa @ (b[t] * inverse).unsqueeze(-2)
        S = torch.where(f, plain, scaled)
        P = torch.where(fold[:, None], torch.ones_like(P), product)
        ys.append((S @ (P * r[t]).unsqueeze(-1)).squeeze(-1))
    return S * P.unsqueeze(-2), torch.stack(ys), folds
