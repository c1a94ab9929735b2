"""The engine core: starts the workers, places each task on a live worker (placement.py), forwards
aborts, and decides what a dead worker means.

It owns no thread: `submit` and `abort` of either kind of worker are thread-safe, so placement and
aborts run on the caller's thread (docs/engine.md, "Threads"). Events do not pass through here
either: a worker (or, for a worker process, its link thread) delivers them straight to the caller's
loop, one `call_soon_threadsafe` per step and caller loop (tasks.EventOutbox).

A worker thread that dies ends the engine: every waiting and later request gets BackendError(503)
at once (a thread's failure may have broken the CUDA context the whole process shares). A worker
process that dies costs only its own requests; it restarts by itself, and the core reports it
through `health()` while it is down; only when every worker has given up is the engine dead.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

import torch

from albatross_engine.metrics import MetricsSnapshot, merge_snapshots
from albatross_engine.placement import affinity_key, placement_order
from albatross_engine.tasks import EngineTask
from runner.interface import BackendError

logger = logging.getLogger(__name__)

INIT_ERROR_PREFIX = "Albatross engine initialization failed"
METRICS_TIMEOUT_S = 10.0


class EngineWorker(Protocol):
    """What the core needs of a worker: `worker.Worker` (a thread) or `worker_process.WorkerProcess`."""

    index: int
    device: torch.device
    ready: Future[None]
    isolated: bool  # True: its death costs only its own requests

    @property
    def alive(self) -> bool: ...

    @property
    def load(self) -> int: ...

    def start(self) -> None: ...

    def submit(self, task: EngineTask) -> bool: ...

    def abort(self, task: EngineTask) -> None: ...

    def stop(self, timeout: float | None = None) -> None: ...

    def metrics_future(self) -> Future[MetricsSnapshot]: ...

    def device_report(self) -> dict[str, object]: ...

    def prefill_budget_fit(self) -> dict[str, float | int | None]: ...


class EngineCore:
    def __init__(self, workers: list[EngineWorker], affinity: bool = False) -> None:
        if not workers:
            raise ValueError("the engine needs at least one worker")
        self.workers = workers
        self.affinity = affinity  # place prefix-cache prompts by their first block (per-worker caches)
        self._started = False
        self._dead_reason: str | None = None  # set once: the engine no longer serves
        self._lock = threading.Lock()
        self._given_up: set[int] = set()  # workers that died for good
        for worker in workers:
            worker.on_death = self._on_worker_death  # type: ignore[attr-defined]

    # ---------------------------------------------------------------------------- lifecycle

    def start(self, timeout: float = 300.0, on_ready: Callable[[], None] | None = None) -> None:
        """Start the workers; return once every worker has loaded its model and `on_ready` (if
        any) has run. Raises RuntimeError("Albatross engine initialization failed: ...") on the
        first failure, without waiting for the other loads, or after `timeout` seconds."""
        for worker in self.workers:
            worker.start()
        try:
            self._wait_for_loads(timeout)
            if on_ready is not None:
                on_ready()
        except BaseException as error:
            self._dead_reason = f"initialization failed: {error}"
            stuck = isinstance(error, TimeoutError)
            self.shutdown(join_timeout=1.0 if stuck else 30.0)  # a stuck load cannot be interrupted
            raise RuntimeError(f"{INIT_ERROR_PREFIX}: {error}") from (None if stuck else error)
        self._started = True

    def _wait_for_loads(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = {worker.ready: worker for worker in self.workers}
        while pending:
            remaining = deadline - time.monotonic()
            done, _ = concurrent.futures.wait(pending, max(remaining, 0.0), return_when=concurrent.futures.FIRST_EXCEPTION)
            if not done:
                raise TimeoutError(f"the workers did not load within {timeout:.0f} s")
            for future in done:
                worker = pending.pop(future)
                error = future.exception()
                if error is not None:
                    raise RuntimeError(f"worker {worker.index} on {worker.device}: {type(error).__name__}: {error}") from error

    def shutdown(self, join_timeout: float = 30.0) -> None:
        """Stop the workers (their requests get 503) and wait for them: all are asked first, so
        worker processes wind down in parallel."""
        with self._lock:
            if self._dead_reason is None:
                self._dead_reason = "the albatross engine is shutting down"
        for worker in self.workers:
            worker.stop(timeout=0)
        for worker in self.workers:
            worker.stop(join_timeout)

    @property
    def running(self) -> bool:
        return self._started and self._dead_reason is None

    def health(self) -> str | None:
        """None while the engine serves with every worker alive, else why not (readiness)."""
        if not self.running:
            return self._unavailable_message()
        down = [w for w in self.workers if not w.alive]
        if down:
            return "albatross worker(s) " + ", ".join(f"{w.index} ({w.device})" for w in down) + " not serving"
        return None

    # ---------------------------------------------------------------------------- requests

    def submit(self, task: EngineTask) -> None:
        """Hand a task to a live worker (placement.py), from any thread; its events arrive on
        `task.channel`."""
        if self.running:
            key = affinity_key(task.prompt_tokens, task.use_prefix_cache) if self.affinity else None
            for worker in placement_order([w for w in self.workers if w.alive], key):
                if worker.submit(task):
                    return
        raise BackendError(503, self._unavailable_message())

    def abort(self, task: EngineTask) -> None:
        task.abort_requested = True
        if 0 <= task.worker_index < len(self.workers):
            self.workers[task.worker_index].abort(task)

    def _unavailable_message(self) -> str:
        if self._dead_reason is None and self._started:
            return "the albatross engine has no worker serving now (restarting)"
        reason = self._dead_reason or "the albatross engine is not running"
        return reason if reason.startswith("the albatross engine") else f"the albatross engine is not running: {reason}"

    # ---------------------------------------------------------------------------- failure

    def _on_worker_death(self, worker: EngineWorker, error: BaseException) -> None:
        """A worker thread that died (after failing its own tasks with 503), or a worker process
        that gave up restarting; called on that worker's own thread."""
        with self._lock:
            self._given_up.add(worker.index)
            others_left = len(self._given_up) < len(self.workers)
        if worker.isolated and others_left:
            logger.error("albatross worker %d on %s is down for good: %s", worker.index, worker.device, error)
            return
        with self._lock:
            if self._dead_reason is None:
                self._dead_reason = f"worker {worker.index} died: {type(error).__name__}: {error}"
        logger.error("albatross engine stopped: %s", self._dead_reason)
        for other in self.workers:  # the others fail their tasks with 503 and exit
            if other is not worker:
                other.stop(timeout=0)

    # ---------------------------------------------------------------------------- observation

    def metrics(self) -> MetricsSnapshot:
        """Every worker's counters merged; worker processes are asked all at once."""
        futures = [w.metrics_future() for w in self.workers]
        return merge_snapshots([_snapshot_or_empty(future, worker) for future, worker in zip(futures, self.workers)])

    def device_reports(self) -> list[dict[str, object]]:
        """Each worker's device report (benchmarks' simulated and profiled devices keep one)."""
        return [w.device_report() for w in self.workers]

    def prefill_budget_fits(self) -> list[dict[str, float | int | None]]:
        """Each worker's adaptive prefill budget: target, last budget, measured step-time fit."""
        return [w.prefill_budget_fit() for w in self.workers]

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason


def _snapshot_or_empty(future: Future[MetricsSnapshot], worker: EngineWorker) -> MetricsSnapshot:
    try:
        return future.result(METRICS_TIMEOUT_S)
    except TimeoutError:  # a worker process that does not answer (stuck): the others still count
        logger.warning("albatross worker %d did not report its metrics within %.0f s", worker.index, METRICS_TIMEOUT_S)
        return MetricsSnapshot()
