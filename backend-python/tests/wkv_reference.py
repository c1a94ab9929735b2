"""Shared by the chunked-WKV tests: random WKV inputs in a trained model's ranges and the
recurrence in float64, slot by slot and token by token (the slowest, plainest form)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

N = 64


def wkv_inputs(
    lengths: list[int], heads: int, dtype: torch.dtype, gen: torch.Generator, device: str = "cpu", log_decay_scale: float | None = None
) -> list[torch.Tensor]:
    """r, w, k, v, a, b: log-decay exponent w in [-5, -0.5] as wkv_prep makes it (or, with
    `log_decay_scale`, w ~ N(0, scale^2), far outside that range), a = -kk and b = kk * gate
    with kk unit-norm per head, so the state stays bounded over thousands of tokens."""
    T, C = sum(lengths), heads * N

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    r = randn(T, C) * 0.5
    if log_decay_scale is None:
        w = -0.5 - 4.5 * torch.rand(T, C, generator=gen, device=device)
    else:
        w = randn(T, C) * log_decay_scale
    k = randn(T, C) * 0.3
    v = randn(T, C) * 0.5
    kk = F.normalize(randn(T, heads, N), dim=-1).view(T, C)
    gate = torch.sigmoid(randn(T, C))
    return [x.to(dtype) for x in (r, w, k, v, -kk, kk * gate)]


def flat_batch_args(lengths: list[int], pool_slots: int, gen: torch.Generator, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """slot_idx (distinct pool rows in a shuffled order) and cu_seqlens, both int32."""
    slot_idx = torch.randperm(pool_slots, generator=gen)[: len(lengths)].to(torch.int32)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return slot_idx.to(device), torch.tensor(starts, dtype=torch.int32, device=device)


def wkv7_float64(state: torch.Tensor, slot_idx: torch.Tensor, cu_seqlens: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence in float64 from the exact inputs a kernel gets; returns (y, final states of
    the slots in slot order) without touching `state`."""
    r, w, k, v, a, b = (x.double() for x in inputs)
    H = state.shape[1]
    y = torch.zeros(r.shape[0], H, N, dtype=torch.float64, device=r.device)
    bounds = cu_seqlens.tolist()
    finals = []
    for s, slot in enumerate(slot_idx.tolist()):
        S = state[slot].double()
        for t in range(bounds[s], bounds[s + 1]):
            d = torch.exp(-torch.exp(w[t].view(H, N)))
            sa = S @ a[t].view(H, N, 1)
            S = S * d[:, None, :] + sa @ b[t].view(H, 1, N) + v[t].view(H, N, 1) @ k[t].view(H, 1, N)
            y[t] = (S @ r[t].view(H, N, 1)).squeeze(-1)
        finals.append(S)
    return y.view(r.shape[0], H * N), torch.stack(finals) if finals else state[:0].double()
