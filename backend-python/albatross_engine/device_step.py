"""The device side of a worker: its model, state slots and penalties, and how one step is issued.

`issue(plan)` builds the flat inputs (prompt chunks from the host, decode tokens from the previous
step's sampled ids), runs ONE model call for all rows, samples every sampling row in ONE sampler
call, and starts an asynchronous copy of just the sampled ids to the host. Nothing here waits for
the device except `IssuedStep.token_ids()` (the one sync per step) and state reads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from albatross.model import RWKV7
from albatross.sampler import PenaltyPool, SamplingBatch, TopLogprobs, sample, top_logprobs
from albatross.state import SlotState
from albatross_engine.scheduler import RowKind, StepPlan

logger = logging.getLogger(__name__)

STATE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(slots=True)
class IssuedStep:
    """A step sent to the device; its sampled ids reach the host on the first `token_ids()`."""

    plan: StepPlan
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
    def __init__(self, model: RWKV7, batch_size: int, state_dtype: str = "fp32", cuda_graphs: bool = True) -> None:
        self.model = model
        self.device = model.device
        self.pool = model.new_pool(batch_size, STATE_DTYPES[state_dtype])
        self.penalties = PenaltyPool(batch_size, model.config.vocab_size, model.device)
        self.vocab_size = model.config.vocab_size
        self._decode_graphs = _decode_graph_runner(model, self.pool, batch_size) if cuda_graphs else None
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
        previous_ids = self._last.token_ids() if plan.decode_tokens and self._last is not None else []
        slots = [row.slot for row in plan.rows]
        tokens = [
            row.task.prompt_tokens[row.start : row.stop] if row.kind is RowKind.PREFILL else [previous_ids[row.input_row]]
            for row in plan.rows
        ]
        if self._decode_graphs is not None and not plan.prefill_tokens:
            logits = self._decode_graphs.forward(self.pool, slots, tokens)  # type: ignore[attr-defined]
        else:
            logits = self.model.forward(self.pool, slots, tokens)
        issued = IssuedStep(plan)
        if plan.sample_count:
            self._sample(plan, logits, issued)
        self._last = issued
        return issued

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
        ids = sample(logits, slot_index, batch, self.penalties)
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


def _decode_graph_runner(model: RWKV7, pool: object, batch_size: int) -> object | None:
    """The CUDA-graph seam: `albatross.cuda_graphs.DecodeGraphRunner(model, pool, max_batch)` with
    `forward(pool, slots, tokens)` (one token per slot; the contract of `model.forward`), used for
    decode-only steps when the kernels provide it; otherwise decode runs eagerly."""
    if model.device.type != "cuda":
        return None
    try:
        from albatross.cuda_graphs import DecodeGraphRunner  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        return DecodeGraphRunner(model, pool, batch_size)
    except Exception:
        logger.exception("CUDA graphs unavailable; decoding eagerly")
        return None
