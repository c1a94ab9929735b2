"""The engine core: an "albatross-engine" thread with its own asyncio loop that starts the workers,
places each task on the least-loaded worker, forwards aborts, and watches for a dead worker.

Events do not pass through this thread: workers deliver them straight to the caller's loop, one
`call_soon_threadsafe` per step and caller loop (tasks.EventOutbox). If the engine dies, every
waiting and later request gets BackendError(503) at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable

from albatross_engine.metrics import MetricsSnapshot, merge_snapshots
from albatross_engine.tasks import EngineTask, send_now
from albatross_engine.worker import Worker
from runner.interface import BackendError

logger = logging.getLogger(__name__)

INIT_ERROR_PREFIX = "Albatross engine initialization failed"


class AsyncEngineCore:
    def __init__(self, workers: list[Worker]) -> None:
        if not workers:
            raise ValueError("the engine needs at least one worker")
        self.workers = workers
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._dead_reason: str | None = None  # set once: the engine no longer serves
        self._lock = threading.Lock()
        for worker in workers:
            worker._on_death = self._on_worker_death  # noqa: SLF001 - the core owns its workers

    # ---------------------------------------------------------------------------- lifecycle

    def start(self, timeout: float = 300.0, on_ready: Callable[[], None] | None = None) -> None:
        """Start the engine thread and the workers; return once every worker has loaded its model.
        Raises RuntimeError("Albatross engine initialization failed: ...") on any failure or after
        `timeout` seconds. `on_ready` runs on the engine thread after the loads, before serving."""
        self._thread = threading.Thread(target=self._run, args=(on_ready,), name="albatross-engine", daemon=True)
        self._thread.start()
        try:
            self._started.result(timeout)
        except concurrent.futures.TimeoutError:
            self.shutdown(join_timeout=1.0)  # a stuck load cannot be interrupted; its thread exits when it returns
            raise RuntimeError(f"{INIT_ERROR_PREFIX}: the workers did not load within {timeout:.0f} s") from None
        except BaseException as error:
            self.shutdown(join_timeout=30.0)
            raise RuntimeError(f"{INIT_ERROR_PREFIX}: {error}") from error

    def _run(self, on_ready: Callable[[], None] | None) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._start_workers(on_ready))
        except BaseException as error:  # noqa: BLE001 - reported to start()
            self._dead_reason = f"initialization failed: {error}"
            if not self._started.done():
                self._started.set_exception(error)
        else:
            self._started.set_result(None)
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _start_workers(self, on_ready: Callable[[], None] | None) -> None:
        for worker in self.workers:
            worker.start()
        pending = {asyncio.wrap_future(w.ready): w for w in self.workers}
        for future in pending:  # failures after the first are reported through it, not logged again
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
        while pending:  # the first failure ends the start at once, without waiting for the others
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                worker = pending.pop(future)
                error = future.exception()
                if error is not None:
                    raise RuntimeError(f"worker {worker.index} on {worker.device}: {type(error).__name__}: {error}") from error
        if on_ready is not None:
            on_ready()

    def shutdown(self, join_timeout: float = 30.0) -> None:
        """Stop the workers (their requests get 503), then the engine thread; joins every thread."""
        with self._lock:
            if self._dead_reason is None:
                self._dead_reason = "the albatross engine is shutting down"
        for worker in self.workers:
            worker.stop(join_timeout)
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            try:
                loop.call_soon_threadsafe(loop.stop)
            except RuntimeError:
                pass  # the loop already closed
        if thread is not None and thread is not threading.current_thread():
            thread.join(join_timeout)

    @property
    def running(self) -> bool:
        return self._dead_reason is None and self._thread is not None and self._thread.is_alive()

    # ---------------------------------------------------------------------------- requests

    def submit(self, task: EngineTask) -> None:
        """Hand a task to the engine from any thread; its events arrive on `task.channel`."""
        loop = self._loop
        if not self.running or loop is None:
            raise BackendError(503, self._unavailable_message())
        try:
            loop.call_soon_threadsafe(self._place, task)
        except RuntimeError:  # the loop closed between the check and the call
            raise BackendError(503, self._unavailable_message()) from None

    def abort(self, task: EngineTask) -> None:
        task.abort_requested = True
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._forward_abort, task)
        except RuntimeError:
            pass  # the engine is gone; so is the task

    def _place(self, task: EngineTask) -> None:
        if self._dead_reason is None:
            for worker in sorted((w for w in self.workers if w.alive), key=lambda w: w.load):
                if worker.submit(task):
                    return
        send_now(task.channel, BackendError(503, self._unavailable_message()))

    def _forward_abort(self, task: EngineTask) -> None:
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
