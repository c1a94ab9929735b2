"""Shared by the WKV kernel tests: random WKV inputs in a trained model's ranges; the recurrence
token by token (the slowest, plainest form), for one slot in any dtype (`walk`) or in float64
slot by slot from a kernel's exact inputs (`wkv7_float64`); and the scaled walk's arithmetic
(`scaled_walk`, docs/kernels.md "Scaled walk")."""

from __future__ import annotations

import torch
import torch.nn.functional as F

N = 64


def wkv_inputs(
    lengths: list[int],
    heads: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    device: str = "cpu",
    log_decay_scale: float | None = None,
    log_decay: tuple[float, float] = (-5.0, -0.5),
) -> list[torch.Tensor]:
    """r, w, k, v, a, b: log-decay exponent w uniform in `log_decay`, by default [-5, -0.5] as
    wkv_prep makes it (or, with `log_decay_scale`, w ~ N(0, scale^2), far outside that range),
    a = -kk and b = kk * gate with kk unit-norm per head, so the state stays bounded over
    thousands of tokens."""
    T, C = sum(lengths), heads * N

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    r = randn(T, C) * 0.5
    if log_decay_scale is None:
        low, high = log_decay
        w = high - (high - low) * torch.rand(T, C, generator=gen, device=device)
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
    H, T = state.shape[1], inputs[0].shape[0]
    y = torch.zeros(T, H, N, dtype=torch.float64, device=inputs[0].device)
    bounds = cu_seqlens.tolist()
    finals = []
    for s, slot in enumerate(slot_idx.tolist()):
        start, stop = bounds[s], bounds[s + 1]
        S, y[start:stop] = walk(state[slot], [x[start:stop].view(-1, H, N) for x in inputs], torch.float64)
        finals.append(S)
    return y.view(T, H * N), torch.stack(finals) if finals else state[:0].double()


def walk(state: torch.Tensor, inputs: list[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One slot's recurrence computed in `dtype`: its `[H, N, N]` state and `[T, H, N]` rows r, w,
    k, v, a, b in; (final state, y `[T, H, N]`) out."""
    S = state.to(dtype)
    r, w, k, v, a, b = (x.to(dtype) for x in inputs)
    decay = torch.exp(-torch.exp(w))
    ys = []
    for t in range(r.shape[0]):
        sa = S @ a[t].unsqueeze(-1)
        S = S * decay[t].unsqueeze(-2) + sa @ b[t].unsqueeze(-2) + v[t].unsqueeze(-1) @ k[t].unsqueeze(-2)
        ys.append((S @ r[t].unsqueeze(-1)).squeeze(-1))
    return S, torch.stack(ys) if ys else r.new_zeros(r.shape)


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.double() - expected).abs().max().item()


def assert_as_accurate_as_plain(results: tuple[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor], ...], floor: float = 1e-6) -> None:
    """Each (name, scaled walk's result, plain walk's, float64's): the scaled walk's max error
    against float64 within twice the plain walk's, plus `floor` (a few float32 ulps of the
    largest entries: the bound where both walks are near exact)."""
    for name, got, plain, want in results:
        error, plain_error = max_error(got, want), max_error(plain, want)
        assert error <= 2 * plain_error + floor, f"{name}: scaled {error:.2e} against plain {plain_error:.2e}"


SCALED_FLOOR = 2.0**-20  # wkv7.cu's SCALED_FLOOR


def scaled_walk(state: torch.Tensor, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scaled walk's arithmetic for one slot (arguments as `walk`) in float32, with the
    kernel's decisions: rows divided by the running decay product P per key entry; a head folds P
    back in on a chunk's first token and whenever its new P would fall below `SCALED_FLOOR` (or be
    NaN) for any entry; the chunk ends by multiplying the rows by P. Its sums run in torch's order,
    not the kernel's, so it pins the algorithm (accuracy, fold rule), not the kernel's bits.
    Returns (final state, y `[T, H, N]`, folds per head `[H]`)."""
    S = state.float()
    r, w, k, v, a, b = (x.float() for x in inputs)
    heads = S.shape[0]
    P = torch.ones(heads, S.shape[-1], device=S.device)
    folds = torch.zeros(heads, dtype=torch.int64, device=S.device)
    ys = []
    for t in range(r.shape[0]):
        decay = torch.exp(-torch.exp(w[t]))
        product = P * decay
        fold = torch.full((heads,), t == 0, device=S.device) | ~(product >= SCALED_FLOOR).all(-1)
        folds += fold
        sa = S @ (P * a[t]).unsqueeze(-1)
        plain = S * product.unsqueeze(-2) + sa @ b[t].unsqueeze(-2) + v[t].unsqueeze(-1) @ k[t].unsqueeze(-2)
        inverse = 1.0 / torch.where(fold[:, None], torch.ones_like(product), product)
        scaled = S + v[t].unsqueeze(-1) @ (k[t] * inverse).unsqueeze(-2) + sa @ (b[t] * inverse).unsqueeze(-2)
        S = torch.where(fold[:, None, None], plain, scaled)
        P = torch.where(fold[:, None], torch.ones_like(P), product)
        ys.append((S @ (P * r[t]).unsqueeze(-1)).squeeze(-1))
    return S * P.unsqueeze(-2), torch.stack(ys), folds
