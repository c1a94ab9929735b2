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
import time
from dataclasses import dataclass, field

import torch

from albatross.cuda_graphs import DecodeGraphRunner, forward_decode
from albatross.dtypes import DTYPES
from albatross.model import RWKV7
from albatross.ops import FlatBatch, host_to_device
from albatross import ops
from albatross.sampler import MASK32, PenaltyPool, SamplingBatch, TopLogprobs, top_logprobs
from albatross.state import SlotState, StatePool
from albatross_engine.scheduler import Row, RowKind, StepPlan

logger = logging.getLogger(__name__)



@dataclass(slots=True)
class _SamplingInputs:
    batch: SamplingBatch
    slots: torch.Tensor  # the pool slot of each sampling row
    positions: torch.Tensor | None  # the forward rows that sample; None: all of them
    logprob_rows: list[int]  # sampling rows that want logprobs
    logprob_index: torch.Tensor | None
    logprob_k: int


class RowInputsRefused(Exception):
    """A step refused before anything ran on the device (no state touched, no id sampled), because
    of these rows' own values (a top_k no int64 holds, ...): the others can be issued without them."""

    def __init__(self, rows: list[Row], error: Exception) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.rows = rows
        self.error = error


@dataclass(slots=True)
class IssuedStep:
    """A step sent to the device; its sampled ids reach the host on the first `token_ids()`."""

    plan: StepPlan
    ids: torch.Tensor | None = None  # sampled ids on the device, one per sampling row
    host_ids: torch.Tensor | None = None  # filled asynchronously on a GPU
    copied: torch.cuda.Event | None = None
    logprobs: TopLogprobs | None = None
    logprob_rows: dict[int, int] = field(default_factory=dict)  # sample row -> row of `logprobs`
    ids_at: float | None = None  # perf_counter when the ids reached the host (the adaptive budget's clock)
    _ids: list[int] | None = None

    def token_ids(self) -> list[int]:
        if self._ids is None:
            if self.copied is not None:
                self.copied.synchronize()
            self._ids = [] if self.host_ids is None else self.host_ids.tolist()
            self.ids_at = time.perf_counter()
        return self._ids


class DeviceStep:
    def __init__(self, model: RWKV7, batch_size: int, state_dtype: str = "fp32", cuda_graphs: bool = True) -> None:
        self.model = model
        self.device = model.device
        self.vocab_size = model.config.vocab_size
        use_graphs = cuda_graphs and self.device.type == "cuda"
        # Graph replays pad short batches with a scratch slot, which the scheduler never hands out.
        self.pool = model.new_pool(batch_size + (1 if use_graphs else 0), DTYPES[state_dtype])
        self.penalties = PenaltyPool(batch_size, model.config.vocab_size, model.device)
        self._graphs = _decode_graph_runner(model, self.pool, batch_size) if use_graphs else None
        self._largest_bucket = max(self._graphs.buckets) if self._graphs is not None else 0
        self._last: IssuedStep | None = None  # its sampled ids feed the next step's decode rows

    def reset_slots(self, slots: list[int]) -> None:
        """A fresh sequence: zero state and no penalties. The pool's and penalties' own reset build
        their index with a blocking copy, which would wait for the step in flight; this does not."""
        for slot in slots:
            self.pool.check_slot(slot)
        index = host_to_device(torch.tensor(slots, dtype=torch.int64), self.device)
        for tensor in (self.pool.att_shift, self.pool.ffn_shift, self.pool.wkv):
            tensor.index_fill_(1, index, 0)
        self.penalties.penalties.index_fill_(0, index, 0.0)
        self.penalties.seen.index_fill_(0, index, False)

    def copy_slot(self, source: int, targets: list[int]) -> None:
        """Targets continue from the source's state (ordered after the issued steps, no host sync)."""
        for slot in (source, *targets):
            self.pool.check_slot(slot)
        index = host_to_device(torch.tensor(targets, dtype=torch.int64), self.device)
        for tensor in (self.pool.att_shift, self.pool.ffn_shift, self.pool.wkv):
            source_state = tensor[:, source : source + 1]
            tensor.index_copy_(1, index, source_state.expand(-1, len(targets), *source_state.shape[2:]).contiguous())

    def write_state(self, slot: int, state: SlotState) -> None:
        # To the device first without blocking, so a host-side state does not wait for the step in flight.
        self.pool.write(slot, state.to(self.device, non_blocking=True))

    def read_state(self, slot: int) -> SlotState:
        """A copy on the device, ordered after every issued step (no host sync on a GPU)."""
        return self.pool.read(slot, device=self.device)

    def forget_last_step(self, step: IssuedStep | None = None) -> None:
        """Drop the ids that feed the next decode rows (all of them, or only if they are `step`'s)."""
        if step is None or self._last is step:
            self._last = None

    def issue(self, plan: StepPlan) -> IssuedStep:
        """Raises RowInputsRefused when rows' own sampling values cannot become device inputs; then
        nothing ran and the plan may be issued again without them."""
        sampling = self._checked_sampling_inputs(plan) if plan.sample_count else None
        slots = [row.slot for row in plan.rows]
        last = self._last
        if not plan.prefill_tokens and last is not None and last.ids is not None:
            logits = self._decode_from_device(slots, [row.input_row for row in plan.rows], last.ids)
        else:
            previous_ids = last.token_ids() if plan.decode_tokens and last is not None else []
            tokens = [
                row.task.prompt_tokens[row.start : row.stop] if row.kind is RowKind.PREFILL else [previous_ids[row.input_row]]
                for row in plan.rows
            ]
            forwarded = self.model.forward(self.pool, slots, tokens)
            assert isinstance(forwarded, torch.Tensor)  # not full_output: each slot's last row
            logits = forwarded
        issued = IssuedStep(plan)
        if sampling is not None:
            self._sample(logits, sampling, issued)
        self._last = issued
        return issued

    def _decode_from_device(self, slots: list[int], input_rows: list[int], previous: torch.Tensor) -> torch.Tensor:
        index = host_to_device(torch.tensor([slots, input_rows], dtype=torch.int64), self.device)
        token_ids = previous.index_select(0, index[1])
        if self._graphs is not None and len(slots) <= self._largest_bucket:
            return self._graphs.decode(index[0], token_ids)
        batch = FlatBatch.build(slots, [1] * len(slots), self.device)
        return forward_decode(self.model, self.pool, batch, token_ids)

    def _checked_sampling_inputs(self, plan: StepPlan) -> _SamplingInputs:
        try:
            return self._sampling_inputs(plan)
        except Exception as error:
            refused = [row for row in plan.rows if row.samples and not self._row_inputs_build(row)]
            if not refused:
                raise
            raise RowInputsRefused(refused, error) from error

    def _row_inputs_build(self, row: Row) -> bool:
        """Whether one row's sampling values alone become device inputs (only on the error path)."""
        try:
            self._sampling_inputs(StepPlan(rows=[row], sample_count=1))
        except Exception:
            return False
        return True

    def _sampling_inputs(self, plan: StepPlan) -> _SamplingInputs:
        """Per-row sampling settings as device tensors, built on the host and sent with
        page-locked non-blocking copies BEFORE the forward is queued (a blocking copy, or one
        from pageable memory, would wait for the step in flight)."""
        positions = [i for i, row in enumerate(plan.rows) if row.samples]
        tasks = [plan.rows[i].task for i in positions]
        params = [t.sampling for t in tasks]
        floats = host_to_device(torch.tensor(
            [
                [p.temperature for p in params],
                [p.top_p for p in params],
                [p.presence_penalty for p in params],
                [p.frequency_penalty for p in params],
                [p.penalty_decay for p in params],
            ],
            dtype=torch.float32,
        ), self.device)
        # A task samples at most once per step, so its sample number is `sampled - 1`.
        ints = host_to_device(torch.tensor(
            [
                [p.top_k for p in params],
                [t.seed32 & MASK32 for t in tasks],
                [t.sampled - 1 for t in tasks],
                [plan.rows[i].slot for i in positions],
                positions,
            ],
            dtype=torch.int64,
        ), self.device)
        batch = SamplingBatch(
            temperature=floats[0], top_p=floats[1], top_k=ints[0], presence=floats[2],
            frequency=floats[3], decay=floats[4], seed32=ints[1], step=ints[2],
        )  # fmt: skip
        wanted = [n for n, t in enumerate(tasks) if t.sampling.logprobs is not None]
        return _SamplingInputs(
            batch=batch,
            slots=ints[3],
            positions=None if len(positions) == len(plan.rows) else ints[4],
            logprob_rows=wanted,
            logprob_index=host_to_device(torch.tensor(wanted, dtype=torch.int64), self.device) if wanted else None,
            logprob_k=max((tasks[n].sampling.logprobs or 0 for n in wanted), default=0),
        )

    def _sample(self, logits: torch.Tensor, inputs: _SamplingInputs, issued: IssuedStep) -> None:
        if inputs.positions is not None:
            logits = logits.index_select(0, inputs.positions)
        ids = ops.sample(logits, inputs.slots, inputs.batch, self.penalties)  # the CUDA kernel when loaded
        issued.ids = ids
        if inputs.logprob_index is not None:
            index = inputs.logprob_index
            data = top_logprobs(logits.index_select(0, index), inputs.logprob_k, ids.index_select(0, index))
            issued.logprobs = TopLogprobs(
                chosen=None if data.chosen is None else self._to_host(data.chosen),
                top_values=self._to_host(data.top_values),
                top_ids=self._to_host(data.top_ids),
            )
            issued.logprob_rows = {sample_row: n for n, sample_row in enumerate(inputs.logprob_rows)}
        issued.host_ids = self._to_host(ids)
        if self.device.type == "cuda":
            issued.copied = torch.cuda.Event()
            issued.copied.record()  # covers every copy above: they share the stream

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to("cpu", non_blocking=True) if self.device.type == "cuda" else tensor

    def peak_memory_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else 0


def free_device_memory(device: torch.device) -> int:
    """Bytes this process can still allocate on `device`: the driver's free memory plus what the
    caching allocator holds unused, within `torch.cuda.set_per_process_memory_fraction`'s cap."""
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    usable = free + torch.cuda.memory_reserved(device) - allocated
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    if fraction < 1.0:
        usable = min(usable, int(fraction * total) - allocated)
    return max(0, usable)


def graph_buckets(batch_size: int) -> tuple[int, ...]:
    """Powers of two below the batch size, and the batch size itself."""
    sizes = {1 << i for i in range(batch_size.bit_length()) if 1 << i <= batch_size}
    return tuple(sorted(sizes | {batch_size}))


def _decode_graph_runner(model: RWKV7, pool: StatePool, batch_size: int) -> DecodeGraphRunner | None:
    """Captured decode steps, one per bucket; slot `batch_size` of the pool is its scratch slot.
    A capture failure falls back to eager decode."""
    try:
        return DecodeGraphRunner(model, pool, scratch_slot=batch_size, buckets=graph_buckets(batch_size))
    except Exception:
        logger.exception("CUDA graphs unavailable; decoding eagerly")
        return None
