"""The per-layer operations of the RWKV-7 forward that are worth a fused device kernel, each with
its pure-torch twin (the CPU path and the test oracle).

Dispatch: `register_cuda_ops(name=fn, ...)` installs CUDA implementations (the kernel loader calls
it once kernels are built); a public op uses the installed one when its inputs live on a CUDA
device and the torch twin otherwise. The twins stay importable as `<name>_torch`.

Flat-batch conventions shared by every op: the tokens of all slots of one forward call are rows
of `[total_T, C]` tensors; slot s owns rows `cu_seqlens[s]:cu_seqlens[s+1]` and its recurrent
state lives at index `slot_idx[s]` of a `[B, ...]` pool tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

GROUP_NORM_EPS = 64e-5
HEAD_SIZE = 64
LAYER_NORM_EPS = 1e-5  # F.layer_norm's default, as the reference model uses


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor copied to `device` without waiting for the work already queued there.

    A non-blocking copy from pageable memory is not enough: the driver stages pageable memory and
    may synchronise with the stream first, so the host would wait for the step in flight (seen on
    the H200 as a GPU gap after every decode step). From page-locked memory (torch's caching host
    allocator, reused once warm) the copy is truly asynchronous."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True, slots=True)
class FlatBatch:
    """Row bookkeeping of one forward call, built once and shared by every layer.

    `first_rows`/`last_rows` are the flat row of each slot's first/last token, `slot_idx` the pool
    index of each slot (int64 for indexing; `slot_idx_i32`/`cu_seqlens` are the int32 forms the
    kernels take), `lengths` the host-side token counts."""

    slot_idx: torch.Tensor
    slot_idx_i32: torch.Tensor
    cu_seqlens: torch.Tensor
    first_rows: torch.Tensor
    last_rows: torch.Tensor
    lengths: tuple[int, ...]
    single_token: bool = False  # every slot has exactly one row (a decode step): the WKV op's fast path

    @classmethod
    def build(cls, slots: list[int], lengths: list[int], device: torch.device) -> FlatBatch:
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        host = torch.tensor([slots, starts[:-1], [s - 1 for s in starts[1:]]], dtype=torch.int64)
        host = host_to_device(host, device)
        cu = host_to_device(torch.tensor(starts, dtype=torch.int32), device)
        return cls(
            slot_idx=host[0],
            slot_idx_i32=host[0].to(torch.int32),
            cu_seqlens=cu,
            first_rows=host[1],
            last_rows=host[2],
            lengths=tuple(lengths),
            single_token=all(n == 1 for n in lengths),
        )


# ----------------------------------------------------------------------------------------------
# torch twins


def wkv7_torch(
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
) -> torch.Tensor:
    """The RWKV-7 recurrence (docs/architecture.md, "WKV op"), per token and head:
    `S = S * exp(-exp(w))[None, :] + (S @ a) b^T + v k^T`, `y = S @ r`, in fp32.
    (`single_token` is the caller's promise of one row per slot, which only the CUDA op uses.)

    Slots are sorted by length, longest first, so at step t the slots still running are a prefix
    of the sorted list: one batched update per step covers every slot, and a decode-only call
    (all lengths 1) is a single vectorised update. Each slot's state is read once and written
    back once (index_copy_)."""
    B, H, N, _ = state.shape
    total = r.shape[0]
    bounds = cu_seqlens.tolist()
    lengths = [bounds[s + 1] - bounds[s] for s in range(len(bounds) - 1)]
    order = sorted(range(len(lengths)), key=lambda s: -lengths[s])
    device = state.device
    order_t = torch.tensor(order, dtype=torch.int64, device=device)
    slots = slot_idx.to(torch.int64)[order_t]
    starts = torch.tensor([bounds[s] for s in order], dtype=torch.int64, device=device)
    sorted_lengths = [lengths[s] for s in order]

    def heads(x: torch.Tensor) -> torch.Tensor:
        return x.float().view(total, H, N)

    decay = torch.exp(-torch.exp(heads(w)))
    r32, k32, v32, a32, b32 = heads(r), heads(k), heads(v), heads(a), heads(b)
    S = state.index_select(0, slots).float()
    y = torch.empty(total, H, N, dtype=torch.float32, device=device)
    active = len(order)
    for t in range(sorted_lengths[0] if sorted_lengths else 0):
        while sorted_lengths[active - 1] <= t:
            active -= 1
        rows = starts[:active] + t
        s = S[:active]
        sa = s @ a32[rows].unsqueeze(-1)  # [n, H, N, 1]
        s = s * decay[rows].unsqueeze(-2) + sa @ b32[rows].unsqueeze(-2) + v32[rows].unsqueeze(-1) @ k32[rows].unsqueeze(-2)
        S[:active] = s
        y[rows] = (s @ r32[rows].unsqueeze(-1)).squeeze(-1)
    state.index_copy_(0, slots, S.to(state.dtype))
    return y.view(total, H * N).to(r.dtype)


def token_shift_torch(x: torch.Tensor, shift_state: torch.Tensor, batch: FlatBatch) -> torch.Tensor:
    """`prev - x`, where prev is each row's preceding token of the same slot (the slot's saved
    shift vector for its first row); then saves each slot's last row as its new shift vector."""
    prev = torch.empty_like(x)
    prev[1:] = x[:-1]
    prev.index_copy_(0, batch.first_rows, shift_state.index_select(0, batch.slot_idx))
    shift_state.index_copy_(0, batch.slot_idx, x.index_select(0, batch.last_rows))
    return prev - x


def mix_inputs_torch(x: torch.Tensor, delta: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
    """Token-shift interpolation `x + delta * c` for K coefficient vectors at once:
    `coefficients [K, C]` gives `[K, T, C]`."""
    return x.unsqueeze(0) + delta.unsqueeze(0) * coefficients.unsqueeze(1)


def group_norm_bonus_torch(
    y: torch.Tensor,
    r: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    r_k: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    n_head: int,
) -> torch.Tensor:
    """Per-head group norm of the WKV output plus the current-token bonus
    `sum_j(r * k * r_k)_head * v_head`."""
    T, C = y.shape
    normed = F.group_norm(y, num_groups=n_head, weight=weight, bias=bias, eps=GROUP_NORM_EPS)
    bonus = (r * k * r_k).view(T, n_head, -1).sum(dim=-1, keepdim=True) * v.view(T, n_head, -1)
    return normed + bonus.view(T, C)


def relu_square_torch(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x).square()


def add_layer_norm_torch(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The residual step of a block: `x += delta` in place (when given), then `layer_norm(x)`."""
    if delta is not None:
        x.add_(delta)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps=LAYER_NORM_EPS)


def shift_mix_torch(x: torch.Tensor, shift_state: torch.Tensor, batch: FlatBatch, coefficients: torch.Tensor) -> torch.Tensor:
    """`token_shift` then `mix_inputs`: `[K, T, C]` mixes for coefficients `[K, C]`, one `[T, C]`
    mix for a coefficient vector `[C]`; the slots' shift vectors are updated."""
    delta = token_shift_torch(x, shift_state, batch)
    if coefficients.dim() == 1:
        return x + delta * coefficients
    return mix_inputs_torch(x, delta, coefficients)


def wkv_prep_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    w_lora: torch.Tensor,
    a_lora: torch.Tensor,
    v_lora: torch.Tensor | None,
    v_first: torch.Tensor | None,
    w0: torch.Tensor,
    a0: torch.Tensor,
    v0: torch.Tensor | None,
    k_k: torch.Tensor,
    k_a: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The WKV op's inputs from the matmul and LoRA outputs of one block. Updates in place
    `k = k * (1 + (a - 1) * k_a)` and (unless layer 0, where `v_lora`/`v_first`/`v0` are None)
    `v = v + (v_first - v) * sigmoid(v0 + v_lora)`, with `a = sigmoid(a0 + a_lora)`; returns the
    log decay `w = -softplus(-(w0 + w_lora)) - 0.5` (fp32 math, so exp(-exp(w)) ==
    exp(-exp(-0.5) * sigmoid(w0 + w_lora))), `-kk` and `kk * a`, where kk is `k * k_k` l2-normalised
    per 64-wide head (from k before its update)."""
    T, C = k.shape
    H = C // HEAD_SIZE
    kk = F.normalize((k * k_k).view(T, H, HEAD_SIZE), dim=-1, p=2.0).view(T, C)
    a = torch.sigmoid(a0 + a_lora)
    k.mul_(1 + (a - 1) * k_a)
    if v_lora is not None:
        assert v_first is not None and v0 is not None, "v_lora, v_first and v0 go together"
        v.add_((v_first - v) * torch.sigmoid(v0 + v_lora))
    w = (-F.softplus(-(w0.float() + w_lora.float())) - 0.5).to(k.dtype)
    return w, -kk, kk * a


def gn_bonus_gate_torch(
    y: torch.Tensor,
    r: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    r_k: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
) -> torch.Tensor:
    """`(group_norm_bonus(y, r, k, v, ...) * g)`: the time-mix output before its projection."""
    return group_norm_bonus_torch(y, r, k, v, r_k, weight, bias, y.shape[1] // HEAD_SIZE) * g


# ----------------------------------------------------------------------------------------------
# dispatch

_TORCH_OPS: dict[str, Callable[..., Any]] = {
    "wkv7": wkv7_torch,
    "token_shift": token_shift_torch,
    "mix_inputs": mix_inputs_torch,
    "group_norm_bonus": group_norm_bonus_torch,
    "relu_square": relu_square_torch,
    "add_layer_norm": add_layer_norm_torch,
    "shift_mix": shift_mix_torch,
    "wkv_prep": wkv_prep_torch,
    "gn_bonus_gate": gn_bonus_gate_torch,
}
_CUDA_OPS: dict[str, Callable[..., Any]] = {}


def register_cuda_ops(**implementations: Callable[..., Any]) -> None:
    """Install CUDA implementations by op name (same signature as the torch twin). Registering
    again replaces the previous one; an unknown name is refused with the list of known ones."""
    unknown = sorted(set(implementations) - set(_TORCH_OPS))
    if unknown:
        raise ValueError(f"unknown op(s) {', '.join(unknown)}; known: {', '.join(sorted(_TORCH_OPS))}")
    for name, fn in implementations.items():
        if not callable(fn):
            raise TypeError(f"op {name!r} must be callable, got {type(fn).__name__}")
    _CUDA_OPS.update(implementations)


def unregister_cuda_ops(*names: str) -> None:
    """Remove CUDA implementations (all of them when no name is given); the torch twins remain."""
    for name in names or tuple(_CUDA_OPS):
        _CUDA_OPS.pop(name, None)


@contextlib.contextmanager
def cuda_ops_replaced(**implementations: Callable[..., Any]) -> Iterator[None]:
    """Install implementations for the duration of a block, then restore exactly what was there
    (tests use it, so a test never leaves the process without the real kernels)."""
    previous = {name: _CUDA_OPS.get(name) for name in implementations}
    register_cuda_ops(**implementations)
    try:
        yield
    finally:
        for name, fn in previous.items():
            if fn is None:
                _CUDA_OPS.pop(name, None)
            else:
                _CUDA_OPS[name] = fn


def registered_cuda_ops() -> tuple[str, ...]:
    return tuple(sorted(_CUDA_OPS))


def known_ops() -> tuple[str, ...]:
    return tuple(sorted(_TORCH_OPS))


def _pick(name: str, tensor: torch.Tensor) -> Callable[..., Any]:
    if tensor.is_cuda:
        fn = _CUDA_OPS.get(name)
        if fn is not None:
            return fn
    return _TORCH_OPS[name]


def wkv7(
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
) -> torch.Tensor:
    """`single_token`: every slot has exactly one row (row s is slot s's token), so the CUDA op
    can take its decode kernel; the result is bit-identical to the general kernel's."""
    return _pick("wkv7", state)(state, slot_idx, cu_seqlens, r, w, k, v, a, b, single_token)


def token_shift(x: torch.Tensor, shift_state: torch.Tensor, batch: FlatBatch) -> torch.Tensor:
    return _pick("token_shift", x)(x, shift_state, batch)


def mix_inputs(x: torch.Tensor, delta: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
    return _pick("mix_inputs", x)(x, delta, coefficients)


def group_norm_bonus(
    y: torch.Tensor,
    r: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    r_k: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    n_head: int,
) -> torch.Tensor:
    return _pick("group_norm_bonus", y)(y, r, k, v, r_k, weight, bias, n_head)


def relu_square(x: torch.Tensor) -> torch.Tensor:
    return _pick("relu_square", x)(x)


def add_layer_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return _pick("add_layer_norm", x)(x, delta, weight, bias)


def shift_mix(x: torch.Tensor, shift_state: torch.Tensor, batch: FlatBatch, coefficients: torch.Tensor) -> torch.Tensor:
    return _pick("shift_mix", x)(x, shift_state, batch, coefficients)


def wkv_prep(
    k: torch.Tensor,
    v: torch.Tensor,
    w_lora: torch.Tensor,
    a_lora: torch.Tensor,
    v_lora: torch.Tensor | None,
    v_first: torch.Tensor | None,
    w0: torch.Tensor,
    a0: torch.Tensor,
    v0: torch.Tensor | None,
    k_k: torch.Tensor,
    k_a: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _pick("wkv_prep", k)(k, v, w_lora, a_lora, v_lora, v_first, w0, a0, v0, k_k, k_a)


def gn_bonus_gate(
    y: torch.Tensor,
    r: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    r_k: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
) -> torch.Tensor:
    return _pick("gn_bonus_gate", y)(y, r, k, v, g, r_k, weight, bias)
