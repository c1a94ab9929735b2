"""Which WKV kernel runs a forward call: the sequential one (`ops.wkv7`: decode steps, short or
many chunks) or the chunked-parallel Triton prefill (`wkv_chunked_triton`: few long chunks).

The sequential kernel walks a slot's tokens one after another, ~1 us a token for each (slot,
head), so a call of a few long chunks leaves most of the GPU idle; the chunked kernel does ~2.5x
the arithmetic per token but in parallel matrix products, so it wins until the sequential grid
fills the GPU. The decision uses only host-side lengths (no device sync). `POLICY` holds the
measured switch point (docs/kernels.md, "Chunked WKV prefill"); benchmarks replace it.

A call that mixes a run of long slots with short ones (the engine's step: decode rows, then a
long prompt's chunk) is split by rows: the run takes the chunked kernel, the short slots before
and after it the sequential one, each part on its own rows. The chunked kernel's grid is sized by
its slot count times its longest slot's chunks, so short slots riding in it would launch mostly
empty programs (960 decode rows next to a 4,096-token chunk: about 16 million a layer).

A whole call on the sequential kernel also gets its launch shape, one state row a thread or two
(`LAYOUT`); a split call's sequential parts keep one.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from albatross import ops
from albatross.wkv_chunked import CHUNK

log = logging.getLogger("albatross.kernels")


@dataclass(frozen=True, slots=True)
class ChunkedPolicy:
    """Take the chunked kernel for the slots of `min_tokens` tokens or more, when they are
    consecutive in the call and, times the heads, at most `max_long_heads` sequential chains (past
    that the sequential kernel's grid fills the GPU and its lower arithmetic wins); the call's
    other slots take the sequential kernel. `enabled=False` always takes the sequential kernel."""

    # Measured on an H100 with the prepare kernel at 2 warps (docs/performance.md, "Session 16"),
    # ms a layer, chunked against sequential: 1x512 0.13 / 0.34-0.36, 1x4096 0.86 / 3.78, and
    # 4x1024 0.77 / 0.97, so up to four long slots' heads run chunked; 16x2048 loses (5.7 / 3.6).
    # One slot of 256 is a near tie (0.12-0.15 / 0.16-0.17), so the switch stays at 512.
    min_tokens: int = 512
    max_long_heads: int = 256
    enabled: bool = True

    def __post_init__(self) -> None:
        if self.min_tokens < 2 or self.max_long_heads < 1:
            raise ValueError(f"min_tokens must be >= 2 and max_long_heads >= 1, got {self}")

    def chunked_run(self, lengths: tuple[int, ...], heads: int) -> tuple[int, int] | None:
        """The slots [start, stop) that take the chunked kernel: every long slot (`min_tokens` or
        more), when they are consecutive and at most `max_long_heads` chains; None when the whole
        call takes the sequential kernel (no long slot, too many, or long slots apart)."""
        if not self.enabled or not lengths or max(lengths) < self.min_tokens:
            return None
        long = [i for i, n in enumerate(lengths) if n >= self.min_tokens]
        start, stop = long[0], long[-1] + 1
        if stop - start != len(long) or len(long) * heads > self.max_long_heads:
            return None
        return start, stop

    def prefers_chunked(self, lengths: tuple[int, ...], heads: int) -> bool:
        return self.chunked_run(lengths, heads) is not None


DEFAULT_POLICY = ChunkedPolicy()
POLICY = DEFAULT_POLICY  # benchmarks replace it to compare the kernels


@dataclass(frozen=True, slots=True)
class SequentialLayout:
    """The sequential kernel's launch shape for a call with prompt chunks: two state rows a
    thread (one warp a (slot, head)) when every slot has `min_tokens` tokens or more and the
    call's chains (slots times heads) give each SM `chains_per_sm` or more; else one row a thread.
    Two rows share each shared-memory read of a token's vectors between twice the rows, but a
    chain then has half the threads, so it pays only once the chains fill the GPU, and one-token
    slots (decode rows riding in the call) load their states with half the bytes in flight.

    With `direct_chains_per_sm` chains an SM or more, the two rows of a thread go straight between
    memory and its registers (`direct_rows`): no shared-memory tile, so 12 blocks share an SM
    instead of 10, which pays once there are blocks to fill them; with fewer, the tile's coalesced
    loads win.

    `scaled_rows` has those two-row walks keep the rows divided by their running decay product
    (the op's `scaled_rows`): two FMAs an entry a token instead of three, the same result but for
    rounding (docs/kernels.md, "Scaled walk"). On: an H100 walked one layer of 64 x 512 in 2,759
    us instead of 2,954 (fp16 state, direct rows) and the 7.2B 64 x 512 prefill ran 0.9% faster
    (docs/performance.md, "Session 22")."""

    # An H100 (132 SMs), one layer of 64 heads, fp32 state (docs/performance.md, "Session 17"), us
    # one row / two rows a thread: 4x512 493 / 575, 8x512 610 / 587, 16x512 900 / 827, 64x512
    # 3,543 / 3,300; 4x128 115 / 137, 16x128 236 / 218, 128x128 1,792 / 1,728; 1x4096 3,746 / 4,498.
    min_tokens: int = 128
    chains_per_sm: int = 3
    # An H200 (132 SMs), fp16 state ("Session 19"), us, two rows with the tile / direct: 8x512
    # (3.9 chains an SM) 590 / 762, 64x512 (31) 3,269 / 2,960, 128x128 (62) 1,674 / 1,503. An
    # H100, scaled walk ("Session 22"), tile / direct: 32x512 (15.5) 1,542 / 1,671 with fp16
    # state and 1,559 / 1,636 with fp32, so the tile still wins there. The threshold sits between
    # 15.5 and 31, where the direct kernel's 12 blocks an SM start to save a wave over the tile's
    # 10 (none measured between the two).
    direct_chains_per_sm: int = 24
    scaled_rows: bool = True

    def launch(self, slots: int, shortest: int, heads: int, multiprocessors: int) -> tuple[int, bool, bool]:
        """(rows_per_thread, direct_rows, scaled_rows) for the sequential kernel."""
        chains = slots * heads
        if shortest < self.min_tokens or chains < self.chains_per_sm * multiprocessors:
            return 1, False, False
        return 2, chains >= self.direct_chains_per_sm * multiprocessors, self.scaled_rows


LAYOUT = SequentialLayout()


@functools.cache
def multiprocessors(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


_chunked: Any = None  # the Triton module once imported; False when it cannot be
Cuts = tuple[tuple[int, ...], ...]  # per call slot: token counts after which its state is captured
_parts_cache: tuple[ops.FlatBatch, tuple[int, int] | None, Cuts | None, list[Part]] | None = None  # one batch's split, reused by every layer


@dataclass(frozen=True, slots=True)
class Part:
    """Consecutive slots of a call that one kernel runs: their rows [row_start, row_stop) of the
    call's inputs, pool indices, row bounds rebased to the part's first row, and host lengths. A
    part that ends at a checkpoint holds one slot, whose state then goes to `capture`."""

    chunked: bool
    row_start: int
    row_stop: int
    slot_idx: torch.Tensor
    cu_seqlens: torch.Tensor
    lengths: tuple[int, ...]
    offsets: torch.Tensor | None  # the chunked kernel's chunk offsets (device int32)
    capture: int = -1  # a sequential part: after it, its one slot's state goes to this capture; -1: none
    chunk_captures: torch.Tensor | None = None  # a chunked part: per chunk, a capture index or -1 (device int32)


def chunked_kernel_available() -> bool:
    """Import the Triton kernels once (triton ships with CUDA builds of torch); False without it."""
    global _chunked
    if _chunked is None:
        try:
            from albatross import wkv_chunked_triton

            _chunked = wkv_chunked_triton
        except ImportError as error:  # a CPU build of torch or no triton: the sequential kernel serves
            log.info("chunked WKV prefill unavailable (%s); the sequential kernel runs every call", error)
            _chunked = False
    return _chunked is not False


def wkv7(
    state: torch.Tensor,
    batch: ops.FlatBatch,
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    policy: ChunkedPolicy | None = None,
    cuts: Cuts | None = None,
    captures: torch.Tensor | None = None,
) -> torch.Tensor:
    """`ops.wkv7` for one layer of a forward call, on the kernels the policy picks. With `cuts`,
    slot s's state after its first `cuts[s][j]` tokens is copied into `captures` ([checkpoints,
    H, N, N], in order of slot then cut). Such a slot runs its rows up to its first cut on the
    sequential kernel, then the rest on the chunked kernel when the policy takes that rest as a
    long slot and its cuts fall on chunk ends (the kernel copies the state out after those
    chunks), else in pieces on the sequential kernel (a launch a piece; its walk is one token
    after another anyway)."""
    policy = POLICY if policy is None else policy
    if cuts is not None and not any(cuts):
        cuts = None
    run = None
    if state.is_cuda and not batch.single_token and chunked_kernel_available():
        lengths = batch.lengths if cuts is None else tuple(_policy_length(n, c) for n, c in zip(batch.lengths, cuts))
        run = policy.chunked_run(lengths, state.shape[1])
    if run is None and cuts is None:
        rows, direct, scaled = 1, False, False
        if state.is_cuda and not batch.single_token:
            rows, direct, scaled = LAYOUT.launch(len(batch.lengths), batch.shortest, state.shape[1], multiprocessors(state.get_device()))
        return ops.wkv7(state, batch.slot_idx, batch.cu_seqlens, r, w, k, v, a, b, batch.single_token, rows, direct, scaled)
    chunked = _chunked.wkv7_chunked_triton if run is not None else _no_chunked_kernel
    return run_parts(state, _parts(batch, run, cuts), (r, w, k, v, a, b), chunked, ops.wkv7, captures)


def check_cuts(cuts: tuple[int, ...], length: int) -> None:
    """One slot's cuts: strictly increasing token counts inside its `length` rows (ValueError)."""
    if list(cuts) != sorted(set(cuts)) or (cuts and not 1 <= cuts[0] <= cuts[-1] < length):
        raise ValueError(f"cuts {list(cuts)} must increase within [1, {length})")


def _policy_length(length: int, cuts: tuple[int, ...]) -> int:
    """What the policy sees of a slot: with cuts, the part after its first cut when the chunked
    kernel could capture the others (each a whole number of chunks past the first), else 1."""
    if not cuts:
        return length
    return length - cuts[0] if all((cut - cuts[0]) % CHUNK == 0 for cut in cuts) else 1


def _no_chunked_kernel(*args: object, **options: object) -> torch.Tensor:
    raise AssertionError("a part was planned on the chunked kernel without one")


def run_parts(
    state: torch.Tensor,
    parts: list[Part],
    inputs: tuple[torch.Tensor, ...],
    chunked: Callable[..., torch.Tensor],
    sequential: Callable[..., torch.Tensor],
    captures: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each part on its kernel and its own rows of `inputs` (r, w, k, v, a, b), in order, the
    outputs joined in row order; a part with a capture index then copies its slot's state into
    `captures` (on the device, no sync). Parts of different slots advance independently; the
    pieces of one slot are consecutive parts."""
    outputs = []
    for part in parts:
        rows = [x[part.row_start : part.row_stop] for x in inputs]
        if part.chunked and part.chunk_captures is not None:
            outputs.append(chunked(state, part.slot_idx, part.cu_seqlens, *rows, part.lengths, offsets=part.offsets,
                                   captures=captures, chunk_captures=part.chunk_captures))  # fmt: skip
        elif part.chunked:
            outputs.append(chunked(state, part.slot_idx, part.cu_seqlens, *rows, part.lengths, offsets=part.offsets))
        else:
            single = all(n == 1 for n in part.lengths)
            outputs.append(sequential(state, part.slot_idx, part.cu_seqlens, *rows, single))
        if part.capture >= 0:
            assert captures is not None, "a checkpoint without a buffer to capture it in"
            captures[part.capture : part.capture + 1].copy_(state.index_select(0, part.slot_idx))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def split_parts(
    batch: ops.FlatBatch,
    run: tuple[int, int] | None,
    chunk_offsets: Callable[[tuple[int, ...]], list[int]] | None,
    cuts: Cuts | None = None,
) -> list[Part]:
    """The call cut into parts: the chunked run (slots [run[0], run[1])), the pieces of each slot
    with cuts (capture indices in order of slot then cut), and the sequential slots between them,
    grouped. A slot with cuts runs up to its first cut on the sequential kernel; in the run, the
    rest is one chunked part that captures at its other cuts (whole chunks past the first cut,
    `_policy_length`), else the rest goes in sequential pieces. Every part's device index tensors
    come from one host copy (no sync). `chunk_offsets` builds the chunked kernel's offsets (None:
    the part gets none, as the torch twin needs none)."""
    count = len(batch.lengths)
    bounds = [0]
    for n in batch.lengths:
        bounds.append(bounds[-1] + n)

    def in_run(slot: int) -> bool:
        return run is not None and run[0] <= slot < run[1]

    spans: list[_Span] = []
    captured = 0
    slot = 0
    while slot < count:
        slot_cuts = cuts[slot] if cuts is not None else ()
        if slot_cuts:
            length = batch.lengths[slot]
            check_cuts(slot_cuts, length)
            pieces = [0, *slot_cuts, length]
            if in_run(slot):  # the first piece, then the rest in one chunked part
                first = slot_cuts[0]
                spans.append(_Span(slot, slot + 1, False, bounds[slot], bounds[slot] + first, captured))
                marks = {(cut - first) // CHUNK - 1: captured + j for j, cut in enumerate(slot_cuts[1:], 1)}
                spans.append(_Span(slot, slot + 1, True, bounds[slot] + first, bounds[slot] + length, -1, marks))
            else:
                for j in range(len(pieces) - 1):
                    capture = captured + j if j < len(slot_cuts) else -1
                    spans.append(_Span(slot, slot + 1, False, bounds[slot] + pieces[j], bounds[slot] + pieces[j + 1], capture))
            captured += len(slot_cuts)
            slot += 1
            continue
        last = slot + 1
        while last < count and not (cuts is not None and cuts[last]) and in_run(last) == in_run(slot):
            last += 1
        spans.append(_Span(slot, last, in_run(slot), bounds[slot], bounds[last], -1))
        slot = last
    host: list[int] = []
    layout = []
    for span in spans:
        lengths = (span.row_stop - span.row_start,) if span.last - span.first == 1 else batch.lengths[span.first : span.last]
        rebased = [0]
        for n in lengths:
            rebased.append(rebased[-1] + n)
        offsets = chunk_offsets(lengths) if span.chunked and chunk_offsets is not None else []
        chunk_marks = [span.marks.get(c, -1) for c in range(-(-lengths[0] // CHUNK))] if span.marks is not None else []
        layout.append((len(host), len(rebased), len(offsets), len(chunk_marks), lengths))
        host += rebased + offsets + chunk_marks
    ints = ops.host_to_device(torch.tensor(host, dtype=torch.int32), batch.cu_seqlens.device)
    parts = []
    for span, (at, bound_count, offset_count, mark_count, lengths) in zip(spans, layout):
        at_marks = at + bound_count + offset_count
        parts.append(
            Part(
                chunked=span.chunked,
                row_start=span.row_start,
                row_stop=span.row_stop,
                slot_idx=batch.slot_idx[span.first : span.last],
                cu_seqlens=ints[at : at + bound_count],
                lengths=lengths,
                offsets=ints[at + bound_count : at_marks] if offset_count else None,
                capture=span.capture,
                chunk_captures=ints[at_marks : at_marks + mark_count] if span.marks is not None else None,
            )
        )
    return parts


@dataclass(frozen=True, slots=True)
class _Span:
    """A part before its device tensors: slots [first, last), its rows, and what it captures."""

    first: int
    last: int
    chunked: bool
    row_start: int
    row_stop: int
    capture: int
    marks: dict[int, int] | None = None  # a chunked part's captures: chunk index -> capture index


def _parts(batch: ops.FlatBatch, run: tuple[int, int] | None, cuts: Cuts | None) -> list[Part]:
    global _parts_cache
    cached = _parts_cache  # read once: workers on other GPUs replace it from their threads
    if cached is None or cached[0] is not batch or cached[1] != run or cached[2] != cuts:
        offsets = _chunked.chunk_offsets if run is not None else None
        cached = (batch, run, cuts, split_parts(batch, run, offsets, cuts))
        _parts_cache = cached
    return cached[3]
