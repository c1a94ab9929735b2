# mypy: disable-error-code="no-untyped-def, attr-defined"
# (the @triton.jit functions are Triton's language, not Python that mypy can check)
"""The chunked-parallel WKV-7 prefill as Triton kernels (the algorithm and its torch twin:
`albatross.wkv_chunked`). Importing this module needs triton; nothing is compiled until the
first call on a GPU (Triton caches the build per shape class).

Two launches per call:
1. `_chunk_inverse_kernel`, one program per (slot, chunk, head): the chunk's unit lower-triangular
   inverse `(I - M_ab)^-1` by forward substitution (it depends on the inputs only, so every chunk
   of every slot runs in parallel) into an fp32 scratch `[chunks, H, L, L]`.
2. `_chunk_scan_kernel`, one program per (slot, head, block of BV value rows): the state rows in
   registers (fp32), the slot's chunks in order, each a handful of small matrix products; a chunk
   whose decay span exceeds `SPAN_LIMIT` (inputs far outside the model's range) runs token by
   token instead. The value rows of the state are independent, so splitting them across programs
   buys parallelism for one long prompt at the cost of recomputing the chunk's L x L matrices.

With `segment` (a multiple of the chunk), a slot longer than one segment also runs in parallel
across its segments, three launches after the inverses: the scan kernel in transition mode, one
program per (segment, head, block of rows of [0; I]), gives each segment's affine map of the state
(`S_end = S_start A + B`: B from a zero start with the inputs, A from the identity with no values);
`_segment_carry_kernel`, one program per (slot, head, block of value rows), walks the slot's
segments in order to find every segment's start state (and the slot's final state) with one
N x N product each; then the scan kernel runs every segment from its start state, writing y. That
is about three times the arithmetic of one walk, but a 4,096-token slot becomes 16 walks of 256
tokens side by side instead of one of 4,096 (the one-walk scan fills the GPU with one slot's
heads, and its chunks go one after another).

All products accumulate in fp32. The default `input_precision="tf32x3"` (three tf32 tensor-core
products per product, fp32-accurate) measured both faster and more accurate on the H200 than
"ieee" (FMA): 1x4096 2.4 against 3.3 ms a layer, final-state error 2.9e-6 against 7.3e-6
(docs/performance.md, "Chunked WKV prefill").
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from albatross import ops
from albatross.wkv_chunked import CHUNK, SPAN_LIMIT

HEAD = 64


@triton.jit
def _chunk_inverse_kernel(
    w_ptr, a_ptr, b_ptr, stride_w, stride_a, stride_b,
    cu_ptr, chunk_offsets_ptr, inv_ptr,
    H: tl.constexpr, N: tl.constexpr, L: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    s, j, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0 = tl.load(cu_ptr + s)
    t1 = tl.load(cu_ptr + s + 1)
    start = t0 + j * L
    if start < t1:
        rows = start + tl.arange(0, L)
        valid = rows < t1
        cols = h * N + tl.arange(0, N)
        rows64 = rows.to(tl.int64)
        mask = valid[:, None]
        w = tl.load(w_ptr + rows64[:, None] * stride_w + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + rows64[:, None] * stride_a + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + rows64[:, None] * stride_b + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        log_decay = tl.where(mask, -tl.exp(w), 0.0)
        c = tl.cumsum(log_decay, axis=0)
        Ra = a * tl.exp(c - log_decay)
        Bi = b * tl.exp(-c)
        t_idx = tl.arange(0, L)
        strict = t_idx[:, None] > t_idx[None, :]
        M = tl.where(strict, tl.dot(Ra, tl.trans(Bi), input_precision=PRECISION), 0.0)
        # Forward substitution, row by row: T[t] = e_t + M[t, :t] @ T[:t] (T starts as I).
        T = tl.where(t_idx[:, None] == t_idx[None, :], 1.0, 0.0)
        for t in tl.static_range(1, L):
            m_row = tl.sum(tl.where(t_idx[:, None] == t, M, 0.0), axis=0)  # M[t, :], zero from t on
            new_row = tl.sum(m_row[:, None] * T, axis=0)
            T = tl.where(t_idx[:, None] == t, T + new_row[None, :], T)
        chunk = tl.load(chunk_offsets_ptr + s) + j
        base = (chunk.to(tl.int64) * H + h) * (L * L)
        tl.store(inv_ptr + base + t_idx[:, None] * L + t_idx[None, :], T)


@triton.jit
def _chunk_scan_kernel(
    state_ptr, slot_idx_ptr, cu_ptr, chunk_offsets_ptr, inv_ptr, y_ptr,
    r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr,
    stride_r, stride_w, stride_k, stride_v, stride_a, stride_b, stride_y,
    span_limit,
    H: tl.constexpr, N: tl.constexpr, L: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
    TRANSITION: tl.constexpr,
):  # fmt: skip
    # TRANSITION: program 0 is a segment, and its state rows are those of [0; I] ([2N, N]): rows
    # below N start at zero and take the values (they become the map's B), rows from N start as
    # the identity and take no values (A). The end state goes to state_ptr [segments, H, 2N, N].
    s, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0 = tl.load(cu_ptr + s)
    t1 = tl.load(cu_ptr + s + 1)
    if t1 > t0:
        vi = vb * BV + tl.arange(0, BV)  # this program's value rows
        kj = tl.arange(0, N)
        t_idx = tl.arange(0, L)
        if TRANSITION:
            state_offsets = ((tl.cast(s, tl.int64) * H + h) * (2 * N) + vi[:, None]) * N + kj[None, :]
            S = tl.where(vi[:, None] - N == kj[None, :], 1.0, 0.0)  # [BV, N]
        else:
            slot = tl.load(slot_idx_ptr + s).to(tl.int64)
            state_offsets = ((slot * H + h) * N + vi[:, None]) * N + kj[None, :]
            S = tl.load(state_ptr + state_offsets).to(tl.float32)  # [BV, N]
        valued = vi < N  # TRANSITION: the rows that take the values (all but the identity's)
        cols = h * N + kj
        vcols = h * N + vi
        strict = t_idx[:, None] > t_idx[None, :]
        lower = t_idx[:, None] >= t_idx[None, :]
        chunk = tl.load(chunk_offsets_ptr + s)
        for start in range(t0, t1, L):
            rows = start + t_idx
            valid = rows < t1
            mask = valid[:, None]
            rows64 = rows.to(tl.int64)
            w = tl.load(w_ptr + rows64[:, None] * stride_w + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            log_decay = tl.where(mask, -tl.exp(w), 0.0)
            c = tl.cumsum(log_decay, axis=0)
            c_last = tl.sum(log_decay, axis=0)  # [N]: padding rows add nothing
            span = tl.max(-c_last, axis=0)
            if span <= span_limit:
                r = tl.load(r_ptr + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                k = tl.load(k_ptr + rows64[:, None] * stride_k + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                a = tl.load(a_ptr + rows64[:, None] * stride_a + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                b = tl.load(b_ptr + rows64[:, None] * stride_b + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                if TRANSITION:
                    v_mask = mask & valued[None, :]
                else:
                    v_mask = mask
                v = tl.load(v_ptr + rows64[:, None] * stride_v + vcols[None, :], mask=v_mask, other=0.0).to(tl.float32)
                inv_c = tl.exp(-c)
                Ra = a * tl.exp(c - log_decay)
                Rr = r * tl.exp(c)
                Bi = b * inv_c
                Ki = k * inv_c
                M_ak = tl.where(strict, tl.dot(Ra, tl.trans(Ki), input_precision=PRECISION), 0.0)
                M_rb = tl.where(lower, tl.dot(Rr, tl.trans(Bi), input_precision=PRECISION), 0.0)
                M_rk = tl.where(lower, tl.dot(Rr, tl.trans(Ki), input_precision=PRECISION), 0.0)
                inv_base = (chunk.to(tl.int64) * H + h) * (L * L)
                T = tl.load(inv_ptr + inv_base + t_idx[:, None] * L + t_idx[None, :])
                St = tl.trans(S)  # [N, BV]
                U = tl.dot(Ra, St, input_precision=PRECISION) + tl.dot(M_ak, v, input_precision=PRECISION)
                Z = tl.dot(T, U, input_precision=PRECISION)  # [L, BV]: z_t = S_{t-1} a_t
                Y = tl.dot(Rr, St, input_precision=PRECISION)
                Y += tl.dot(M_rb, Z, input_precision=PRECISION)
                Y += tl.dot(M_rk, v, input_precision=PRECISION)
                decay_all = tl.exp(c_last)  # the chunk's whole decay; b exp(c_last - c) = Bi exp(c_last)
                S = S * decay_all[None, :]
                S += tl.dot(tl.trans(Z), Bi * decay_all[None, :], input_precision=PRECISION)
                S += tl.dot(tl.trans(v), Ki * decay_all[None, :], input_precision=PRECISION)
                if not TRANSITION:
                    y_offsets = rows64[:, None] * stride_y + vcols[None, :]
                    tl.store(y_ptr + y_offsets, Y.to(y_ptr.dtype.element_ty), mask=mask)
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
                        if TRANSITION:
                            v_t = tl.load(v_ptr + row64 * stride_v + vcols, mask=valued, other=0.0).to(tl.float32)
                        else:
                            v_t = tl.load(v_ptr + row64 * stride_v + vcols).to(tl.float32)
                        sa = tl.sum(S * a_t[None, :], axis=1)
                        S = S * tl.exp(-tl.exp(w_t))[None, :] + sa[:, None] * b_t[None, :] + v_t[:, None] * k_t[None, :]
                        if not TRANSITION:
                            y_t = tl.sum(S * r_t[None, :], axis=1)
                            tl.store(y_ptr + row64 * stride_y + vcols, y_t.to(y_ptr.dtype.element_ty))
            chunk += 1
        tl.store(state_ptr + state_offsets, S.to(state_ptr.dtype.element_ty))


@triton.jit
def _segment_carry_kernel(
    state_ptr, slot_idx_ptr, seg_first_ptr, trans_ptr, start_ptr,
    H: tl.constexpr, N: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Slot s's segments in order: each one's start state into start_ptr [segments, H, N, N]
    (fp32), then S = S A + B with the segment's map; the last S is the slot's new state."""
    s, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g0 = tl.load(seg_first_ptr + s)
    g1 = tl.load(seg_first_ptr + s + 1)
    if g1 > g0:
        slot = tl.load(slot_idx_ptr + s).to(tl.int64)
        vi = vb * BV + tl.arange(0, BV)
        kj = tl.arange(0, N)
        state_offsets = ((slot * H + h) * N + vi[:, None]) * N + kj[None, :]
        S = tl.load(state_ptr + state_offsets).to(tl.float32)  # [BV, N]
        for g in range(g0, g1):
            g64 = tl.cast(g, tl.int64)
            tl.store(start_ptr + ((g64 * H + h) * N + vi[:, None]) * N + kj[None, :], S)
            map_base = (g64 * H + h) * (2 * N)
            B = tl.load(trans_ptr + (map_base + vi[:, None]) * N + kj[None, :])  # [BV, N]
            A = tl.load(trans_ptr + (map_base + N + kj[:, None]) * N + kj[None, :])  # [N, N]
            S = tl.dot(S, A, input_precision=PRECISION) + B
        tl.store(state_ptr + state_offsets, S.to(state_ptr.dtype.element_ty))


def chunk_offsets(lengths: tuple[int, ...] | list[int], chunk: int = CHUNK) -> list[int]:
    """Index of each slot's first chunk in the inverse scratch (prefix sums of ceil(n / chunk))."""
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
    num_warps: int = 8,
    segment: int = 0,
    plan: SegmentPlan | None = None,
) -> torch.Tensor:
    """`ops.wkv7` by chunks. `lengths` are the host-side token counts of the slots (they size the
    launch without a device sync); `offsets` the device int32 form of `chunk_offsets(lengths)`
    when the caller keeps one per batch (built here otherwise). With `segment` > 0 the slots are
    also cut into segments of that many tokens, run in parallel (the module's docstring says
    how); `plan` is `SegmentPlan.build(lengths, segment, device)` when the caller keeps one per
    batch. The plan places the segments by `lengths` alone, so the slots' rows must follow one
    another in order (`cu_seqlens` their prefix sums, as `ops.FlatBatch` builds them). `state` is
    updated in place."""
    _check(state, slot_idx, cu_seqlens, (r, w, k, v, a, b), lengths, block_values)
    total, C = r.shape
    H = state.shape[1]
    y = torch.empty(total, C, dtype=r.dtype, device=r.device)
    slots = len(lengths)
    longest = max(lengths, default=0)
    if slots == 0 or longest == 0:
        return y
    launch = _Launch((r, w, k, v, a, b), y, block_values, precision, num_warps)
    with torch.cuda.device(r.device) if r.is_cuda else contextlib.nullcontext():  # Triton launches on the current device
        if segment:
            _launch_segmented(state, slot_idx, plan or SegmentPlan.build(lengths, segment, r.device), launch, slots)
            return y
        host_offsets = chunk_offsets(lengths)
        if offsets is None:
            offsets = ops.host_to_device(torch.tensor(host_offsets, dtype=torch.int32), r.device)
        inverse = torch.empty(host_offsets[-1], H, CHUNK, CHUNK, dtype=torch.float32, device=r.device)
        launch.inverses(cu_seqlens, offsets, inverse, slots, longest)
        launch.scan(state, slot_idx, cu_seqlens, offsets, inverse, slots, transition=False)
    return y


@dataclass(frozen=True, slots=True)
class _Launch:
    """One call's inputs and kernel settings, with the launches both forms share: `inverses` (one
    program per (slot or segment, chunk, head)) and `scan` (one per (slot or segment, head, block of
    state rows); in transition mode the rows are those of [0; I], twice as many)."""

    inputs: tuple[torch.Tensor, ...]  # r, w, k, v, a, b
    y: torch.Tensor
    block_values: int
    precision: str
    num_warps: int

    @property
    def heads(self) -> int:
        return self.inputs[0].shape[1] // HEAD

    def inverses(self, cu: torch.Tensor, offsets: torch.Tensor, inverse: torch.Tensor, runs: int, longest: int) -> None:
        _, w, _, _, a, b = self.inputs
        _chunk_inverse_kernel[(runs, -(-longest // CHUNK), self.heads)](
            w, a, b, w.stride(0), a.stride(0), b.stride(0), cu, offsets, inverse,
            H=self.heads, N=HEAD, L=CHUNK, PRECISION=self.precision, num_warps=self.num_warps,
        )  # fmt: skip

    def scan(
        self, state: torch.Tensor, slot_idx: torch.Tensor, cu: torch.Tensor, offsets: torch.Tensor, inverse: torch.Tensor, runs: int, transition: bool
    ) -> None:
        rows = 2 * HEAD if transition else HEAD
        strides = (*(x.stride(0) for x in self.inputs), self.y.stride(0))
        _chunk_scan_kernel[(runs, self.heads, rows // self.block_values)](
            state, slot_idx, cu, offsets, inverse, self.y, *self.inputs, *strides, SPAN_LIMIT,
            H=self.heads, N=HEAD, L=CHUNK, BV=self.block_values, PRECISION=self.precision, TRANSITION=transition,
            num_warps=self.num_warps,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class SegmentPlan:
    """One call's segments (built once per batch and shared by its layers): `seg_cu` (int32, the
    segments' row bounds), `seg_offsets` (int32, each segment's first chunk in the inverse
    scratch), `seg_first` (int32, each slot's first segment, slots + 1 entries), `seg_ids`
    (int32, 0..segments-1), the host-side segment lengths and their number of chunks in all."""

    seg_cu: torch.Tensor
    seg_offsets: torch.Tensor
    seg_first: torch.Tensor
    seg_ids: torch.Tensor
    lengths: tuple[int, ...]
    chunks: int

    @classmethod
    def build(cls, lengths: tuple[int, ...] | list[int], segment: int, device: torch.device) -> SegmentPlan:
        if segment < CHUNK or segment % CHUNK:
            raise ValueError(f"segment must be a positive multiple of {CHUNK}, got {segment}")
        pieces: list[int] = []
        first = [0]
        for n in lengths:
            whole, rest = divmod(n, segment)
            pieces += [segment] * whole + ([rest] if rest else [])
            first.append(len(pieces))
        bounds = [0]
        for n in pieces:
            bounds.append(bounds[-1] + n)
        offsets = chunk_offsets(pieces)
        host = torch.tensor([*bounds, *offsets, *first, *range(len(pieces))], dtype=torch.int32)
        ints = ops.host_to_device(host, device)
        a, b, c = len(bounds), 2 * len(bounds), 2 * len(bounds) + len(first)
        return cls(ints[:a], ints[a:b], ints[b:c], ints[c:], tuple(pieces), offsets[-1])


def _launch_segmented(state: torch.Tensor, slot_idx: torch.Tensor, plan: SegmentPlan, launch: _Launch, slots: int) -> None:
    H, segments, longest = state.shape[1], len(plan.lengths), max(plan.lengths)
    device = state.device
    inverse = torch.empty(plan.chunks, H, CHUNK, CHUNK, dtype=torch.float32, device=device)
    maps = torch.empty(segments, H, 2 * HEAD, HEAD, dtype=torch.float32, device=device)
    starts = torch.empty(segments, H, HEAD, HEAD, dtype=torch.float32, device=device)
    launch.inverses(plan.seg_cu, plan.seg_offsets, inverse, segments, longest)
    launch.scan(maps, plan.seg_ids, plan.seg_cu, plan.seg_offsets, inverse, segments, transition=True)
    _segment_carry_kernel[(slots, H, HEAD // launch.block_values)](
        state, slot_idx, plan.seg_first, maps, starts,
        H=H, N=HEAD, BV=launch.block_values, PRECISION=launch.precision, num_warps=launch.num_warps,
    )  # fmt: skip
    launch.scan(starts, plan.seg_ids, plan.seg_cu, plan.seg_offsets, inverse, segments, transition=False)


def _check(
    state: torch.Tensor,
    slot_idx: torch.Tensor,
    cu_seqlens: torch.Tensor,
    inputs: tuple[torch.Tensor, ...],
    lengths: tuple[int, ...] | list[int],
    block_values: int,
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
