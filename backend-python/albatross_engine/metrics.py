"""Engine counters, written by each worker once per step and read from any thread.

`WorkerMetrics.snapshot()` is what benchmarks and `/status` / `/metrics` read;
`merge_snapshots()` combines the workers' snapshots into the engine's.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field

from runner.interface import FinishReason

_EMA = 0.1  # weight of the newest step in the moving averages


@dataclass(slots=True)
class MetricsSnapshot:
    active_slots: int = 0
    queue_depth: int = 0
    steps: int = 0
    step_time_ms: float = 0.0  # moving average over recent steps
    last_step_time_ms: float = 0.0
    decode_tokens_per_step: float = 0.0  # moving averages
    prefill_tokens_per_step: float = 0.0
    decode_tokens_total: int = 0
    prefill_tokens_total: int = 0
    generated_tokens_total: int = 0  # tokens delivered to callers
    requests_finished: dict[FinishReason, int] = field(default_factory=dict)
    prefix_cache_hits: int = 0
    prefix_cache_misses: int = 0
    cached_prompt_tokens_total: int = 0
    shared_prompt_tokens_total: int = 0  # prompt tokens followers took from their leader's prefill
    state_saves: int = 0
    masked_samples_total: int = 0  # samples drawn under a grammar's allowed-token mask
    mask_fill_ms_total: float = 0.0  # host time filling those masks (while the device runs the forward)
    peak_device_memory_bytes: int = 0

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class WorkerMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = MetricsSnapshot()

    def record_step(self, seconds: float | None, decode_tokens: int, prefill_tokens: int, active_slots: int, queue_depth: int, peak_memory_bytes: int = 0) -> None:
        """The end of a worker's step: `seconds` None when it issued nothing (occupancy only)."""
        with self._lock:
            d = self._data
            d.active_slots = active_slots
            d.queue_depth = queue_depth
            d.peak_device_memory_bytes = max(d.peak_device_memory_bytes, peak_memory_bytes)
            if seconds is None:
                return
            ms = seconds * 1000.0
            first = d.steps == 0
            d.steps += 1
            d.last_step_time_ms = ms
            d.step_time_ms = ms if first else (1 - _EMA) * d.step_time_ms + _EMA * ms
            d.decode_tokens_per_step = (
                decode_tokens if first else (1 - _EMA) * d.decode_tokens_per_step + _EMA * decode_tokens
            )
            d.prefill_tokens_per_step = (
                prefill_tokens if first else (1 - _EMA) * d.prefill_tokens_per_step + _EMA * prefill_tokens
            )
            d.decode_tokens_total += decode_tokens
            d.prefill_tokens_total += prefill_tokens

    def add_generated(self, tokens: int) -> None:
        with self._lock:
            self._data.generated_tokens_total += tokens

    def record_finish(self, reason: FinishReason) -> None:
        with self._lock:
            counts = self._data.requests_finished
            counts[reason] = counts.get(reason, 0) + 1

    def record_shared_prefill(self, tokens: int) -> None:
        with self._lock:
            self._data.shared_prompt_tokens_total += tokens

    def record_prefix_lookup(self, cached_tokens: int) -> None:
        with self._lock:
            if cached_tokens:
                self._data.prefix_cache_hits += 1
                self._data.cached_prompt_tokens_total += cached_tokens
            else:
                self._data.prefix_cache_misses += 1

    def record_state_save(self) -> None:
        with self._lock:
            self._data.state_saves += 1

    def record_masks(self, rows: int, seconds: float) -> None:
        with self._lock:
            self._data.masked_samples_total += rows
            self._data.mask_fill_ms_total += seconds * 1000.0

    def snapshot(self) -> MetricsSnapshot:
        with self._lock:
            d = self._data
            return MetricsSnapshot(**{**asdict(d), "requests_finished": dict(d.requests_finished)})


def merge_snapshots(snapshots: list[MetricsSnapshot]) -> MetricsSnapshot:
    """Sums of counters and of per-step rates (workers step in parallel); the slowest step time."""
    merged = MetricsSnapshot()
    for s in snapshots:
        merged.active_slots += s.active_slots
        merged.queue_depth += s.queue_depth
        merged.steps += s.steps
        merged.step_time_ms = max(merged.step_time_ms, s.step_time_ms)
        merged.last_step_time_ms = max(merged.last_step_time_ms, s.last_step_time_ms)
        merged.decode_tokens_per_step += s.decode_tokens_per_step
        merged.prefill_tokens_per_step += s.prefill_tokens_per_step
        merged.decode_tokens_total += s.decode_tokens_total
        merged.prefill_tokens_total += s.prefill_tokens_total
        merged.generated_tokens_total += s.generated_tokens_total
        for reason, count in s.requests_finished.items():
            merged.requests_finished[reason] = merged.requests_finished.get(reason, 0) + count
        merged.prefix_cache_hits += s.prefix_cache_hits
        merged.prefix_cache_misses += s.prefix_cache_misses
        merged.cached_prompt_tokens_total += s.cached_prompt_tokens_total
        merged.shared_prompt_tokens_total += s.shared_prompt_tokens_total
        merged.state_saves += s.state_saves
        merged.masked_samples_total += s.masked_samples_total
        merged.mask_fill_ms_total += s.mask_fill_ms_total
        merged.peak_device_memory_bytes += s.peak_device_memory_bytes
    return merged
