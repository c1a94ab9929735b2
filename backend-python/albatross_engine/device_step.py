"""The device side of a worker: its model, state slots and penalties, and how one step is issued.

`issue(plan)` builds the flat inputs (prompt chunks from the host, decode tokens from the previous
step's sampled ids), runs ONE model call for all rows, samples every sampling row in ONE sampler
call, and starts an asynchronous copy of just the sampled ids to the host.

A decode-only step takes its input ids straight from the previous step's ids on the device (a
CUDA-graph replay when a bucket fits, else the same decode forward eagerly), so issuing it waits
for nothing: with overlap the device runs step N+1 while the host processes step N. A step with
prompt chunks goes through `model.forward`, whose inputs are host lists, so it first waits for
the previous step's ids (the one sync per step; `IssuedStep.token_ids()`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from albatross.model import RWKV7
from albatross.ops import FlatBatch
from albatross import cuda_ops
from albatross.sampler import PenaltyPool, SamplingBatch, TopLogprobs, top_logprobs
from albatross.state import SlotState, StatePool
from albatross_engine.scheduler import RowKind, StepPlan

logger = logging.getLogger(__name__)

STATE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ForwardDecode = Callable[[RWKV7, StatePool, FlatBatch, torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class IssuedStep:
    """A step sent to the device; its sampled ids reach the host on the first `token_ids()`."""

    plan: StepPlan
    ids: torch.Tensor | None = None  # sampled ids on the device, one per sampling row
    host_ids: torch.Tensor | None = None  # filled asynchronously on a GPU
    copied: torch.cuda.Event | None = None
    logprobs: TopLogprobs | None = None
    logprob_rows: dict[int, int] = field(default_factory=dict)  # sample row -> row of `logprobs`
    _ids: list[int] | None = None

    def token_ids(self) -> list[int]:
        if self._ids is None:
            if self.copied is not None:
                self.copied.synchronize()
            self._ids = [] if self.host_ids is None else self.host_ids.tolist()
        return self._ids


class DeviceStep:
    def __init__(
        self, model: RWKV7, batch_size: int, state_dtype: str = "fp32", cuda_graphs: bool = True, device_decode: bool = True
    ) -> None:
        self.model = model
        self.device = model.device
        self.vocab_size = model.config.vocab_size
        # The decode forward from device ids, when the kernels module provides it.
        self._forward_decode = _import_forward_decode() if device_decode else None
        use_graphs = cuda_graphs and self.device.type == "cuda" and self._forward_decode is not None
        # Graph replays pad short batches with a scratch slot, which the scheduler never hands out.
        self.pool = model.new_pool(batch_size + (1 if use_graphs else 0), STATE_DTYPES[state_dtype])
        self.penalties = PenaltyPool(batch_size, model.config.vocab_size, model.device)
        self._graphs = _decode_graph_runner(model, self.pool, batch_size) if use_graphs else None
        self._largest_bucket = max(self._graphs.buckets) if self._graphs is not None else 0  # type: ignore[attr-defined]
        self._last: IssuedStep | None = None  # its sampled ids feed the next step's decode rows

    def reset_slots(self, slots: list[int]) -> None:
        """A fresh sequence: zero state and no penalties."""
        self.pool.reset(slots)
        self.penalties.reset(slots)

    def write_state(self, slot: int, state: SlotState) -> None:
        self.pool.write(slot, state)

    def read_state(self, slot: int) -> SlotState:
        """A copy on the device, ordered after every issued step (no host sync on a GPU)."""
        return self.pool.read(slot, device=self.device)

    def forget_last_step(self) -> None:
        self._last = None

    def issue(self, plan: StepPlan) -> IssuedStep:
        slots = [row.slot for row in plan.rows]
        last = self._last
        if not plan.prefill_tokens and self._forward_decode is not None and last is not None and last.ids is not None:
            logits = self._decode_from_device(slots, [row.input_row for row in plan.rows], last.ids)
        else:
            previous_ids = last.token_ids() if plan.decode_tokens and last is not None else []
            tokens = [
                row.task.prompt_tokens[row.start : row.stop] if row.kind is RowKind.PREFILL else [previous_ids[row.input_row]]
                for row in plan.rows
            ]
            logits = self.model.forward(self.pool, slots, tokens)
        issued = IssuedStep(plan)
        if plan.sample_count:
            self._sample(plan, logits, issued)
        self._last = issued
        return issued

    def _decode_from_device(self, slots: list[int], input_rows: list[int], previous: torch.Tensor) -> torch.Tensor:
        assert self._forward_decode is not None
        index = torch.tensor([slots, input_rows], dtype=torch.int64).to(self.device, non_blocking=True)
        token_ids = previous.index_select(0, index[1])
        if self._graphs is not None and len(slots) <= self._largest_bucket:
            return self._graphs.decode(index[0], token_ids)  # type: ignore[attr-defined]
        batch = FlatBatch.build(slots, [1] * len(slots), self.device)
        return self._forward_decode(self.model, self.pool, batch, token_ids)

    def _sample(self, plan: StepPlan, logits: torch.Tensor, issued: IssuedStep) -> None:
        positions = [i for i, row in enumerate(plan.rows) if row.samples]
        rows = [plan.rows[i] for i in positions]
        if len(positions) != len(plan.rows):
            logits = logits.index_select(0, torch.tensor(positions, device=logits.device))
        tasks = [row.task for row in rows]
        # A task samples at most once per step, so its sample number is `sampled - 1`.
        batch = SamplingBatch.from_params(
            [t.sampling for t in tasks], [t.seed32 for t in tasks], [t.sampled - 1 for t in tasks], self.device
        )
        slot_index = torch.tensor([row.slot for row in rows], dtype=torch.int64, device=self.device)
        ids = cuda_ops.sample(logits, slot_index, batch, self.penalties)  # the CUDA kernel when loaded
        issued.ids = ids
        wanted = [i for i, t in enumerate(tasks) if t.sampling.logprobs is not None]
        if wanted:
            index = torch.tensor(wanted, device=self.device)
            k = max(tasks[i].sampling.logprobs or 0 for i in wanted)
            issued.logprobs = top_logprobs(logits.index_select(0, index), k, ids.index_select(0, index))
            issued.logprob_rows = {sample_row: n for n, sample_row in enumerate(wanted)}
        if self.device.type == "cuda":
            issued.host_ids = ids.to("cpu", non_blocking=True)
            issued.copied = torch.cuda.Event()
            issued.copied.record()
        else:
            issued.host_ids = ids

    def peak_memory_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else 0


def _import_forward_decode() -> ForwardDecode | None:
    try:
        from albatross.cuda_graphs import forward_decode
    except ImportError:
        return None
    return forward_decode


def graph_buckets(batch_size: int) -> tuple[int, ...]:
    """Powers of two below the batch size, and the batch size itself."""
    sizes = {1 << i for i in range(batch_size.bit_length()) if 1 << i <= batch_size}
    return tuple(sorted(sizes | {batch_size}))


def _decode_graph_runner(model: RWKV7, pool: StatePool, batch_size: int) -> object | None:
    """Captured decode steps (albatross.cuda_graphs.DecodeGraphRunner), one per bucket; slot
    `batch_size` of the pool is its scratch slot. A capture failure falls back to eager decode."""
    try:
        from albatross.cuda_graphs import DecodeGraphRunner

        return DecodeGraphRunner(model, pool, scratch_slot=batch_size, buckets=graph_buckets(batch_size))
    except Exception:
        logger.exception("CUDA graphs unavailable; decoding eagerly")
        return None
