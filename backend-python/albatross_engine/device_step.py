"""The device side of a worker: its model, state slots and penalties, and how one step is issued.

`issue(plan)` builds the flat inputs (prompt chunks from the host, decode tokens from the previous
step's sampled ids), runs ONE model call for all rows, samples every sampling row in ONE sampler
call, and starts an asynchronous copy of just the sampled ids to the host.

A decode-only step takes its input ids straight from the previous step's ids on the device (a
CUDA-graph replay when a bucket fits, else the same decode forward eagerly), so issuing it waits
for nothing: with overlap the device runs step N+1 while the host processes step N. A step with
prompt chunks runs the model's eager forward (`forward_ids`) from ids built on the device too:
its prompt chunks copied from the host, its decode rows' ids gathered from the previous step's
ids. So no step waits for the one before it: the host's one sync per step is where it reads a
step's ids to process them (`IssuedStep.token_ids()`).

Rows under a grammar (a task with a matcher) sample in a second, smaller sampler call: the mask
of step N+1 depends on the token of step N, which reaches the host only after step N+1 has been
issued. So `issue` samples the free rows at once and leaves the masked rows' logits on the
issued step (`MaskedRows`); the worker fills their masks from the matchers while the device runs
the forward, and `sample_masked` copies the masks in and samples those rows into the same ids
tensor, before the next step (whose decode reads these ids) is issued. A step without masked
rows runs exactly the one call it always did; decode graphs hold the forward only, so they are
the same either way.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from albatross.cuda_graphs import DecodeGraphRunner, forward_decode
from albatross.dtypes import DTYPES
from albatross.model import RWKV7
from albatross.ops import FlatBatch, host_to_device
from albatross import linear, lora_prep, ops, wkv_dispatch
from albatross.constraints import MASK_WORDS
from albatross.wkv_chunked import CHUNK
from albatross.sampler import MASK32, AllowedTokens, LogitBias, PenaltyPool, SamplingBatch, TopLogprobs, top_logprobs
from albatross.state import SlotState, StatePool
from albatross_engine.scheduler import Row, RowKind, StepPlan
from runner.interface import END_OF_TEXT_TOKEN

if TYPE_CHECKING:
    from albatross_engine.tasks import EngineTask

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _SamplingInputs:
    """One step's sampling rows in call order: the free rows first, then the masked ones (each
    group in sample-row order). Without masked rows, call order is sample-row order."""

    batch: SamplingBatch
    tasks: list[EngineTask]  # the task of each call row
    slots: torch.Tensor  # the pool slot of each call row
    positions: torch.Tensor | None  # the forward row of each call row; None: all rows, in order
    free_count: int  # call rows [0, free_count) sample at once, the rest once their masks are in
    sample_rows: torch.Tensor | None  # the sample row of each call row; None: call order is sample order
    logprob_rows: list[int]  # sample rows that want logprobs
    logprob_index: torch.Tensor | None  # their call rows
    logprob_k: int


class RowInputsRefused(Exception):
    """A step refused before anything ran on the device (no state touched, no id sampled), because
    of these rows' own values (a top_k no int64 holds, ...): the others can be issued without them."""

    def __init__(self, rows: list[Row], error: Exception) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.rows = rows
        self.error = error


@dataclass(slots=True)
class MaskedRows:
    """The sampling rows of an issued step that wait for their grammar masks (`sample_masked`)."""

    tasks: list[EngineTask]  # one per masked row, in call order
    logits: torch.Tensor  # every sampling row's logits in call order; the masked rows are the last
    inputs: _SamplingInputs


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
    masked: MaskedRows | None = None  # rows still to sample once their masks are filled
    # Row index -> the states captured at that row's checkpoints (Row.checkpoints, same order):
    # device tensors of the step's own buffers, to be copied (saved) before they are dropped.
    captured: dict[int, list[SlotState]] = field(default_factory=dict)
    _ids: list[int] | None = None

    def token_ids(self) -> list[int]:
        if self.masked is not None:
            raise RuntimeError("the step's masked rows were never sampled (DeviceStep.sample_masked)")
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
        # Masked rows' allowed-token words: filled on the host in page-locked memory (the copy to
        # the device must not wait for the step in flight), one row per slot at most.
        self._mask_host = torch.zeros(batch_size, MASK_WORDS, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self._mask_host_rows: np.ndarray = self._mask_host.numpy()
        self._mask_words = self._mask_host if self.device.type != "cuda" else torch.zeros_like(self._mask_host, device=self.device)
        self._masks_copied: torch.cuda.Event | None = None  # the host rows are free again once it completes
        self._graphs = _decode_graph_runner(model, self.pool, batch_size) if use_graphs else None
        self._largest_bucket = max(self._graphs.buckets) if self._graphs is not None else 0
        self._last: IssuedStep | None = None  # its sampled ids feed the next step's decode rows

    def warm_long_prefill(self, prefill_budget: int) -> None:
        """Build the chunked WKV kernels a long prompt takes (with and without the prefix cache's
        captures) before any task holds a slot: Triton compiles each variant at its first call,
        seconds the first long prompt after start would otherwise wait. Only on a GPU, and only
        where a step may carry a chunk that long (`prefill_budget`; the warm-up's activations stay
        within the memory plan's). A failure leaves the build to the first long prompt."""
        self._warm_fused_prefill(prefill_budget)
        length = wkv_dispatch.POLICY.min_tokens + CHUNK
        if self.device.type != "cuda" or prefill_budget < length or not wkv_dispatch.chunked_kernel_available():
            return
        if not wkv_dispatch.POLICY.prefers_chunked((length - CHUNK,), self.model.config.n_head):
            return  # this model's long prompts take the sequential kernel
        tokens = [[END_OF_TEXT_TOKEN] * length]
        try:
            self.model.forward(self.pool, [0], tokens)
            self.model.forward_saving(self.pool, [0], tokens, [[CHUNK]])  # the rest after the cut: min_tokens, captured
        except Exception:
            logger.exception("building the chunked WKV kernels at load failed; the first long prompt builds them")
        finally:
            self.reset_slots([0])

    def _warm_fused_prefill(self, prefill_budget: int) -> None:
        """Build the prefill fusions' Triton kernels (`linear.mm_relu_square`, `lora_prep`) where
        a step's prompt rows may take them: one forward of as many rows as their thresholds ask, on
        slot 0 before any task holds a slot (block 0 and the others take different builds)."""
        rows = max(linear.FUSED_RELU_SQUARE_MIN_ROWS, lora_prep.MIN_ROWS)
        if self.device.type != "cuda" or prefill_budget < rows:
            return
        layer = self.model.layers[0]
        probe = torch.empty(rows, self.model.config.n_embd, dtype=self.model.dtype, device=self.device)
        prompt = FlatBatch.build([0], [rows], self.device)
        if not (linear.takes_fused_relu_square(probe, layer.ffn_key) or lora_prep.applies(probe, prompt, layer.lora_down)):
            return
        try:
            self.model.forward(self.pool, [0], [[END_OF_TEXT_TOKEN] * rows])
        except Exception:
            logger.exception("building the fused prefill kernels at load failed; the first long step builds them")
        finally:
            self.reset_slots([0])

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

    def live_state(self, slot: int) -> SlotState:
        """The slot's state as views of the pool, for a store's `put` (which copies it at once, on
        the current stream, after every issued step). Not a copy: `put` copied a copy made here,
        twice the launches and device traffic for each of a 7.2B burst step's ~64 prompt-end saves."""
        return self.pool.view(slot)

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
        captured: dict[int, list[SlotState]] = {}
        if not plan.prefill_tokens and last is not None and last.ids is not None:
            logits = self._decode_from_device(slots, [row.input_row for row in plan.rows], last.ids)
        else:
            cuts = [tuple(length - row.start for length in row.checkpoints) for row in plan.rows]
            lengths = [row.stop - row.start if row.kind is RowKind.PREFILL else 1 for row in plan.rows]
            token_ids = self._mixed_token_ids(plan.rows, last)
            logits, saved = self.model.forward_ids(self.pool, slots, lengths, token_ids, cuts)
            captured = {index: states for index, states in enumerate(saved) if states}
        issued = IssuedStep(plan, captured=captured)
        if sampling is not None:
            self._sample(logits, sampling, issued)
        self._last = issued
        return issued

    def _mixed_token_ids(self, rows: list[Row], last: IssuedStep | None) -> torch.Tensor:
        """The flat token ids of a step with prompt chunks, on the device: the chunks from the host
        (checked at admission), each decode or feed row's id gathered from the previous step's
        sampled ids where they lie. Nothing waits for the step in flight, so this step is queued
        while it runs (waiting for its ids on the host left the GPU idle ~25 ms after every mixed
        step of the 7.2B burst on an H100: docs/performance.md, "Session 14")."""
        flat: list[int] = []
        fed_at: list[int] = []  # flat positions of the decode and feed rows
        fed_from: list[int] = []  # their rows in the previous step's ids
        for row in rows:
            if row.kind is RowKind.PREFILL:
                flat += row.task.prompt_tokens[row.start : row.stop]
            else:
                fed_at.append(len(flat))
                fed_from.append(row.input_row)
                flat.append(0)  # replaced on the device below
        token_ids = host_to_device(torch.tensor(flat, dtype=torch.int64), self.device)
        if fed_at:
            previous = last.ids if last is not None else None
            if previous is None:
                raise RuntimeError("a decode row has no previous step's sampled ids to feed")
            _check_fed_rows(fed_from, previous)
            index = host_to_device(torch.tensor([fed_at, fed_from], dtype=torch.int64), self.device)
            token_ids.index_copy_(0, index[0], previous.index_select(0, index[1]).to(torch.int64))
        return token_ids

    def _decode_from_device(self, slots: list[int], input_rows: list[int], previous: torch.Tensor) -> torch.Tensor:
        _check_fed_rows(input_rows, previous)
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
        sampling = [i for i, row in enumerate(plan.rows) if row.samples]  # in sample-row order
        free = [i for i in sampling if plan.rows[i].task.matcher is None]
        positions = free + [i for i in sampling if plan.rows[i].task.matcher is not None]
        in_order = len(free) == len(sampling)
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
                [plan.rows[i].sample_row for i in positions],
            ],
            dtype=torch.int64,
        ), self.device)
        batch = SamplingBatch(
            temperature=floats[0], top_p=floats[1], top_k=ints[0], presence=floats[2],
            frequency=floats[3], decay=floats[4], seed32=ints[1], step=ints[2],
        )  # fmt: skip
        wanted = [n for n, t in enumerate(tasks) if t.sampling.logprobs is not None]  # call rows
        return _SamplingInputs(
            batch=batch,
            tasks=tasks,
            slots=ints[3],
            positions=None if in_order and len(positions) == len(plan.rows) else ints[4],
            free_count=len(free),
            sample_rows=None if in_order else ints[5],
            logprob_rows=[plan.rows[positions[n]].sample_row for n in wanted],
            logprob_index=host_to_device(torch.tensor(wanted, dtype=torch.int64), self.device) if wanted else None,
            logprob_k=max((tasks[n].sampling.logprobs or 0 for n in wanted), default=0),
        )

    def _rows_batch(self, inputs: _SamplingInputs, start: int, stop: int) -> SamplingBatch:
        """The settings of call rows [start, stop), with their logit biases (sent page-locked)."""
        batch = inputs.batch if (start, stop) == (0, inputs.batch.rows) else inputs.batch.narrow(start, stop)
        bias = LogitBias.from_rows([task.sampling.logit_bias for task in inputs.tasks[start:stop]])
        if bias is not None and self.device.type == "cuda":
            bias = LogitBias(*(host_to_device(tensor, self.device) for tensor in (bias.offsets, bias.ids, bias.values)))
        return batch if bias is None else replace(batch, bias=bias)

    def _sample(self, logits: torch.Tensor, inputs: _SamplingInputs, issued: IssuedStep) -> None:
        if inputs.positions is not None:
            logits = logits.index_select(0, inputs.positions)
        rows, free = inputs.batch.rows, inputs.free_count
        if free == rows:  # no masked rows: the one call of every step
            issued.ids = ops.sample(logits, inputs.slots, self._rows_batch(inputs, 0, rows), self.penalties)
            self._ids_to_host(issued, logits, inputs)
            return
        assert inputs.sample_rows is not None
        issued.ids = torch.zeros(rows, dtype=torch.int64, device=self.device)  # in sample-row order
        if free:
            sampled = ops.sample(logits[:free], inputs.slots[:free], self._rows_batch(inputs, 0, free), self.penalties)
            issued.ids.index_copy_(0, inputs.sample_rows[:free], sampled)
        issued.masked = MaskedRows(tasks=inputs.tasks[free:], logits=logits, inputs=inputs)

    def mask_rows(self, count: int) -> np.ndarray:
        """Host rows [count, MASK_WORDS] for the masks of the masked rows of the step issued last,
        page-locked; free to overwrite (the previous masks have reached the device)."""
        if self._masks_copied is not None:
            self._masks_copied.synchronize()  # done long ago in practice: that step's ids were awaited
        return self._mask_host_rows[:count]

    def sample_masked(self, issued: IssuedStep, mask_index: list[int], mask_count: int) -> None:
        """Sample the issued step's masked rows: masked row r may produce only the ids allowed by
        `mask_rows()[mask_index[r]]` (-1: unconstrained, for a row whose sample will be dropped).
        Then the step's ids (and logprobs) go to the host."""
        masked, issued.masked = issued.masked, None
        assert masked is not None and len(mask_index) == len(masked.tasks)
        inputs, rows, free = masked.inputs, masked.inputs.batch.rows, masked.inputs.free_count
        assert inputs.sample_rows is not None
        batch = self._rows_batch(inputs, free, rows)
        if mask_count:
            words = self._mask_words[:mask_count]
            if self.device.type == "cuda":
                words.copy_(self._mask_host[:mask_count], non_blocking=True)
                self._masks_copied = torch.cuda.Event()
                self._masks_copied.record()
            index = host_to_device(torch.tensor(mask_index, dtype=torch.int64), self.device)
            batch = replace(batch, allowed=AllowedTokens(index=index, words=words))
        sampled = ops.sample(masked.logits[free:], inputs.slots[free:], batch, self.penalties)
        assert issued.ids is not None
        issued.ids.index_copy_(0, inputs.sample_rows[free:], sampled)
        self._ids_to_host(issued, masked.logits, inputs)

    def _ids_to_host(self, issued: IssuedStep, logits: torch.Tensor, inputs: _SamplingInputs) -> None:
        """Logprobs of the rows that want them, then the asynchronous copies to the host."""
        ids = issued.ids
        assert ids is not None
        if inputs.logprob_index is not None:
            index = inputs.logprob_index
            chosen = ids if inputs.sample_rows is None else ids.index_select(0, inputs.sample_rows)  # call order
            data = top_logprobs(logits.index_select(0, index), inputs.logprob_k, chosen.index_select(0, index))
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


def _check_fed_rows(rows: list[int], previous: torch.Tensor) -> None:
    """Refuse, before anything is queued, a row that would gather outside the previous step's
    sampled ids: on a GPU an out-of-range gather is a device-side assert, which ends the process's
    CUDA context and every request on it, not just this step."""
    if rows and not 0 <= min(rows) <= max(rows) < previous.shape[0]:
        bad = min(rows) if min(rows) < 0 else max(rows)
        raise RuntimeError(f"a decode row feeds sampled id {bad} of a step that sampled {previous.shape[0]}")
