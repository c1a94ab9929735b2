"""Every device op of the RWKV-7 forward and the sampler, declared once: its schema, and its
pure-torch twin as the implementation for every device that has no kernel of its own (the CPU
path and the test oracle).

Declared with `torch.library` in the namespace `albatross`: the twin is the op's
CompositeExplicitAutograd kernel, and a kernel library (albatross/cuda/*.cu, loaded by
albatross.kernel_loader) adds a CUDA kernel for the same schema with
`STABLE_TORCH_LIBRARY_IMPL(albatross, CUDA, m)`, in either order. Torch's dispatcher then runs the
CUDA kernel for CUDA tensors and the twin for anything else: no Python in between, no host syncs,
capturable in CUDA graphs. Adding an op is one `_declare(schema, twin)` here and one kernel there.
The module-level ops (`ops.wkv7`, ...) are the dispatcher's ops themselves; the twins stay
importable as `<name>_torch`.

Flat-batch conventions shared by every op: the tokens of all slots of one forward call are rows
of `[total_T, C]` tensors; slot s owns rows `cu_seqlens[s]:cu_seqlens[s+1]` and its recurrent
state lives at index `slot_idx[s]` of a `[B, ...]` pool tensor (both int32 on the ops' device).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from albatross import quant, sampler

GROUP_NORM_EPS = 64e-5
HEAD_SIZE = 64
LAYER_NORM_EPS = 1e-5  # F.layer_norm's default, as the reference model uses
NAMESPACE = "albatross"


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

    `slot_idx` (int32) is the pool index of each slot, `cu_seqlens` (int32) its row bounds,
    `last_rows` (int64, for indexing) the flat row of each slot's last token, `lengths` the
    host-side token counts."""

    slot_idx: torch.Tensor
    cu_seqlens: torch.Tensor
    last_rows: torch.Tensor
    lengths: tuple[int, ...]
    single_token: bool = False  # every slot has exactly one row (a decode step): the WKV op's fast path
    shortest: int = 1  # the fewest rows a slot has (the WKV kernel's launch shape depends on it)

    @classmethod
    def build(cls, slots: list[int], lengths: list[int], device: torch.device) -> FlatBatch:
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        host = torch.tensor([*slots, *starts], dtype=torch.int32)
        ints = host_to_device(host, device)
        last = host_to_device(torch.tensor([s - 1 for s in starts[1:]], dtype=torch.int64), device)
        return cls(
            slot_idx=ints[: len(slots)],
            cu_seqlens=ints[len(slots) :],
            last_rows=last,
            lengths=tuple(lengths),
            single_token=all(n == 1 for n in lengths),
            shortest=min(lengths, default=0),
        )


# ----------------------------------------------------------------------------------------------
# declaration

_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")
_TWINS: dict[str, Callable[..., Any]] = {}


def _declare(schema: str, twin: Callable[..., Any]) -> torch._ops.OpOverloadPacket:
    """Define `albatross::<name>` by its schema, with `twin` as the kernel of every device that
    has none of its own; returns the op."""
    name = schema.split("(", 1)[0]
    _LIBRARY.define(schema)
    _LIBRARY.impl(name, twin, "CompositeExplicitAutograd")
    _TWINS[name] = twin
    return getattr(getattr(torch.ops, NAMESPACE), name)


def declared_ops() -> tuple[str, ...]:
    return tuple(sorted(_TWINS))


def registered_cuda_ops() -> tuple[str, ...]:
    """The declared ops for which a loaded kernel library registered a CUDA kernel."""
    return tuple(name for name in declared_ops() if torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{name}", "CUDA"))


@dataclass(slots=True)
class CudaOpSwitch:
    """Whether calls may take op `name`'s CUDA kernel, for an op that a module uses in place of
    others where it applies: allowed (`default` until `set_allowed`; benchmarks and tests compare)
    and registered by a loaded library. A loaded kernel stays registered, so True is remembered;
    until then each call asks the dispatcher."""

    name: str
    default: bool
    allowed: bool = field(init=False)
    _loaded: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.allowed = self.default

    def set_allowed(self, allowed: bool) -> None:
        self.allowed = allowed

    def usable(self) -> bool:
        if not self.allowed:
            return False
        if not self._loaded:
            self._loaded = torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{self.name}", "CUDA")
        return self._loaded


# ----------------------------------------------------------------------------------------------
# the ops and their twins


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
    rows_per_thread: int = 1,
    direct_rows: bool = False,
    scaled_rows: bool = False,
) -> torch.Tensor:
    """The RWKV-7 recurrence (docs/architecture.md, "WKV op"), per token and head:
    `S = S * exp(-exp(w))[None, :] + (S @ a) b^T + v k^T`, `y = S @ r`, in fp32.
    (`single_token` is the caller's promise of one row per slot; `rows_per_thread` (1 or 2) and
    `direct_rows` (two rows a thread loaded straight to registers, no shared-memory tile) are the
    CUDA kernel's launch shape for calls with longer slots; neither changes a result. At two rows
    a thread, `scaled_rows` walks the rows divided by their running decay product, which saves a
    multiply an entry and changes only the rounding (docs/kernels.md, "Scaled walk"). Only the
    CUDA op uses the three.)

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


wkv7 = _declare(
    "wkv7(Tensor(a!) state, Tensor slot_idx, Tensor cu_seqlens, Tensor r, Tensor w, Tensor k, Tensor v, Tensor a, "
    "Tensor b, bool single_token=False, int rows_per_thread=1, bool direct_rows=False, bool scaled_rows=False) -> Tensor",
    wkv7_torch,
)


def add_layer_norm_torch(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float = LAYER_NORM_EPS
) -> torch.Tensor:
    """The residual step of a block: `x += delta` in place (when given), then `layer_norm(x)`."""
    if delta is not None:
        x.add_(delta)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps=eps)


add_layer_norm = _declare(
    f"add_layer_norm(Tensor(a!) x, Tensor? delta, Tensor weight, Tensor bias, float eps={LAYER_NORM_EPS}) -> Tensor",
    add_layer_norm_torch,
)


def shift_mix_torch(
    x: torch.Tensor, shift_state: torch.Tensor, slot_idx: torch.Tensor, cu_seqlens: torch.Tensor, coefficients: torch.Tensor
) -> torch.Tensor:
    """Token shift and lerp mixes: with `prev` each row's preceding token of the same slot (the
    slot's saved shift vector for its first row), `x + (prev - x) * c` for each coefficient vector:
    `[K, T, C]` for coefficients `[K, C]`, `[T, C]` for a vector `[C]`. Then saves each slot's
    last row as its new shift vector."""
    starts = cu_seqlens.to(torch.int64)
    slots = slot_idx.to(torch.int64)
    prev = torch.empty_like(x)
    prev[1:] = x[:-1]
    prev.index_copy_(0, starts[:-1], shift_state.index_select(0, slots))
    shift_state.index_copy_(0, slots, x.index_select(0, starts[1:] - 1))
    delta = prev - x
    if coefficients.dim() == 1:
        return x + delta * coefficients
    return x.unsqueeze(0) + delta.unsqueeze(0) * coefficients.unsqueeze(1)


shift_mix = _declare(
    "shift_mix(Tensor x, Tensor(a!) shift_state, Tensor slot_idx, Tensor cu_seqlens, Tensor coefficients) -> Tensor",
    shift_mix_torch,
)


def norm_mix_decode_torch(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    shift_state: torch.Tensor,
    slot_idx: torch.Tensor,
    coefficients: torch.Tensor,
    eps: float = LAYER_NORM_EPS,
) -> torch.Tensor:
    """`add_layer_norm` then `shift_mix` for decode rows (row t is slot `slot_idx[t]`'s single
    token), as the CUDA kernel computes them in one launch (bit-identical to the two ops' kernels)."""
    h = add_layer_norm(x, delta, weight, bias, eps)
    decode_cu = torch.arange(x.shape[0] + 1, dtype=torch.int32, device=x.device)
    return shift_mix(h, shift_state, slot_idx, decode_cu, coefficients)


norm_mix_decode = _declare(
    "norm_mix_decode(Tensor(a!) x, Tensor? delta, Tensor weight, Tensor bias, Tensor(b!) shift_state, Tensor slot_idx, "
    f"Tensor coefficients, float eps={LAYER_NORM_EPS}) -> Tensor",
    norm_mix_decode_torch,
)


def norm_mix_rows_torch(
    x: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    shift_state: torch.Tensor,
    slot_idx: torch.Tensor,
    cu_seqlens: torch.Tensor,
    coefficients: torch.Tensor,
    eps: float = LAYER_NORM_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_layer_norm` then `shift_mix` for the rows of a flat batch, with the residual out of
    place: returns `(x + delta, mixes)` and leaves x as it is, as the CUDA kernel computes them in
    one launch (bit-identical to the two ops' kernels)."""
    x = x.clone()
    h = add_layer_norm(x, delta, weight, bias, eps)
    return x, shift_mix(h, shift_state, slot_idx, cu_seqlens, coefficients)


norm_mix_rows = _declare(
    "norm_mix_rows(Tensor x, Tensor delta, Tensor weight, Tensor bias, Tensor(a!) shift_state, Tensor slot_idx, "
    f"Tensor cu_seqlens, Tensor coefficients, float eps={LAYER_NORM_EPS}) -> (Tensor, Tensor)",
    norm_mix_rows_torch,
)


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


wkv_prep = _declare(
    "wkv_prep(Tensor(a!) k, Tensor(b!) v, Tensor w_lora, Tensor a_lora, Tensor? v_lora, Tensor? v_first, "
    "Tensor w0, Tensor a0, Tensor? v0, Tensor k_k, Tensor k_a) -> (Tensor, Tensor, Tensor)",
    wkv_prep_torch,
)


def gn_bonus_gate_torch(
    y: torch.Tensor,
    r: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    r_k: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float = GROUP_NORM_EPS,
) -> torch.Tensor:
    """The time-mix output before its projection: per-head group norm of the WKV output plus the
    current-token bonus `sum_j(r * k * r_k)_head * v_head`, times the gate g."""
    T, C = y.shape
    n_head = C // HEAD_SIZE
    normed = F.group_norm(y, num_groups=n_head, weight=weight, bias=bias, eps=eps)
    bonus = (r * k * r_k).view(T, n_head, -1).sum(dim=-1, keepdim=True) * v.view(T, n_head, -1)
    return (normed + bonus.view(T, C)) * g


gn_bonus_gate = _declare(
    "gn_bonus_gate(Tensor y, Tensor r, Tensor k, Tensor v, Tensor g, Tensor r_k, Tensor weight, Tensor bias, "
    f"float eps={GROUP_NORM_EPS}) -> Tensor",
    gn_bonus_gate_torch,
)


def wkv_decode_step_torch(
    state: torch.Tensor,
    slot_idx: torch.Tensor,
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
    ln_w: torch.Tensor,
    ln_b: torch.Tensor,
    eps: float = GROUP_NORM_EPS,
) -> torch.Tensor:
    """A block's WKV step for decode rows (row s is slot `slot_idx[s]`'s single token): `wkv_prep`,
    the WKV op and `gn_bonus_gate`, one after the other, as the CUDA kernel computes them in one
    launch (bit-identical to these three ops' kernels). k and v are updated in place."""
    w, a, b = wkv_prep(k, v, w_lora, a_lora, v_lora, v_first, w0, a0, v0, k_k, k_a)
    decode_cu = torch.arange(r.shape[0] + 1, dtype=torch.int32, device=r.device)
    y = wkv7(state, slot_idx, decode_cu, r, w, k, v, a, b, True)
    return gn_bonus_gate(y, r, k, v, g, r_k, ln_w, ln_b, eps)


wkv_decode_step = _declare(
    "wkv_decode_step(Tensor(a!) state, Tensor slot_idx, Tensor r, Tensor(b!) k, Tensor(c!) v, Tensor g, Tensor w_lora, "
    "Tensor a_lora, Tensor? v_lora, Tensor? v_first, Tensor w0, Tensor a0, Tensor? v0, Tensor k_k, Tensor k_a, "
    f"Tensor r_k, Tensor ln_w, Tensor ln_b, float eps={GROUP_NORM_EPS}) -> Tensor",
    wkv_decode_step_torch,
)


def relu_square_torch(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x).square()


relu_square = _declare("relu_square(Tensor x) -> Tensor", relu_square_torch)


def int8_gemv_torch(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """`x @ (q * scale)` for int8 weights with per-channel scales (W8A16, albatross/quant.py): x
    `[R, K]` with q `[K, N]` int8 and scale `[N]` fp32, or stacks `[B, R, K]`, `[B, K, N]`, `[B, N]`.
    The CUDA kernel takes 1-4 rows; `counters` is its int32 workspace (albatross.linear keeps one per
    device), which the twin does not read."""
    return quant.int8_mm_torch(x, quant.Int8Weight(q, scale))


int8_gemv = _declare("int8_gemv(Tensor x, Tensor q, Tensor scale, Tensor(a!) counters) -> Tensor", int8_gemv_torch)


def gemv_torch(x: torch.Tensor, W: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """`x @ W` for the model's few-row products: x `[R, K]` with W `[K, N]`, or a stack `[B, R, K]`
    with `[B, K, N]`. `counters` is the CUDA kernel's int32 workspace (one zeroed counter per
    256-column tile, left zero after each call; albatross.linear keeps one per device); the twin
    does not read it."""
    return torch.matmul(x, W)


gemv = _declare("gemv(Tensor x, Tensor W, Tensor(a!) counters) -> Tensor", gemv_torch)


def sample_torch(
    logits: torch.Tensor,
    slots: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    decay: torch.Tensor,
    seed32: torch.Tensor,
    step: torch.Tensor,
    penalties: torch.Tensor,
    seen: torch.Tensor,
    update_penalties: bool,
    mask_index: torch.Tensor | None = None,
    mask_words: torch.Tensor | None = None,
    bias_offsets: torch.Tensor | None = None,
    bias_ids: torch.Tensor | None = None,
    bias_values: torch.Tensor | None = None,
    rejection: bool = False,
) -> torch.Tensor:
    """`albatross.sampler.sample` on the op's unpacked arguments: the allowed-token masks are
    `sampler.AllowedTokens(mask_index, mask_words)`, the biases `sampler.LogitBias(bias_offsets,
    bias_ids, bias_values)`; each group is given whole or not at all. `rejection` picks the
    rejection draw (docs/kernels.md "Rejection draw")."""
    if (mask_index is None) != (mask_words is None) or len({t is None for t in (bias_offsets, bias_ids, bias_values)}) > 1:
        raise ValueError("sample: give mask_index with mask_words, and bias_offsets with bias_ids and bias_values")
    allowed = None if mask_index is None or mask_words is None else sampler.AllowedTokens(mask_index, mask_words)
    bias = None
    if bias_offsets is not None and bias_ids is not None and bias_values is not None:
        bias = sampler.LogitBias(bias_offsets, bias_ids, bias_values)
    batch = sampler.SamplingBatch(temperature, top_p, top_k, presence, frequency, decay, seed32, step, allowed, bias)
    return sampler.sample(logits, slots, batch, sampler.PenaltyPool.wrap(penalties, seen), update_penalties, rejection)


_sample = _declare(
    "sample(Tensor logits, Tensor slots, Tensor temperature, Tensor top_p, Tensor top_k, Tensor presence, "
    "Tensor frequency, Tensor decay, Tensor seed32, Tensor step, Tensor(a!) penalties, Tensor(b!) seen, "
    "bool update_penalties, Tensor? mask_index=None, Tensor? mask_words=None, Tensor? bias_offsets=None, "
    "Tensor? bias_ids=None, Tensor? bias_values=None, bool rejection=False) -> Tensor",
    sample_torch,
)


def sample(
    logits: torch.Tensor,
    slots: torch.Tensor,
    batch: sampler.SamplingBatch,
    penalties: sampler.PenaltyPool,
    update_penalties: bool = True,
    rejection: bool | None = None,
) -> torch.Tensor:
    """`albatross.sampler.sample` (same arguments, same result) through the `sample` op: the CUDA
    kernel for CUDA tensors once its library is loaded, the torch sampler otherwise; the batch's
    allowed-token masks and logit biases, if any, go with it. `rejection`: None takes
    `sampler.REJECTION` at the call."""
    allowed, bias = batch.allowed, batch.bias
    return _sample(
        logits.float(),
        slots.to(torch.int64),
        batch.temperature,
        batch.top_p,
        batch.top_k,
        batch.presence,
        batch.frequency,
        batch.decay,
        batch.seed32,
        batch.step,
        penalties.penalties,
        penalties.seen,
        update_penalties,
        None if allowed is None else allowed.index,
        None if allowed is None else allowed.words,
        None if bias is None else bias.offsets,
        None if bias is None else bias.ids,
        None if bias is None else bias.values,
        sampler.REJECTION if rejection is None else rejection,
    )
