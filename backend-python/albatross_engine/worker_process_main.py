"""The inside of a worker process: one `Worker` (the same step loop a worker thread runs), fed
through the pipe to the server process.

Threads here: the worker's own step thread; this module's main thread, which reads the pipe
(tasks, aborts, queries, answers to state requests); and one sender thread, which writes
everything this process sends in the order it was queued: a step's events, and the states saved
before them (a state's device-to-host copy lands before its bytes are sent, without the step loop
waiting for it). So a session's saved state always reaches the server before the event that ends
its turn, and the route that then waits for it on disk finds it queued.

The process ignores SIGINT and SIGTERM: the server decides when it stops (a STOP message, or the
pipe closing when the server itself is gone), so a Ctrl-C or a service manager's SIGTERM to the
process group cannot kill the workers under a server that is still draining its streams.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import pickle
import queue
import signal
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from albatross.state import SlotState
from albatross.tokenizer import Tokenizer, get_tokenizer
from albatross_engine import gc_policy
from albatross_engine import process_boundary as wire
from albatross_engine.config import AlbatrossBackendConfig
from albatross_engine.initial_state import EngineInitialState
from albatross_engine.model_specs import model_loader
from albatross_engine.state_cache.records import copy_state, copy_to_host
from albatross_engine.state_store import StateStore
from albatross_engine.tasks import EngineTask, EventChannel, EventItem, EventOutbox, RemoteChannel
from albatross_engine.worker import DeviceStepFactory, Worker
from runner.interface import PREFIX_CACHE_KEY_PREFIX, BackendError

logger = logging.getLogger(__name__)
# Seconds a stopping worker process may spend writing its prefix states to the disk tier: well
# inside the 30 s the server waits for it before killing it (EngineCore.shutdown), so a large L1/L2
# (8 GiB of 17 MB states at 7.2B) cannot turn a shutdown into a kill; what is left is dropped.
SHUTDOWN_FLUSH_S = 20.0

STORE_REQUEST_TIMEOUT_S = 120.0  # a state read from the server's disk tier, under load


@dataclass(frozen=True, slots=True)
class WorkerProcessSpec:
    """Everything a worker process is started with (pickled once, at spawn)."""

    index: int
    device: str  # as the process sees it: cuda:0, its one visible GPU (WorkerProcess sets CUDA_VISIBLE_DEVICES), or cpu
    model_path: str
    config: AlbatrossBackendConfig
    vocab_path: str | None  # None: the default vocabulary
    server_store: bool  # the server has a state store: sessions (and prefix states without a cache here) go there
    prefix_cache_settings: Any | None  # ServerSettings for this process's own prefix cache (build_state_cache), or None
    device_step_factory: DeviceStepFactory | None = None  # None: the real DeviceStep
    cpu_threads: int = 1  # torch's intra-op threads: the server's share for this worker (unless OMP_NUM_THREADS says)
    cache_bytes: int = 0  # the L1 budget of this process's own prefix cache, which its memory plan leaves room for
    log_level: int = logging.INFO


class ServerLink:
    """This process's end of the pipe: ordered sends from any thread, and requests that wait for
    the server's reply (matched by request id on the main thread's reads)."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._queue: queue.SimpleQueue[tuple[object, ...] | _Put | None] = queue.SimpleQueue()
        self._replies: dict[int, Future[Any]] = {}
        self._ids = itertools.count(1)
        self._broken = False
        self._thread = threading.Thread(target=self._send_loop, name="albatross-worker-sender", daemon=True)
        self._thread.start()

    def send(self, message: tuple[object, ...]) -> None:
        self._queue.put(message)

    def send_put(self, key: str, state: SlotState) -> None:
        if state.device.type == "cuda":
            # A snapshot on the current stream first: the copy stream reads after the put returns,
            # when `state` may be a running slot's views (StateStore.put) that the next step rewrites.
            state = copy_state(state, state.device)
        host, landed = copy_to_host(state)  # pinned, without waiting for the step in flight
        self._queue.put(_Put(key, host, landed))

    def request(self, kind: str, key: str) -> Any:
        request_id = next(self._ids)
        reply: Future[Any] = Future()
        self._replies[request_id] = reply
        self._queue.put((kind, request_id, key))
        try:
            return reply.result(STORE_REQUEST_TIMEOUT_S)
        finally:
            self._replies.pop(request_id, None)

    def resolve(self, request_id: int, result: object) -> None:
        reply = self._replies.get(request_id)
        if reply is not None:
            reply.set_result(result)

    def fail_pending(self) -> None:
        """Requests still waiting get an error (the server stopped answering)."""
        for reply in list(self._replies.values()):
            if not reply.done():
                reply.set_exception(BackendError(503, "the albatross server no longer answers state requests"))

    def close(self) -> None:
        """Send everything queued, then stop the sender."""
        self._queue.put(None)
        self._thread.join()
        self.fail_pending()

    def _send_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._broken:
                continue
            try:
                if isinstance(item, _Put):
                    if item.landed is not None:
                        item.landed.synchronize()
                    item = (wire.STORE_PUT, item.key, item.state.to_bytes())
                self._connection.send_bytes(pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL))
            except (OSError, ValueError):  # the server is gone; the main thread sees the pipe close
                self._broken = True
            except Exception:
                logger.exception("a worker-process message could not be sent")


@dataclass(slots=True)
class _Put:
    key: str
    state: SlotState
    landed: torch.cuda.Event | None


class PipeOutbox(EventOutbox):
    """The worker's outbox in a worker process: a step's events go to the server as one message."""

    __slots__ = ("_link", "_tasks", "_batch")

    def __init__(self, link: ServerLink, tasks: dict[int, EngineTask]) -> None:
        super().__init__()
        self._link = link
        self._tasks = tasks  # the tasks in flight here; a final item retires one
        self._batch: list[wire.PackedItem] = []

    def add(self, channel: EventChannel, item: EventItem) -> None:
        if not isinstance(channel, RemoteChannel):
            raise TypeError(f"a worker process delivers to RemoteChannels, not {type(channel).__name__}")
        self._batch.append(wire.pack_item(channel.task_id, item))
        if wire.is_final(item):
            self._tasks.pop(channel.task_id, None)

    def flush(self) -> bool:
        if self._batch:
            batch, self._batch = self._batch, []
            self._link.send((wire.EVENTS, batch))
        return False  # callers' loops live in the server process, which aborts for closed ones


class ProcessStateStore:
    """The worker's StateStore in a worker process. Session keys (and every key when this process
    keeps no cache of its own) live in the server's store, one source of truth for the state routes;
    prefix states, which are named by their content and so never go stale, live in this process's
    own cache on its device, with the shared disk tier behind it."""

    def __init__(self, link: ServerLink, server_store: bool, local: StateStore | None) -> None:
        self._link = link
        self._server_store = server_store
        self.local = local

    def _is_local(self, key: str) -> bool:
        return self.local is not None and key.startswith(PREFIX_CACHE_KEY_PREFIX)

    def get(self, key: str) -> SlotState | None:
        if self.local is not None and self._is_local(key):
            return self.local.get(key)
        payload = self._server_answer(wire.STORE_GET, key) if self._server_store else None
        return None if payload is None else SlotState.from_bytes(payload)  # type: ignore[arg-type]

    def put(self, key: str, state: SlotState) -> None:
        if self.local is not None and self._is_local(key):
            self.local.put(key, state)
        elif self._server_store:
            self._link.send_put(key, state)
        else:
            raise BackendError(400, "this albatross engine has no state cache")

    def contains(self, key: str) -> bool:
        if self.local is not None and self._is_local(key):
            return self.local.contains(key)
        return bool(self._server_answer(wire.STORE_CONTAINS, key)) if self._server_store else False

    def _server_answer(self, kind: str, key: str) -> wire.StoreResult:
        answer = self._link.request(kind, key)
        if isinstance(answer, str):  # the server's store failed: this task fails, the worker goes on
            raise BackendError(503, answer)
        return answer


def run(spec: WorkerProcessSpec, connection: Connection) -> None:
    """The worker process's target (spawned by worker_process.WorkerProcess)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s albatross-worker-{spec.index} %(levelname)s %(name)s: %(message)s")
    if "OMP_NUM_THREADS" not in os.environ:  # N processes of all the cores each would fight over them
        torch.set_num_threads(spec.cpu_threads)
    tqdm.set_lock(threading.RLock())  # not tqdm's default multiprocessing lock: a killed process would leak its semaphore
    link = ServerLink(connection)
    tasks: dict[int, EngineTask] = {}

    died = threading.Event()

    def on_death(worker: Worker, error: BaseException) -> None:
        died.set()
        # The worker has failed its tasks (their events are queued); the server answers with STOP.
        link.send((wire.DIED, f"{type(error).__name__}: {error}"))

    tokenizer = Tokenizer(Path(spec.vocab_path)) if spec.vocab_path else get_tokenizer()
    worker = Worker(
        spec.index, torch.device(spec.device), model_loader(spec.model_path, spec.config), spec.config, tokenizer,
        cache_bytes=spec.cache_bytes, on_death=on_death, outbox=PipeOutbox(link, tasks), device_step_factory=spec.device_step_factory,
    )  # fmt: skip
    worker.start()
    try:
        worker.ready.result()  # the server bounds the wait and kills a load that hangs
        store = _store(spec, link, worker)
    except BaseException as error:
        link.send((wire.LOAD_FAILED, f"{type(error).__name__}: {error}"))
        link.close()
        raise SystemExit(1) from None
    worker.store = store
    gc_policy.engine_started()
    plan = None if worker.plan is None else worker.plan.as_status()
    link.send((wire.READY, worker.fingerprint, str(worker.device), worker.overlap, worker.model_config, plan))
    _serve(connection, link, worker, tasks, store)
    link.fail_pending()  # a step waiting for a state must not hold up the stop
    worker.stop()  # fails what is left with 503 (queued to the server before the pipe closes)
    local = getattr(store, "local", None)
    close = getattr(local, "close", None)
    if callable(close):
        close(SHUTDOWN_FLUSH_S)  # flushes this process's prefix states to the disk tier, for a bounded time
    link.close()
    raise SystemExit(0 if worker.ready.done() and not died.is_set() else 1)


def _store(spec: WorkerProcessSpec, link: ServerLink, worker: Worker) -> ProcessStateStore | None:
    local: StateStore | None = None
    if spec.prefix_cache_settings is not None:
        from albatross_engine.state_cache import build_state_cache

        settings = spec.prefix_cache_settings
        if worker.plan is not None and worker.plan.cache_bytes < spec.cache_bytes:  # the memory plan lowered L1
            settings = dataclasses.replace(settings, state_l1_bytes=worker.plan.cache_bytes)
        local = build_state_cache(settings, worker.fingerprint, worker.device)
    if local is None and not spec.server_store:
        return None
    return ProcessStateStore(link, spec.server_store, local)


def _serve(connection: Connection, link: ServerLink, worker: Worker, tasks: dict[int, EngineTask], store: ProcessStateStore | None) -> None:
    """Read the server's messages until STOP or until the pipe closes (the server is gone)."""
    context = wire.TaskContext(worker.tokenizer)  # state files' states by id, this process's grammar compiler
    context.warm_in_background()
    while True:
        try:
            message = pickle.loads(connection.recv_bytes())
        except (EOFError, OSError):
            logger.warning("albatross worker %d: the server went away; stopping", worker.index)
            return
        kind = message[0]
        if kind == wire.SUBMIT:
            spec: wire.TaskSpec = message[1]
            try:
                task = wire.task_from_spec(spec, RemoteChannel(spec.task_id), context)
            except Exception as error:  # one bad task fails alone
                logger.exception("albatross worker %d: task %d could not be rebuilt", worker.index, spec.task_id)
                link.send((wire.EVENTS, [wire.pack_item(spec.task_id, BackendError(500, f"the worker could not take the task: {error}"))]))
                continue
            tasks[spec.task_id] = task
            if not worker.submit(task):
                tasks.pop(spec.task_id, None)
                link.send((wire.EVENTS, [wire.pack_item(spec.task_id, BackendError(503, "the albatross worker is stopping"))]))
        elif kind == wire.INITIAL_STATE:
            context.initial_states[message[1]] = EngineInitialState(message[1], SlotState.from_bytes(message[2]))
        elif kind == wire.ABORT:
            aborted = tasks.get(message[1])
            if aborted is not None:
                worker.abort(aborted)
        elif kind == wire.STORE_REPLY:
            link.resolve(message[1], message[2])
        elif kind == wire.QUERY:
            try:
                answer = _answer(str(message[2]), worker, store)
            except Exception:
                logger.exception("albatross worker %d: query %r failed", worker.index, message[2])
                answer = None
            link.send((wire.QUERY_REPLY, message[1], answer))
        elif kind == wire.STOP:
            return
        else:
            logger.error("albatross worker %d: unknown message %r", worker.index, kind)


def _answer(what: str, worker: Worker, store: ProcessStateStore | None) -> object:
    if what == wire.METRICS:
        return worker.metrics.snapshot()
    if what == wire.DEVICE_REPORT:
        return worker.device_report()
    if what == wire.PREFILL_BUDGET_FIT:
        return worker.prefill_budget_fit()
    if what == wire.PREFIX_CACHE_STATS:
        stats = getattr(store.local if store is not None else None, "stats", None)
        return stats() if callable(stats) else None
    raise ValueError(f"unknown query {what!r}; known: {', '.join(wire.QUERIES)}")


def with_l2_share(settings: Any, workers: int) -> Any:
    """Settings for one worker process's prefix cache: the host-RAM tier (L2) is split between the
    worker processes, so together they use what the server would; L1 is per device anyway."""
    l2 = getattr(settings, "state_l2_bytes", None)
    if l2 is None or not dataclasses.is_dataclass(settings):
        return settings
    return dataclasses.replace(settings, state_l2_bytes=l2 // workers)  # type: ignore[type-var]
