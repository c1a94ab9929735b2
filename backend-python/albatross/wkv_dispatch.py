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

Every sequential launch gets its launch shape from its own slots, one state row a thread or two
(`LAYOUT`), a split call's parts too.

A slot whose states the prefix cache captures inside its rows (`cuts`) walks them in pieces, the
state copied out between pieces. The capturing slots' pieces go in stages, the j-th piece of
every such slot in one launch on gathered rows: a launch walks ~1 us a token whatever its width,
so a launch a piece would make a step with 16 capturing slots walk their pieces one after another.
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
# One batch's split, reused by every layer: (batch, run, cuts, launch-shape key, parts).
_parts_cache: tuple[ops.FlatBatch, tuple[int, int] | None, Cuts | None, object, list[Part]] | None = None


@dataclass(frozen=True, slots=True)
class Part:
    """Slots of a call that one kernel launch runs: their rows of the call's inputs (`spans`, one
    range per slot piece, in the launch's slot order), pool indices, row bounds rebased to the
    part's first row, host lengths, and the sequential kernel's launch shape. A part whose spans
    are not one range (a stage of pieces, below) gathers its rows (`gather`) and its output goes
    back to them. After the part, the states of `capture_from` (pool indices) go to `captures`
    rows `capture_at`; `capture` lists those indices on the host."""

    chunked: bool
    spans: tuple[tuple[int, int], ...]
    slot_idx: torch.Tensor
    cu_seqlens: torch.Tensor
    lengths: tuple[int, ...]
    offsets: torch.Tensor | None  # the chunked kernel's chunk offsets (device int32)
    gather: torch.Tensor | None = None  # int64 call rows when `spans` are not one range
    capture: tuple[int, ...] = ()
    capture_at: torch.Tensor | None = None  # int64, one per entry of `capture`
    capture_from: torch.Tensor | None = None  # the pool slots whose states those are
    chunk_captures: torch.Tensor | None = None  # a chunked part: per chunk, a capture index or -1 (device int32)
    launch: tuple[int, bool, bool] = (1, False, False)  # a sequential part: (rows_per_thread, direct_rows, scaled_rows)

    @property
    def row_start(self) -> int:
        return self.spans[0][0]

    @property
    def row_stop(self) -> int:
        return self.spans[-1][1]


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
    chunks), else in pieces on the sequential kernel, in stages with the other such slots'
    pieces (`split_parts`)."""
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
    return run_parts(state, _parts(batch, run, cuts, state), (r, w, k, v, a, b), chunked, ops.wkv7, captures)


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
    """Each part on its kernel and its own rows of `inputs` (r, w, k, v, a, b), in order, each
    output put back at its rows; after a part, its captures copy slot states into `captures` (on
    the device, no sync). Parts of different slots advance independently; the pieces of one slot
    come in order."""
    outputs = []
    for part in parts:
        if part.gather is not None:
            rows = [x.index_select(0, part.gather) for x in inputs]
        else:
            rows = [x[part.row_start : part.row_stop] for x in inputs]
        if part.chunked and part.chunk_captures is not None:
            outputs.append(chunked(state, part.slot_idx, part.cu_seqlens, *rows, part.lengths, offsets=part.offsets,
                                   captures=captures, chunk_captures=part.chunk_captures))  # fmt: skip
        elif part.chunked:
            outputs.append(chunked(state, part.slot_idx, part.cu_seqlens, *rows, part.lengths, offsets=part.offsets))
        else:
            single = all(n == 1 for n in part.lengths)
            outputs.append(sequential(state, part.slot_idx, part.cu_seqlens, *rows, single, *part.launch))
        if part.capture_at is not None:
            assert captures is not None and part.capture_from is not None, "a checkpoint without a buffer to capture it in"
            captures.index_copy_(0, part.capture_at, state.index_select(0, part.capture_from))
    if len(parts) == 1 and parts[0].gather is None:
        return outputs[0]
    y = outputs[0].new_empty((inputs[0].shape[0], *outputs[0].shape[1:]))
    for part, out in zip(parts, outputs):
        if part.gather is None:
            y[part.row_start : part.row_stop] = out
        else:
            y.index_copy_(0, part.gather, out)
    return y


LaunchShape = Callable[[int, int], tuple[int, bool, bool]]  # (slots, shortest) -> the sequential kernel's shape


def split_parts(
    batch: ops.FlatBatch,
    run: tuple[int, int] | None,
    chunk_offsets: Callable[[tuple[int, ...]], list[int]] | None,
    cuts: Cuts | None = None,
    launch: LaunchShape | None = None,
) -> list[Part]:
    """The call cut into parts: the chunked run (slots [run[0], run[1])), the sequential slots
    around it grouped by consecutive rows, and the slots with cuts (capture indices in order of
    slot then cut). A slot with cuts in the run goes up to its first cut on the sequential kernel,
    then the rest in one chunked part that captures at its other cuts (whole chunks past the first
    cut, `_policy_length`). The slots with cuts outside the run go in stages: stage j runs every
    such slot's j-th piece (between its cuts) in one sequential launch on gathered rows, so a call
    with many capturing slots takes as many launches as its most-cut slot has pieces, not one a
    piece (a launch walks ~1 us a token whatever its width: docs/performance.md, "Session 24").
    Those slots' rows are best last in the call (RWKV7.forward_ids puts them there), so that the
    other slots are one run. Every part's device index tensors come from one host copy a dtype
    (no sync). `chunk_offsets` builds the chunked kernel's offsets (None: the part gets none, as
    the torch twin needs none); `launch` gives a sequential part's launch shape (None: one row a
    thread, the shape every kernel build has)."""
    count = len(batch.lengths)
    bounds = [0]
    for n in batch.lengths:
        bounds.append(bounds[-1] + n)

    def in_run(slot: int) -> bool:
        return run is not None and run[0] <= slot < run[1]

    spans: list[_Span] = []
    staged: list[tuple[int, list[int], int]] = []  # (slot, its piece bounds, its first capture index)
    captured = 0
    slot = 0
    while slot < count:
        slot_cuts = cuts[slot] if cuts is not None else ()
        if slot_cuts:
            length = batch.lengths[slot]
            check_cuts(slot_cuts, length)
            if in_run(slot):  # the first piece, then the rest in one chunked part
                first = slot_cuts[0]
                spans.append(_Span((slot,), ((bounds[slot], bounds[slot] + first),), (first,), False, (captured,), capturing=(slot,)))
                marks = {(cut - first) // CHUNK - 1: captured + j for j, cut in enumerate(slot_cuts[1:], 1)}
                spans.append(_Span((slot,), ((bounds[slot] + first, bounds[slot] + length),), (length - first,), True, (), marks))
            else:
                staged.append((slot, [0, *slot_cuts, length], captured))
            captured += len(slot_cuts)
            slot += 1
            continue
        last = slot + 1
        while last < count and not (cuts is not None and cuts[last]) and in_run(last) == in_run(slot):
            last += 1
        spans.append(_Span(tuple(range(slot, last)), ((bounds[slot], bounds[last]),), batch.lengths[slot:last], in_run(slot), ()))
        slot = last
    for stage in range(max((len(pieces) - 1 for _, pieces, _ in staged), default=0)):
        members = [(s, pieces, first) for s, pieces, first in staged if len(pieces) - 1 > stage]
        spans.append(
            _Span(
                tuple(s for s, _, _ in members),
                tuple((bounds[s] + pieces[stage], bounds[s] + pieces[stage + 1]) for s, pieces, _ in members),
                tuple(pieces[stage + 1] - pieces[stage] for _, pieces, _ in members),
                False,
                tuple(first + stage for _, pieces, first in members if stage < len(pieces) - 2),
                capturing=tuple(s for s, pieces, _ in members if stage < len(pieces) - 2),
            )
        )
    return _device_parts(batch, spans, chunk_offsets, launch)


@dataclass(frozen=True, slots=True)
class _Span:
    """A part before its device tensors: its call slots, their rows and lengths, and what it
    captures."""

    slots: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]  # the rows [start, stop) of the call it runs, in its slots' order
    lengths: tuple[int, ...]  # per slot, its rows in the part
    chunked: bool
    captures: tuple[int, ...]  # capture indices after the part
    marks: dict[int, int] | None = None  # a chunked part's captures: chunk index -> capture index
    capturing: tuple[int, ...] = ()  # the slots those captures copy, one per capture

    def merged(self) -> tuple[tuple[int, int], ...]:
        out = [self.ranges[0]]
        for start, stop in self.ranges[1:]:
            if start == out[-1][1]:
                out[-1] = (out[-1][0], stop)
            else:
                out.append((start, stop))
        return tuple(out)


def _device_parts(batch: ops.FlatBatch, spans: list[_Span], chunk_offsets: Callable[[tuple[int, ...]], list[int]] | None, launch: LaunchShape | None) -> list[Part]:
    """Each span as a Part, its index tensors cut from one int32 and one int64 host copy."""
    small: list[int] = []  # int32: rebased bounds, chunk offsets, chunk marks, call-slot positions
    large: list[int] = []  # int64: gathered rows, capture indices
    layout = []
    for span in spans:
        lengths = span.lengths
        rebased = [0]
        for n in lengths:
            rebased.append(rebased[-1] + n)
        offsets = chunk_offsets(lengths) if span.chunked and chunk_offsets is not None else []
        chunk_marks = [span.marks.get(c, -1) for c in range(-(-lengths[0] // CHUNK))] if span.marks is not None else []
        consecutive = all(span.slots[i] + 1 == span.slots[i + 1] for i in range(len(span.slots) - 1))
        positions = ([] if consecutive else list(span.slots)) + list(span.capturing)
        merged = span.merged()
        gather = [row for start, stop in span.ranges for row in range(start, stop)] if len(merged) > 1 else []
        layout.append((len(small), rebased, offsets, chunk_marks, consecutive, len(large), gather, lengths, merged))
        small += rebased + offsets + chunk_marks + positions
        large += gather + list(span.captures)
    device = batch.cu_seqlens.device
    ints = ops.host_to_device(torch.tensor(small, dtype=torch.int32), device)
    longs = ops.host_to_device(torch.tensor(large, dtype=torch.int64), device)
    parts = []
    for span, (at, rebased, offsets, chunk_marks, consecutive, at_long, gather, lengths, merged) in zip(spans, layout):
        at_offsets = at + len(rebased)
        at_marks = at_offsets + len(offsets)
        at_positions = at_marks + len(chunk_marks)
        if consecutive:
            slot_idx = batch.slot_idx[span.slots[0] : span.slots[-1] + 1]
            at_capturing = at_positions
        else:
            slot_idx = batch.slot_idx.index_select(0, ints[at_positions : at_positions + len(span.slots)])
            at_capturing = at_positions + len(span.slots)
        capture_from = batch.slot_idx.index_select(0, ints[at_capturing : at_capturing + len(span.capturing)]) if span.capturing else None
        at_captures = at_long + len(gather)
        shape = launch(len(lengths), min(lengths)) if launch is not None and not span.chunked else (1, False, False)
        parts.append(
            Part(
                chunked=span.chunked,
                spans=merged,
                slot_idx=slot_idx,
                cu_seqlens=ints[at : at + len(rebased)],
                lengths=lengths,
                offsets=ints[at_offsets:at_marks] if offsets else None,
                gather=longs[at_long:at_captures] if gather else None,
                capture=span.captures,
                capture_at=longs[at_captures : at_captures + len(span.captures)] if span.captures else None,
                capture_from=capture_from,
                chunk_captures=ints[at_marks:at_positions] if span.marks is not None else None,
                launch=shape,
            )
        )
    return parts


def _launch_shape(heads: int, multiprocessors: int, layout: SequentialLayout, slots: int, shortest: int) -> tuple[int, bool, bool]:
    return layout.launch(slots, shortest, heads, multiprocessors)


def _parts(batch: ops.FlatBatch, run: tuple[int, int] | None, cuts: Cuts | None, state: torch.Tensor) -> list[Part]:
    global _parts_cache
    shape_key = (LAYOUT, state.shape[1], multiprocessors(state.get_device())) if state.is_cuda and not batch.single_token else None
    cached = _parts_cache  # read once: workers on other GPUs replace it from their threads
    if cached is None or cached[0] is not batch or cached[1] != run or cached[2] != cuts or cached[3] != shape_key:
        offsets = _chunked.chunk_offsets if run is not None else None
        launch = functools.partial(_launch_shape, shape_key[1], shape_key[2], shape_key[0]) if shape_key is not None else None
        cached = (batch, run, cuts, shape_key, split_parts(batch, run, offsets, cuts, launch))
        _parts_cache = cached
    return cached[4]
