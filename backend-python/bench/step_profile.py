"""Per-step device timing for the engine benchmark (`engine_benchmark.py --step-profile`).

Wraps one worker's `DeviceStep.issue` with CUDA events recorded on the worker's stream before and
after the step's work is queued. After the run:
- a step's device span (start event to end event) is its GPU time, plus any time the GPU waited
  inside the step for the host to queue more work;
- the gap between one step's end event and the next step's start event is time the GPU sat idle
  waiting for the host (sync, input building, admission), which no kernel speed-up can recover.

Steps are grouped by kind (decode-only, or with prompt chunks) and, for the mixed steps, a
least-squares fit `ms = a + b * prefill_tokens + c * decode_rows` says what a prompt token and a
riding decode row cost, where the steps differ enough to tell the terms apart (`mixed_step_fit`).

Two host-side figures say where a gap comes from: the host time from the end of one step's issue
to the start of the next (results processed, saves queued, admission, planning), and the caching
allocator's retries, device frees and whole-device syncs (`torch.cuda.memory_stats`) during a
step's issue and between issues: a free or a sync makes the host wait for the whole device, which
torch's sync debug mode does not report.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from albatross.model import RWKV7
from albatross_engine.device_step import DeviceStep
from albatross_engine.scheduler import RowKind


def _allocator_counts() -> tuple[int, int, int]:
    """The caching allocator's retries, device frees and whole-device syncs so far (each of the
    last two waits for everything queued)."""
    stats = torch.cuda.memory_stats()
    return tuple(int(stats.get(name, 0)) for name in ("num_alloc_retries", "num_device_free", "num_sync_all_streams"))  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class ProfiledDevice:
    """A `device_step_factory` (AlbatrossRWKV): the real DeviceStep with a StepProfiler attached and
    its `report()` exposed, so `EngineCore.device_reports()` reads it from worker threads and worker
    processes alike."""

    def __call__(self, model: RWKV7, batch_size: int, state_dtype: str = "fp32", cuda_graphs: bool = True) -> DeviceStep:
        step = DeviceStep(model, batch_size, state_dtype, cuda_graphs)
        step.report = StepProfiler(step).report  # type: ignore[attr-defined]
        return step


@dataclass(slots=True)
class _Step:
    start: torch.cuda.Event
    end: torch.cuda.Event
    host_ms: float  # Python time spent queuing the step
    forward_host_ms: float  # of which inside the model's eager forward (mixed steps)
    sample_host_ms: float  # of which inside the sampler call
    between_ms: float  # host time from the previous step's issue returning to this one's start
    alloc_retries: int  # the caching allocator's retries (each frees cached blocks: a device sync)
    device_frees: int  # cudaFree calls (each waits for the whole device)
    allocator_syncs: int  # the allocator's syncs of every stream (releasing cached blocks)
    allocator_between: int  # retries, frees and syncs from the previous issue's return to this one
    decode_rows: int
    prefill_tokens: int
    longest_chunk: int


class StepProfiler:
    """Each `report()` covers the steps since the previous one (a server's warm-up can be read off)."""

    def __init__(self, device_step: object) -> None:
        self._steps: list[_Step] = []
        self._lock = threading.Lock()  # the worker appends, a report (another thread) takes the list
        original = device_step.issue  # type: ignore[attr-defined]
        # Where a step's host time goes: a host that queues a mixed step for as long as the GPU runs
        # it is either slow Python or waiting on the device somewhere inside (bench_server.py
        # --sync-debug names such waits).
        spent = {"forward": 0.0, "sample": 0.0}
        returned_at: list[tuple[float, tuple[int, int, int]]] = []  # the previous issue's end: host clock, allocator counts

        def timed(name: str, call):  # type: ignore[no-untyped-def]
            def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
                began = time.perf_counter()
                try:
                    return call(*args, **kwargs)
                finally:
                    spent[name] += 1000 * (time.perf_counter() - began)

            return wrapper

        model = device_step.model  # type: ignore[attr-defined]
        model.forward_ids = timed("forward", model.forward_ids)
        device_step._sample = timed("sample", device_step._sample)  # type: ignore[attr-defined]

        def issue(plan):  # type: ignore[no-untyped-def]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            spent["forward"] = spent["sample"] = 0.0
            before = _allocator_counts()
            began = time.perf_counter()
            issued = original(plan)
            returned = time.perf_counter()
            host_ms = 1000 * (returned - began)
            end.record()
            after = _allocator_counts()
            between_ms, between = (1000 * (began - returned_at[0][0]), sum(before) - sum(returned_at[0][1])) if returned_at else (0.0, 0)
            returned_at[:] = [(returned, after)]
            chunks = [row.stop - row.start for row in plan.rows if row.kind is RowKind.PREFILL]
            step = _Step(start, end, host_ms, spent["forward"], spent["sample"], between_ms, after[0] - before[0], after[1] - before[1], after[2] - before[2], between,
                         plan.decode_tokens, plan.prefill_tokens, max(chunks, default=0))  # fmt: skip
            with self._lock:
                self._steps.append(step)
            return issued

        device_step.issue = issue  # type: ignore[attr-defined]

    def report(self) -> dict[str, object]:
        """The figures of the steps since the previous report (for the benchmark's JSON);
        `print_report` prints them."""
        with self._lock:
            steps, self._steps = self._steps, []
        torch.cuda.synchronize()
        if not steps:
            return {}
        spans = [s.start.elapsed_time(s.end) for s in steps]
        gaps = [a.end.elapsed_time(b.start) for a, b in zip(steps, steps[1:])]
        total = steps[0].start.elapsed_time(steps[-1].end)
        groups: dict[str, list[int]] = {}
        for n, s in enumerate(steps):
            if s.prefill_tokens:
                key = "mixed"
            else:
                size = 1 << max(0, (s.decode_rows - 1).bit_length())  # decode rows rounded up to a power of two
                key = f"decode <= {size}"
            groups.setdefault(key, []).append(n)
        table = {}
        for key in sorted(groups, key=lambda k: (k == "mixed", int(k.split()[-1]) if k != "mixed" else 0)):
            idx = groups[key]
            n = len(idx)
            span = sum(spans[i] for i in idx)
            gap = sum(gaps[i] for i in idx if i < len(gaps))
            table[key] = {
                "steps": n, "gpu_s": span / 1000, "ms_per_step": span / n, "gap_ms": gap / n,
                "host_ms": sum(steps[i].host_ms for i in idx) / n,
                "forward_host_ms": sum(steps[i].forward_host_ms for i in idx) / n,
                "sample_host_ms": sum(steps[i].sample_host_ms for i in idx) / n,
                "between_host_ms": sum(steps[i].between_ms for i in idx) / n,
                "alloc_retries": sum(steps[i].alloc_retries for i in idx),
                "device_frees": sum(steps[i].device_frees for i in idx),
                "allocator_syncs": sum(steps[i].allocator_syncs for i in idx),
                "allocator_between": sum(steps[i].allocator_between for i in idx),
                "decode_rows": sum(steps[i].decode_rows for i in idx) / n,
                "prefill_tokens": sum(steps[i].prefill_tokens for i in idx) / n,
                "longest_chunk": sum(steps[i].longest_chunk for i in idx) / n,
            }  # fmt: skip
        mixed = groups.get("mixed", [])
        fit = mixed_step_fit([(steps[i].prefill_tokens, steps[i].decode_rows, spans[i]) for i in mixed])
        return {"steps": len(steps), "total_s": total / 1000, "idle_between_steps_s": sum(gaps) / 1000, "groups": table, "mixed_fit": fit}


# The least spread (standard deviation over mean) of the mixed steps' prompt tokens and of their
# decode rows that can separate the two costs from the base. A burst's mixed steps nearly all carry
# the whole prefill budget beside most of the streams, so the few that differ (its first and last)
# decide the fit: two of session 30's four H100 runs gave a negative cost per prompt token
# (619 ms - 6.4 us a token), which is why a negative coefficient is refused too.
MIN_FIT_SPREAD = 0.05


def mixed_step_fit(samples: list[tuple[float, float, float]]) -> dict[str, float] | None:
    """`ms = a + b * prefill_tokens + c * decode_rows` by least squares over (prefill tokens,
    decode rows, ms) of the mixed steps, in ms and us. None for fewer than four steps. When either
    count spreads less than `MIN_FIT_SPREAD` over the steps, or a cost comes out negative, the
    three terms cannot be told apart: the result then has `no_fit`, each count's spread and the
    least spread a fit needs instead of the coefficients."""
    if len(samples) < 4:
        return None
    data = torch.tensor(samples, dtype=torch.float64)
    spreads = [(column.std() / column.mean().clamp_min(1e-9)).item() for column in (data[:, 0], data[:, 1])]
    if min(spreads) >= MIN_FIT_SPREAD:
        design = torch.cat([torch.ones(len(samples), 1, dtype=torch.float64), data[:, :2]], dim=1)
        coef = torch.linalg.lstsq(design, data[:, 2:]).solution.squeeze(1).tolist()
        if min(coef) >= 0:
            return {"ms": coef[0], "us_per_prefill_token": 1000 * coef[1], "us_per_decode_row": 1000 * coef[2]}
    return {"no_fit": 1.0, "prefill_tokens_spread": spreads[0], "decode_rows_spread": spreads[1], "min_spread": MIN_FIT_SPREAD}
