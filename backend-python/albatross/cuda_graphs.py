"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step at small batch is bound by kernel launches (hundreds per token), not by the GPU, so
the step is captured once per bucket and replayed with one launch. The graph reads its inputs
from static device buffers: the caller's token ids and slots are copied in, rows beyond the real
count are padded with a scratch slot (which the caller reserves and never reads), and the logits
of the real rows are returned as a view of the graph's static output.

    runner = DecodeGraphRunner(model, pool, scratch_slot=pool.batch_size - 1, buckets=(1, 8, 64))
    logits = runner.decode(slots, token_ids)   # device tensors; [len(slots), V] fp32
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from albatross.model import RWKV7
from albatross.ops import FlatBatch
from albatross.state import StatePool


_CAPTURE_LOCK = threading.Lock()  # one graph capture at a time in this process


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def forward_decode(model: RWKV7, pool: StatePool, batch: FlatBatch, token_ids: torch.Tensor) -> torch.Tensor:
    """`model.forward` for one token per slot, from device tensors only (no host work, no syncs),
    so that it can be captured. Returns fp32 logits `[rows, V]`."""
    return model.forward_batch(pool, batch, token_ids)


@dataclass(slots=True)
class _Bucket:
    size: int
    graph: torch.cuda.CUDAGraph
    token_ids: torch.Tensor  # int64 [size]
    slots: torch.Tensor  # int64 [size]
    slots_i32: torch.Tensor  # int32 [size]
    logits: torch.Tensor  # fp32 [size, V]
    batch: FlatBatch  # holds cu_seqlens and the row indices the graph reads: they must outlive it


class DecodeGraphRunner:
    """Captured decode steps for a fixed model and state pool."""

    def __init__(self, model: RWKV7, pool: StatePool, scratch_slot: int, buckets: Sequence[int] = (1, 2, 4, 8, 16, 32, 64)) -> None:
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need a model on a CUDA device")
        pool.check_slot(scratch_slot)
        if not buckets or any(b < 1 for b in buckets):
            raise ValueError(f"buckets must be positive sizes, got {list(buckets)}")
        if max(buckets) > pool.batch_size - 1:
            raise ValueError(f"bucket {max(buckets)} needs more than the pool's {pool.batch_size - 1} non-scratch slots")
        self.model = model
        self.pool = pool
        self.scratch_slot = scratch_slot
        self.memory_pool = torch.cuda.graph_pool_handle()
        self._capture_stream = torch.cuda.Stream(model.device)
        self._buckets: dict[int, _Bucket] = {}
        for size in sorted(set(buckets), reverse=True):  # largest first: later graphs reuse its memory
            self._buckets[size] = self._capture(size)

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self._buckets))

    def _capture(self, size: int) -> _Bucket:
        device = self.model.device
        token_ids = torch.zeros(size, dtype=torch.int64, device=device)
        slots = torch.full((size,), self.scratch_slot, dtype=torch.int64, device=device)
        slots_i32 = slots.to(torch.int32)
        rows = torch.arange(size, dtype=torch.int64, device=device)
        batch = FlatBatch(
            slot_idx=slots_i32,
            cu_seqlens=torch.arange(size + 1, dtype=torch.int32, device=device),
            last_rows=rows,
            lengths=(1,) * size,
            single_token=True,
        )
        # Warm up on a side stream (cuBLAS workspaces, lazy inits) before capturing; every row
        # points at the scratch slot, whose contents are garbage by design.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                forward_decode(self.model, self.pool, batch, token_ids)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # Own stream, relaxed mode, one capture at a time, no GC: docs/performance.md ("Two GPUs").
        with _CAPTURE_LOCK, _no_gc(), torch.cuda.graph(
            graph, pool=self.memory_pool, stream=self._capture_stream, capture_error_mode="relaxed"
        ):
            logits = forward_decode(self.model, self.pool, batch, token_ids)
        return _Bucket(size, graph, token_ids, slots, slots_i32, logits, batch)

    def bucket_for(self, rows: int) -> int:
        for size in self.buckets:
            if size >= rows:
                return size
        raise ValueError(f"{rows} rows exceed the largest captured bucket {self.buckets[-1]}")

    def decode(self, slots: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Advance `slots` (distinct, not the scratch slot) by one token each; returns a view of the
        graph's logits `[len(slots), V]`, valid until the next call with the same bucket."""
        rows = int(slots.shape[0])
        bucket = self._buckets[self.bucket_for(rows)]
        bucket.token_ids[:rows].copy_(token_ids, non_blocking=True)
        bucket.slots[:rows].copy_(slots, non_blocking=True)
        if rows < bucket.size:
            bucket.token_ids[rows:].zero_()
            bucket.slots[rows:].fill_(self.scratch_slot)
        bucket.slots_i32.copy_(bucket.slots)
        bucket.graph.replay()
        return bucket.logits[:rows]
