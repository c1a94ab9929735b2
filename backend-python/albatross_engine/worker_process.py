"""`WorkerProcess`: the server process's handle on a worker that runs in a process of its own.

To the engine core it is a worker like the thread one (submit, abort, stop, alive, load, metrics,
ready), so the core places tasks the same way. Inside, the real `Worker` runs in a process started
with the `spawn` method (worker_process_main.py: its own CUDA context, its own GIL); this side keeps
the tasks in flight and hands each step's events from the pipe to their callers, one
`call_soon_threadsafe` per caller loop per step (tasks.EventOutbox), on one thread per worker
process ("albatross-worker-<i>-link"). That thread also answers the process's state requests from
the server's store, in pipe order, so a saved state is in the store before the event that ends its
turn reaches the caller.

A worker process that dies (killed, crashed, its step loop failed) fails its own requests with 503
and is started again, at most `restart_limit` times; meanwhile it takes no tasks (`alive` is
False), and the other workers go on serving. Every start is joined when it ends, so no zombie is
left, and shutdown kills a process that does not stop in time.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing
import os
import pickle
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from albatross.checkpoint import ModelConfig
from albatross.state import SlotState
from albatross_engine import process_boundary as wire
from albatross_engine import worker_process_main
from albatross_engine.metrics import MetricsSnapshot, merge_snapshots
from albatross_engine.state_store import StateStore
from albatross_engine.tasks import EngineTask, EventItem, EventOutbox
from albatross_engine.worker_process_main import WorkerProcessSpec
from runner.interface import BackendError, GenerationEvent

logger = logging.getLogger(__name__)

RESTART_LIMIT = 3  # starts after a death; then the worker stays down and the backend reports it
QUERY_TIMEOUT_S = 10.0
STOP_KILL_WAIT_S = 5.0
# Per-process values, not counters: a dead process's are not carried over to the next one.
_GAUGES = ("active_slots", "queue_depth", "step_time_ms", "last_step_time_ms", "decode_tokens_per_step", "prefill_tokens_per_step",
           "peak_device_memory_bytes")  # fmt: skip

_live: weakref.WeakSet[WorkerProcess] = weakref.WeakSet()


class WorkerProcess:
    isolated = True  # its death costs its own requests only

    def __init__(
        self,
        spec: WorkerProcessSpec,
        device: torch.device,
        visible_device: str | None = None,
        on_death: Callable[[WorkerProcess, BaseException], None] | None = None,
        restart_limit: int | None = None,  # None: RESTART_LIMIT
    ) -> None:
        """`device` is the worker's GPU as the server names it; `visible_device` the one GPU the
        process is shown (CUDA_VISIBLE_DEVICES), where it is `spec.device`, cuda:0. So nothing in
        the process, on any of its threads, can open a CUDA context on another worker's GPU."""
        self.spec = spec
        self.index = spec.index
        self.device = device
        self.visible_device = visible_device
        self.on_death = on_death  # called once the worker gives up (no restarts left)
        self.ready: Future[None] = Future()
        self.metrics = _RemoteMetrics(self)
        self.overlap = spec.config.overlap if spec.config.overlap is not None else self.device.type == "cuda"
        self.store: StateStore | None = None  # the server's store: answers the process's state requests
        self.restart_limit = RESTART_LIMIT if restart_limit is None else restart_limit
        self.restarts = 0
        self._fingerprint: str | None = None
        self._model_config: ModelConfig | None = None
        self.plan_status: dict[str, object] | None = None  # the process's memory plan (MemoryPlan.as_status)
        self._lock = threading.Lock()  # tasks, serving, and every write to the pipe
        self._tasks: dict[int, EngineTask] = {}
        self._serving = False
        self._stopping = False
        self._process: BaseProcess | None = None
        self._connection: Connection | None = None
        self._death_reason: str | None = None
        self._given_up = False
        self._outbox = EventOutbox()
        self._failed_saves: dict[str, str] = {}  # save key -> why its state never reached the store
        self._initial_states_sent: set[str] = set()  # state files' ids this process has been sent
        self._queries: dict[int, Future[Any]] = {}
        self._query_ids = itertools.count(1)
        self._last_metrics = MetricsSnapshot()
        self._earlier_metrics = MetricsSnapshot()  # counters of the processes before this one
        self._thread = threading.Thread(target=self._run, name=f"albatross-worker-{self.index}-link", daemon=True)

    # ---------------------------------------------------------------------------- the core's view

    @property
    def alive(self) -> bool:
        """Loaded and taking tasks (False while it restarts and after it gave up)."""
        return self._serving

    @property
    def load(self) -> int:
        return len(self._tasks)

    @property
    def state(self) -> str:
        """"loading", "serving", "restarting", "down" (gave up) or "stopped"."""
        if self._serving:
            return "serving"
        if self._stopping:
            return "stopped"
        if self._given_up:
            return "down"
        return "loading" if not self.ready.done() else "restarting"

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            raise RuntimeError(f"worker {self.index} has not loaded its model")
        return self._fingerprint

    @property
    def model_config(self) -> ModelConfig:
        if self._model_config is None:
            raise RuntimeError(f"worker {self.index} has not loaded its model")
        return self._model_config

    @property
    def pid(self) -> int | None:
        process = self._process
        return None if process is None else process.pid

    def start(self) -> None:
        _live.add(self)
        self._thread.start()

    def submit(self, task: EngineTask) -> bool:
        spec = wire.task_spec(task)
        initial = task.initial_state
        with self._lock:
            if not self._serving:
                return False
            if initial is not None and initial.state_id not in self._initial_states_sent:
                self._send((wire.INITIAL_STATE, initial.state_id, initial.state.to_bytes()))  # once per process
                self._initial_states_sent.add(initial.state_id)
            task.worker_index = self.index
            self._tasks[task.task_id] = task
            self._send((wire.SUBMIT, spec))  # a broken pipe: the link thread fails the task with the rest
        return True

    def abort(self, task: EngineTask) -> None:
        task.abort_requested = True
        with self._lock:
            if self._serving and task.task_id in self._tasks:
                self._send((wire.ABORT, task.task_id))

    def stop(self, timeout: float | None = None) -> None:
        """Ask the process to stop (its requests get 503) and wait up to `timeout` seconds; then kill
        it. `timeout=0` only asks. A process still loading has no requests: it is killed at once."""
        with self._lock:
            asked = self._stopping
            self._stopping = True
            if not asked and self._serving:
                self._send((wire.STOP,))
            loading = not self._serving
        if loading:
            self._kill()
        if threading.current_thread() is self._thread or not self._thread.is_alive():
            return
        self._thread.join(timeout)
        if timeout != 0 and self._thread.is_alive():
            logger.warning("albatross worker %d did not stop within %s s; killing it", self.index, timeout)
            self._kill()
            self._thread.join(STOP_KILL_WAIT_S)

    def metrics_future(self) -> Future[MetricsSnapshot]:
        """The process's counters (plus its predecessors'), asked without waiting for the answer, so
        the core asks every worker at once."""
        result: Future[MetricsSnapshot] = Future()

        def done(answer: Future[Any]) -> None:
            snapshot = answer.result()
            if isinstance(snapshot, MetricsSnapshot):
                self._last_metrics = snapshot
            result.set_result(merge_snapshots([self._earlier_metrics, self._last_metrics]))

        self.query(wire.METRICS).add_done_callback(done)
        return result

    def device_report(self) -> dict[str, object]:
        report = self._answer(wire.DEVICE_REPORT)
        return report if isinstance(report, dict) else {}

    def prefill_budget_fit(self) -> dict[str, float | int | None]:
        fit = self._answer(wire.PREFILL_BUDGET_FIT)
        return fit if isinstance(fit, dict) else {}

    def query(self, what: str) -> Future[Any]:
        """Ask the process something (process_boundary.QUERIES); None when it is not serving."""
        future: Future[Any] = Future()
        with self._lock:
            if not self._serving:
                future.set_result(None)
                return future
            query_id = next(self._query_ids)
            self._queries[query_id] = future
            if not self._send((wire.QUERY, query_id, what)):
                self._queries.pop(query_id, None)
                future.set_result(None)
        return future

    def _answer(self, what: str) -> object:
        try:
            return self.query(what).result(QUERY_TIMEOUT_S)
        except TimeoutError:
            return None

    # ---------------------------------------------------------------------------- the link thread

    def _run(self) -> None:
        while True:
            self._death_reason = None
            if self._start_process():
                self._receive()
            reason = self._reap()
            self._end_incarnation(reason)
            if self._stopping:
                break
            if not self.ready.done():  # the first start failed: the engine start reports it
                self.ready.set_exception(RuntimeError(reason))
                break
            if self.restarts >= self.restart_limit:
                logger.error("albatross worker %d on %s gave up after %d restarts: %s", self.index, self.device, self.restarts, reason)
                self._given_up = True
                if self.on_death is not None:
                    self.on_death(self, RuntimeError(reason))
                break
            self.restarts += 1
            logger.error("albatross worker %d on %s stopped (%s); starting it again (restart %d of %d)",
                         self.index, self.device, reason, self.restarts, self.restart_limit)  # fmt: skip

    def _start_process(self) -> bool:
        context = multiprocessing.get_context("spawn")
        server_end, worker_end = context.Pipe(duplex=True)
        process = context.Process(target=worker_process_main.run, args=(self.spec, worker_end), name=f"albatross-worker-{self.index}", daemon=True)
        try:
            _start_showing(process, self.visible_device)
        except Exception as error:
            self._death_reason = f"the worker process could not start: {type(error).__name__}: {error}"
            server_end.close()
            return False
        finally:
            worker_end.close()  # only the process holds its end: its exit closes the pipe
        with self._lock:
            self._process, self._connection = process, server_end
            self._initial_states_sent = set()  # a new process has none
        return True

    def _receive(self) -> None:
        connection = self._connection
        assert connection is not None
        while True:
            try:
                message = pickle.loads(connection.recv_bytes())
            except (EOFError, OSError):
                return
            try:
                self._handle(message)
            except Exception:
                logger.exception("albatross worker %d: handling %r failed", self.index, message[0])

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == wire.EVENTS:
            self._deliver(message[1])
        elif kind == wire.STORE_PUT:
            self._store_put(message[1], message[2])
        elif kind == wire.STORE_GET or kind == wire.STORE_CONTAINS:
            self._store_request(kind, message[1], message[2])
        elif kind == wire.QUERY_REPLY:
            with self._lock:
                future = self._queries.pop(message[1], None)
            if future is not None:
                future.set_result(message[2])
        elif kind == wire.READY:
            _, self._fingerprint, _, self.overlap, self._model_config, self.plan_status = message
            with self._lock:
                self._serving = not self._stopping
            if not self.ready.done():
                self.ready.set_result(None)
            elif self._serving:
                logger.warning("albatross worker %d on %s is serving again", self.index, self.device)
        elif kind == wire.LOAD_FAILED:
            self._death_reason = f"loading failed: {message[1]}"
        elif kind == wire.DIED:
            self._death_reason = f"its step loop failed: {message[1]}"
            with self._lock:
                self._serving = False
                self._send((wire.STOP,))  # the process exits once told
        else:
            logger.error("albatross worker %d sent an unknown message %r", self.index, kind)

    def _deliver(self, batch: list[wire.PackedItem]) -> None:
        """One step's events to their callers. This runs per token for every stream of the worker,
        on the server's one GIL, so the common item (a plain delta) is passed on as it came."""
        tasks, add = self._tasks, self._outbox.add
        finished: list[int] = []
        for packed in batch:
            task = tasks.get(packed[0])  # type: ignore[call-overload]
            if task is None:
                continue
            if wire.is_plain_delta(packed):
                add(task.channel, packed)  # built by the caller's reader, once per read (merge_items)
                continue
            item = wire.unpack_item(packed, task.prompt_len)
            if wire.is_final(item):
                finished.append(task.task_id)
                if task.save_key is not None and self._failed_saves:
                    item = self._save_outcome(task, item)
            add(task.channel, item)
        if finished:
            with self._lock:
                for task_id in finished:
                    tasks.pop(task_id, None)
        if self._outbox.flush():
            self._abort_closed_channels()

    def _save_outcome(self, task: EngineTask, item: EventItem) -> EventItem:
        """A completed turn whose state never reached the store ends in an error, not a success."""
        assert task.save_key is not None
        reason = self._failed_saves.pop(task.save_key, None)
        if reason is None or not isinstance(item, GenerationEvent) or item.finish_reason not in ("stop", "length"):
            return item
        item.finish_reason = "error"
        item.error = f"saving the state {task.save_key!r} failed: {reason}"
        return item

    def _abort_closed_channels(self) -> None:
        for task in list(self._tasks.values()):
            if task.channel.closed:
                self.abort(task)

    def _store_put(self, key: str, payload: bytes) -> None:
        try:
            if self.store is None:
                raise RuntimeError("the server has no state store")
            self.store.put(key, SlotState.from_bytes(payload))
            self._failed_saves.pop(key, None)
        except Exception as error:
            logger.exception("albatross worker %d: storing state %r failed", self.index, key)
            self._failed_saves[key] = f"{type(error).__name__}: {error}"

    def _store_request(self, kind: str, request_id: int, key: str) -> None:
        result: wire.StoreResult | str
        try:
            if self.store is None:
                raise RuntimeError("the server has no state store")
            if kind == wire.STORE_CONTAINS:
                result = self.store.contains(key)
            else:
                state = self.store.get(key)
                result = None if state is None else state.to_bytes()
        except Exception as error:  # the worker turns a text answer into a 503 for its task
            logger.exception("albatross worker %d: reading state %r failed", self.index, key)
            result = f"the state store failed: {type(error).__name__}: {error}"
        with self._lock:
            self._send((wire.STORE_REPLY, request_id, result))

    def _send(self, message: tuple[object, ...]) -> bool:
        """Under `_lock`. False when the pipe is gone (the link thread is about to see it close)."""
        connection = self._connection
        if connection is None:
            return False
        try:
            connection.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        except (OSError, ValueError):
            return False
        return True

    def _reap(self) -> str:
        """Join the ended process (no zombie); why it ended."""
        process = self._process
        if process is not None:
            process.join(30.0)
            if process.is_alive():  # closed its pipe but did not exit
                process.kill()
                process.join()
        connection = self._connection
        if connection is not None:
            connection.close()
        if self._death_reason is not None:
            return self._death_reason
        code = None if process is None else process.exitcode
        return f"the worker process exited with code {code}" if code is None or code >= 0 else f"the worker process was killed by signal {-code}"

    def _end_incarnation(self, reason: str) -> None:
        with self._lock:
            self._serving = False
            self._connection = None
            tasks = list(self._tasks.values())
            self._tasks.clear()
            queries = list(self._queries.values())
            self._queries.clear()
        self._earlier_metrics = _counters(merge_snapshots([self._earlier_metrics, self._last_metrics]))
        self._last_metrics = MetricsSnapshot()
        self._failed_saves.clear()
        if tasks:
            error = BackendError(503, f"albatross worker {self.index} on {self.device} stopped ({reason}); its requests failed")
            for task in tasks:
                self._outbox.add(task.channel, error)
            self._outbox.flush()
        for query in queries:
            query.set_result(None)

    def _kill(self) -> None:
        process = self._process
        if process is not None and process.is_alive():
            process.kill()


class _RemoteMetrics:
    """`worker.metrics` of a worker process: `snapshot()` asks the process."""

    def __init__(self, worker: WorkerProcess) -> None:
        self._worker = worker

    def snapshot(self) -> MetricsSnapshot:
        return self._worker.metrics_future().result(QUERY_TIMEOUT_S)


def _counters(snapshot: MetricsSnapshot) -> MetricsSnapshot:
    """The counters of a snapshot, its gauges zeroed: what a dead process adds to its successor's."""
    values = asdict(snapshot)
    for name in _GAUGES:
        values[name] = type(values[name])()
    return MetricsSnapshot(**values)


_spawn_lock = threading.Lock()


def _start_showing(process: BaseProcess, visible_device: str | None) -> None:
    """Start a process that sees only `visible_device` (None: what this process sees). The
    environment is the one knob a spawned process inherits; the lock keeps two starts from mixing."""
    with _spawn_lock:
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible_device is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_device
        try:
            process.start()
        finally:
            if visible_device is not None:
                if saved is None:
                    del os.environ["CUDA_VISIBLE_DEVICES"]
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = saved


def visible_device_of(device: torch.device) -> str | None:
    """The CUDA_VISIBLE_DEVICES entry of this process's `device` (None for the CPU)."""
    if device.type != "cuda":
        return None
    index = device.index or 0
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    if shown is None:
        return str(index)
    entries = [entry.strip() for entry in shown.split(",") if entry.strip()]
    return entries[index]


def _kill_leftovers() -> None:
    """At interpreter exit: a worker process that was never stopped is killed and joined (worker
    processes ignore SIGTERM, so multiprocessing's own exit handler could not end them)."""
    for worker in list(_live):
        worker._stopping = True
        worker._kill()
        process = worker._process
        if process is not None:
            process.join(STOP_KILL_WAIT_S)


atexit.register(_kill_leftovers)
