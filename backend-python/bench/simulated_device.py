"""A simulated device for `host_overhead.py`: `DeviceStep`'s interface with a clock instead of a model.

A step "runs" on the simulated device when it is issued and the previous one is done, for the
time the H200's measured step profile gives it (`engine_benchmark.py --step-profile`); its sampled
ids (random) arrive when it is done, and the worker waits for them with the GIL released, as it
does on a CUDA event. `SimulatedDevice` is the factory a backend takes (`device_step_factory=`):
plain data, so a worker process can be handed it too; each worker builds its own device, and
`report()` (read through `EngineCore.device_reports()`) says how busy and how idle it was.

Constrained rows: their step leaves them to `sample_masked` as the real one does; once the worker
has filled their masks, an allowed id is picked from each mask on the host (timed and reported
apart as `pick_s`, so it can be discounted) and the masked rows' sampler call runs on the device
after everything queued (`masked_ms`); mask work that does not fit under the forward shows up as
idle time before those calls.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from albatross.constraints import MASK_WORDS
from albatross.model import RWKV7
from albatross.sampler import PenaltyPool
from albatross.state import SlotState
from albatross_engine.device_step import IssuedStep, MaskedRows
from albatross_engine.scheduler import StepPlan

H200_DECODE_MS = 38.7  # a decode-only step at batch 960, 7.2B
H200_MIXED = (67.0, 20.9, 13.5)  # a step with prompt chunks: ms, us per prompt token, us per decode row
# Decode-only graph steps that follow the rows (session 13, 7.2B on the H200): 5.20 ms at batch 1,
# 36.73 at 960; the line through both, for loads far from a full batch.
H200_DECODE_BY_ROWS = (5.17, 0.0329)  # ms, ms per row


@dataclass(frozen=True, slots=True)
class SimulatedDevice:
    decode_ms: float = H200_DECODE_MS
    mixed: tuple[float, float, float] = H200_MIXED
    masked_ms: float = 0.5  # the masked rows' sampler call (mask copy, constrain and sample kernels)
    decode_ms_per_row: float = 0.0  # > 0: a decode-only step takes decode_ms + this per row

    def __call__(self, model: RWKV7, batch_size: int, state_dtype: str = "fp32", cuda_graphs: bool = True) -> SimulatedDeviceStep:
        return SimulatedDeviceStep(self, model, batch_size)


class _DeviceClock:
    """Steps run one after another; each starts when both it is issued and the previous one is done."""

    def __init__(self, device: SimulatedDevice) -> None:
        self.device = device
        self.free_at = 0.0
        self.busy = 0.0
        self.idle_by_kind: dict[str, float] = {}  # idle before a step, by the kind of that step
        self.lock = threading.Lock()

    def run(self, plan: StepPlan) -> float:
        a, b, c = self.device.mixed
        if plan.prefill_tokens:
            ms = a + b * plan.prefill_tokens / 1000 + c * plan.decode_tokens / 1000
        else:
            ms = self.device.decode_ms + self.device.decode_ms_per_row * plan.decode_tokens
        now = time.perf_counter()
        with self.lock:
            if self.free_at and now > self.free_at:
                kind = "mixed" if plan.prefill_tokens else "decode"
                self.idle_by_kind[kind] = self.idle_by_kind.get(kind, 0.0) + now - self.free_at
            start = max(now, self.free_at)
            self.free_at = start + ms / 1000
            self.busy += ms / 1000
            return self.free_at

    def run_after(self, ms: float) -> float:
        """A call issued now that runs after everything queued (the masked rows' sampler call)."""
        now = time.perf_counter()
        with self.lock:
            if self.free_at and now > self.free_at:
                self.idle_by_kind["masked"] = self.idle_by_kind.get("masked", 0.0) + now - self.free_at
            self.free_at = max(now, self.free_at) + ms / 1000
            self.busy += ms / 1000
            return self.free_at


class _Done:
    def __init__(self, at: float) -> None:
        self.at = at

    def synchronize(self) -> None:
        delay = self.at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)  # releases the GIL, like waiting on a CUDA event


class SimulatedDeviceStep:
    def __init__(self, device: SimulatedDevice, model: RWKV7, batch_size: int) -> None:
        self.clock = _DeviceClock(device)
        self.masked_ms = device.masked_ms
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.device = model.device
        self._rng = random.Random(0)
        self._np_rng = np.random.default_rng(0)
        self._masks = np.zeros((batch_size, MASK_WORDS), dtype=np.int32)
        self._masked_rows: dict[int, list[int]] = {}  # id(issued) -> the sample rows of its masked rows
        self.pick_s = 0.0  # host time spent picking the simulated masked samples (not the engine's)
        # The stand-in model's states: a server's state cache reads and writes real (tiny) states.
        self.pool = model.new_pool(batch_size, torch.float32)
        self._penalties: PenaltyPool | None = None

    def issue(self, plan: StepPlan) -> IssuedStep:
        issued = IssuedStep(plan)
        done = self.clock.run(plan)
        ids = [self._rng.randrange(1, 65530) for _ in range(plan.sample_count)]
        issued.host_ids = torch.tensor(ids, dtype=torch.int64)
        masked = [row for row in plan.rows if row.samples and row.task.matcher is not None]
        if masked:
            issued.masked = MaskedRows(tasks=[row.task for row in masked], logits=None, inputs=None)  # type: ignore[arg-type]
            self._masked_rows[id(issued)] = [row.sample_row for row in masked]
        else:
            issued.copied = _Done(done)  # type: ignore[assignment]
        return issued

    def mask_rows(self, count: int) -> np.ndarray:
        return self._masks[:count]

    def sample_masked(self, issued: IssuedStep, mask_index: list[int], mask_count: int) -> None:
        """An allowed id per masked row: the lowest set bit of a random word, else of the first
        nonzero word (structural positions allow few ids)."""
        issued.masked = None
        started = time.perf_counter()
        sample_rows = self._masked_rows.pop(id(issued))
        assert issued.host_ids is not None
        words = self._masks[:mask_count].view(np.uint32)
        pick = bits = np.zeros(0, dtype=np.int64)
        if mask_count:
            pick = self._np_rng.integers(0, MASK_WORDS, mask_count)
            chosen = words[np.arange(mask_count), pick]
            empty = chosen == 0
            if empty.any():
                first = np.argmax(words[empty] != 0, axis=1)
                pick[empty], chosen[empty] = first, words[empty][np.arange(len(first)), first]
            lowest = chosen & (~chosen + np.uint32(1))  # the word's lowest set bit
            bits = np.log2(np.maximum(lowest, 1)).astype(np.int64)
        ids = issued.host_ids.tolist()
        for n, sample_row in enumerate(sample_rows):
            k = mask_index[n]
            ids[sample_row] = 32 * int(pick[k]) + int(bits[k]) if k >= 0 else self._rng.randrange(1, 65530)
        issued.host_ids = torch.tensor(ids, dtype=torch.int64)
        with self.clock.lock:  # report() reads and resets it from another thread
            self.pick_s += time.perf_counter() - started
        issued.copied = _Done(self.clock.run_after(self.masked_ms))  # type: ignore[assignment]

    def report(self) -> dict[str, object]:
        """The device's figures since the previous report."""
        with self.clock.lock:
            idle, busy = self.clock.idle_by_kind, self.clock.busy
            self.clock.idle_by_kind, self.clock.busy = {}, 0.0
            pick, self.pick_s = self.pick_s, 0.0
        return {"busy_s": busy, "idle_s": sum(idle.values()), "idle_by_kind_s": idle, "pick_s": pick}

    @property
    def penalties(self) -> PenaltyPool:
        """Built at the first request whose prompt seeds penalties (a [batch, vocab] pair: not up front)."""
        if self._penalties is None:
            self._penalties = PenaltyPool(self.pool.batch_size, self.vocab_size)
        return self._penalties

    def warm_long_prefill(self, prefill_budget: int) -> None:
        pass  # no kernels to build

    def reset_slots(self, slots: list[int]) -> None:
        self.pool.reset(slots)

    def copy_slot(self, source: int, targets: list[int]) -> None:
        self.pool.copy(source, targets)

    def live_state(self, slot: int) -> SlotState:
        return self.pool.view(slot)

    def write_state(self, slot: int, state: SlotState) -> None:
        self.pool.write(slot, state)

    def forget_last_step(self, step: IssuedStep | None = None) -> None:
        pass

    def peak_memory_bytes(self) -> int:
        return 0
