"""albatross_engine/metrics.py: what a worker records per step, and the engine's merge."""

from __future__ import annotations

import pytest

from albatross_engine.metrics import WorkerMetrics, merge_snapshots


def test_a_step_updates_occupancy_totals_and_moving_averages() -> None:
    metrics = WorkerMetrics()
    metrics.record_step(0.010, decode_tokens=4, prefill_tokens=100, active_slots=5, queue_depth=2, peak_memory_bytes=7)
    metrics.record_step(0.020, decode_tokens=8, prefill_tokens=0, active_slots=6, queue_depth=0, peak_memory_bytes=3)
    s = metrics.snapshot()
    assert (s.steps, s.active_slots, s.queue_depth, s.peak_device_memory_bytes) == (2, 6, 0, 7)
    assert (s.decode_tokens_total, s.prefill_tokens_total, s.last_step_time_ms) == (12, 100, pytest.approx(20.0))
    assert s.step_time_ms == pytest.approx(0.9 * 10.0 + 0.1 * 20.0), "the newest step weighs 0.1"
    assert s.decode_tokens_per_step == pytest.approx(0.9 * 4 + 0.1 * 8)
    assert s.prefill_tokens_per_step == pytest.approx(0.9 * 100)


def test_a_step_that_issued_nothing_updates_only_occupancy() -> None:
    metrics = WorkerMetrics()
    metrics.record_step(None, 0, 0, active_slots=3, queue_depth=1)
    s = metrics.snapshot()
    assert (s.steps, s.step_time_ms, s.active_slots, s.queue_depth) == (0, 0.0, 3, 1)


def test_snapshots_are_copies() -> None:
    metrics = WorkerMetrics()
    metrics.record_finish("stop")
    snapshot = metrics.snapshot()
    metrics.record_finish("stop")
    assert snapshot.requests_finished == {"stop": 1} and metrics.snapshot().requests_finished == {"stop": 2}


def test_the_engine_sums_counters_and_rates_and_keeps_the_slowest_step() -> None:
    one, two = WorkerMetrics(), WorkerMetrics()
    one.record_step(0.010, 4, 0, 4, 0)
    two.record_step(0.030, 6, 10, 6, 1)
    one.record_finish("stop")
    two.record_finish("stop")
    two.record_finish("abort")
    one.record_prefix_lookup(256)
    two.record_prefix_lookup(0)
    merged = merge_snapshots([one.snapshot(), two.snapshot()])
    assert (merged.steps, merged.active_slots, merged.queue_depth, merged.decode_tokens_per_step) == (2, 10, 1, 10)
    assert merged.step_time_ms == pytest.approx(30.0)
    assert merged.requests_finished == {"stop": 2, "abort": 1}
    assert (merged.prefix_cache_hits, merged.prefix_cache_misses, merged.cached_prompt_tokens_total) == (1, 1, 256)
