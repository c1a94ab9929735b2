"""Garbage-collector settings while an engine serves.

A step at batch 960 creates thousands of short-lived container objects (rows, events, token
lists). With CPython's default generation-0 threshold (700) a 20 s benchmark run made ~1,800
collections, and the full collections, which walk every tracked object of the process (torch, the
model, the app), paused the host for up to ~180 ms: ~2.6 s of collection in a ~19 s run on the
simulated device of bench/host_overhead.py, enough to leave the GPU waiting for the host.

So while an engine runs, the objects that exist when it starts are frozen (`gc.freeze()`: the
collector no longer walks them) and generation 0 is collected every 20,000 allocations. When the
last engine shuts down (a model switch shuts the old engine down before starting the next), the
thresholds come back, everything is unfrozen and collected, so the old model's objects are freed.
"""

from __future__ import annotations

import gc
import threading

GEN0_THRESHOLD = 20_000

_lock = threading.Lock()
_running = 0
_saved_thresholds: tuple[int, int, int] | None = None


def engine_started() -> None:
    global _running, _saved_thresholds
    with _lock:
        if _running == 0:
            _saved_thresholds = gc.get_threshold()
            gc.set_threshold(max(GEN0_THRESHOLD, _saved_thresholds[0]), *_saved_thresholds[1:])
        _running += 1
        gc.freeze()


def engine_stopped() -> None:
    global _running, _saved_thresholds
    with _lock:
        if _running == 0:
            return
        _running -= 1
        if _running:
            return
        if _saved_thresholds is not None:
            gc.set_threshold(*_saved_thresholds)
            _saved_thresholds = None
        gc.unfreeze()
    gc.collect()
