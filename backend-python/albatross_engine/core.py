"""The engine core: starts the workers, places each task on the least-loaded live worker, forwards
aborts, and turns a dead worker into a dead engine.

It owns no thread: `Worker.submit` and `Worker.abort` are thread-safe, so placement and aborts run
on the caller's thread (docs/engine.md, "Threads"). Events do not pass through here either:
workers deliver them straight to the caller's loop, one `call_soon_threadsafe` per step and caller
loop (tasks.EventOutbox). Once the engine is dead, every waiting and later request gets
BackendError(503) at once.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable

from albatross_engine.metrics import MetricsSnapshot, merge_snapshots
from albatross_engine.tasks import EngineTask
from albatross_engine.worker import Worker
from runner.interface import BackendError

logger = logging.getLogger(__name__)

INIT_ERROR_PREFIX = "Albatross engine initialization failed"


class EngineCore:
    def __init__(self, workers: list[Worker]) -> None:
        if not workers:
            raise ValueError("the engine needs at least one worker")
        self.workers = workers
        self._started = False
        self._dead_reason: str | None = None  # set once: the engine no longer serves
        self._lock = threading.Lock()
        for worker in workers:
            worker.on_death = self._on_worker_death

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
        """Stop the workers (their requests get 503) and join their threads."""
        with self._lock:
            if self._dead_reason is None:
                self._dead_reason = "the albatross engine is shutting down"
        for worker in self.workers:
            worker.stop(join_timeout)

    @property
    def running(self) -> bool:
        return self._started and self._dead_reason is None

    # ---------------------------------------------------------------------------- requests

    def submit(self, task: EngineTask) -> None:
        """Hand a task to the live worker with the fewest tasks, from any thread; its events
        arrive on `task.channel`."""
        if self.running:
            for worker in sorted((w for w in self.workers if w.alive), key=lambda w: w.load):
                if worker.submit(task):
                    return
        raise BackendError(503, self._unavailable_message())

    def abort(self, task: EngineTask) -> None:
        task.abort_requested = True
        if 0 <= task.worker_index < len(self.workers):
            self.workers[task.worker_index].abort(task)

    def _unavailable_message(self) -> str:
        reason = self._dead_reason or "the albatross engine is not running"
        return reason if reason.startswith("the albatross engine") else f"the albatross engine is not running: {reason}"

    # ---------------------------------------------------------------------------- failure

    def _on_worker_death(self, worker: Worker, error: BaseException) -> None:
        """Called on the dying worker's thread, after it failed its own tasks with 503."""
        with self._lock:
            if self._dead_reason is None:
                self._dead_reason = f"worker {worker.index} died: {type(error).__name__}: {error}"
        logger.error("albatross engine stopped: %s", self._dead_reason)
        for other in self.workers:  # the others fail their tasks with 503 and exit
            if other is not worker:
                other.stop(timeout=0)

    # ---------------------------------------------------------------------------- observation

    def metrics(self) -> MetricsSnapshot:
        return merge_snapshots([w.metrics.snapshot() for w in self.workers])

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason
