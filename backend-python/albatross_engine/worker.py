"""A worker: one thread that owns one device's model, state slots and penalties, and steps them.

A step (see docs/engine.md): take new tasks and aborts from the inbox; admit waiting tasks into
free slots (zero state, a saved state, or the longest cached prompt prefix); issue ONE model call
for every decode token and the prefill chunks that fit the budget; sample all sampling rows in ONE
sampler call; copy only the sampled ids to the host (one sync); then the host work: detokenize,
match stops, emit events, retire finished tasks.

With `overlap` the host work of step N runs after step N+1 has been issued, so on a GPU it runs
while the device computes. A task found finished while processing step N already has a row in
step N+1; that row's sample is dropped and not counted, so outputs are identical either way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from albatross import cuda_ops
from albatross.detokenizer import TextStream
from albatross.model import RWKV7
from albatross.sampler import TopLogprobs, seed_to_seed32
from albatross.state import SlotState
from albatross.tokenizer import Tokenizer
from albatross_engine.device_step import DeviceStep, IssuedStep
from albatross_engine.config import AlbatrossBackendConfig
from albatross_engine.metrics import WorkerMetrics
from albatross_engine.scheduler import Row, RowKind, Scheduler, StepPlan
from albatross_engine.state_store import PrefixHasher, PromptEndIndex, StateStore, prefix_lookup_lengths
from albatross_engine.tasks import EngineTask, EventOutbox
from runner.interface import BackendError, GenerationEvent, TokenLogprob

logger = logging.getLogger(__name__)

ModelLoader = Callable[[torch.device], RWKV7]


class Worker:
    def __init__(
        self,
        index: int,
        device: torch.device,
        loader: ModelLoader,
        config: AlbatrossBackendConfig,
        tokenizer: Tokenizer,
        prompt_ends: PromptEndIndex | None = None,
        on_death: Callable[[Worker, BaseException], None] | None = None,
    ) -> None:
        self.index = index
        self.device = device
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = WorkerMetrics()
        self.ready: Future[None] = Future()
        self.store: StateStore | None = None  # set by the engine before any request arrives
        self.overlap = config.overlap if config.overlap is not None else device.type == "cuda"
        self._loader = loader
        self._prompt_ends = prompt_ends or PromptEndIndex()
        self._on_death = on_death
        self._scheduler = Scheduler(config.batch_size, config.prefill_chunk, config.prefill_budget)
        self._cond = threading.Condition()
        self._inbox: list[EngineTask] = []
        self._aborts: list[EngineTask] = []
        self._load = 0  # tasks placed here and not yet finished
        self._closed = False
        self._stopping = False
        self._outbox = EventOutbox()
        self.device_step: DeviceStep | None = None
        self._pending: IssuedStep | None = None  # issued, host work not done yet (overlap)
        self._thread = threading.Thread(target=self._run, name=f"albatross-worker-{index}", daemon=True)

    # ---------------------------------------------------------------------------- other threads

    @property
    def load(self) -> int:
        return self._load

    @property
    def model(self) -> RWKV7 | None:
        return None if self.device_step is None else self.device_step.model

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def submit(self, task: EngineTask) -> bool:
        """Queue a task; False when the worker no longer takes tasks."""
        with self._cond:
            if self._closed:
                return False
            task.worker_index = self.index
            self._inbox.append(task)
            self._load += 1
            self._cond.notify()
        return True

    def abort(self, task: EngineTask) -> None:
        task.abort_requested = True
        with self._cond:
            self._aborts.append(task)
            self._cond.notify()

    def stop(self, timeout: float | None = None) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ---------------------------------------------------------------------------- worker thread

    def _run(self) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # events, streams and graphs of this thread use its GPU
            self._load_model()
        except BaseException as error:  # noqa: BLE001 - any load failure must reach the engine start
            self._release_device()
            self.ready.set_exception(error)
            return
        self.ready.set_result(None)
        try:
            self._serve()
            self._shut_down(BackendError(503, "the albatross engine is shutting down"))
        except BaseException as error:  # noqa: BLE001 - a dead worker must fail its requests, not hang them
            logger.exception("albatross worker %d died", self.index)
            self._shut_down(BackendError(503, f"the albatross engine stopped: {type(error).__name__}: {error}"))
            if self._on_death is not None:
                self._on_death(self, error)
        finally:
            self._release_device()

    def _load_model(self) -> None:
        if self.device.type == "cuda":
            cuda_ops.enable_cuda_kernels()  # once per process: prebuilt binary, else JIT, else torch ops
        model = self._loader(self.device)
        self.device = model.device
        state_dtype = self.config.effective_state_dtype(self.device.type)
        self.device_step = DeviceStep(model, self.config.batch_size, state_dtype, self.config.cuda_graphs)

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not (self._inbox or self._aborts or self._stopping or self._has_work()):
                    self._cond.wait()
                if self._stopping:
                    return
                for task in self._inbox:
                    self._scheduler.add(task)
                self._inbox.clear()
                aborts, self._aborts = self._aborts, []
            self._step(aborts)

    def _has_work(self) -> bool:
        return bool(self._scheduler.waiting or self._scheduler.running or self._pending)

    def _step(self, aborts: list[EngineTask]) -> None:
        started = time.perf_counter()
        for task in aborts:
            self._abort(task)
        admitted = self._scheduler.admit()
        if admitted:
            self._admit(admitted)
            self._scheduler.share_prefills(admitted)
        plan = self._scheduler.plan()
        issued = None
        if plan:
            try:
                issued = self._issue(plan)
            except Exception as error:
                logger.exception("albatross worker %d: step failed; failing its %d rows", self.index, len(plan.rows))
                self._fail_rows(plan.rows, error)
                assert self.device_step is not None
                self.device_step.forget_last_step()  # the failed step's ids never existed
        if self.overlap:
            previous, self._pending = self._pending, issued
        else:
            previous = issued
        if previous is not None:
            self._process(previous)
        if not (plan or previous or admitted or aborts) and self._scheduler.running:
            # Running tasks with nothing to do would never finish: fail them rather than hang.
            self._fail_rows([Row(t, t.slot, RowKind.FEED) for t in self._scheduler.running.values()],
                            RuntimeError("scheduler stalled"))
        if self._outbox.flush():
            self._abort_closed_channels()
        self._record(started, plan)

    # ---------------------------------------------------------------------------- admission

    def _admit(self, tasks: list[EngineTask]) -> None:
        device_step = self.device_step
        assert device_step is not None
        device_step.reset_slots([task.slot for task in tasks])
        vocab = device_step.vocab_size
        for task in tasks:
            try:
                if task.prompt_tokens and not (0 <= min(task.prompt_tokens) and max(task.prompt_tokens) < vocab):
                    raise ValueError(f"prompt token ids must be within [0, {vocab})")
                task.seed32 = seed_to_seed32(task.seed)
                task.text_stream = TextStream(self.tokenizer, task.sampling.stop)
                if task.load_key is not None:
                    device_step.write_state(task.slot, self._load_state(task.load_key))
                elif task.use_prefix_cache and self.store is not None:
                    self._resume_prefix(task)
                if not task.prompt_tokens:  # a loaded state with nothing to generate
                    self._finish(task, "length", self._event(task))
            except Exception as error:
                self._fail(task, error)

    def _load_state(self, key: str) -> SlotState:
        state = None if self.store is None else self.store.get(key)
        if state is None:
            raise BackendError(404, f"state {key!r} not found")
        return state

    def _resume_prefix(self, task: EngineTask) -> None:
        assert self.device_step is not None and self.store is not None
        task.prefix_hasher = PrefixHasher(task.prompt_tokens)
        lengths = prefix_lookup_lengths(task.prompt_len, self._prompt_ends.below(task.prompt_len))
        lookup = PrefixHasher(task.prompt_tokens)
        keys = [(length, lookup.key_at(length)) for length in reversed(lengths)]
        for length, key in reversed(keys):
            state = self.store.get(key) if self.store.contains(key) else None
            if state is not None:
                self.device_step.write_state(task.slot, state)
                task.prompt_pos = task.cached_prompt_tokens = length
                break
        self.metrics.record_prefix_lookup(task.cached_prompt_tokens)

    # ---------------------------------------------------------------------------- the device step

    def _issue(self, plan: StepPlan) -> IssuedStep:
        assert self.device_step is not None
        issued = self.device_step.issue(plan)
        for row in plan.rows:  # states that only needed this step's forward to be issued
            if row.starts_followers:
                self._start_followers(row.task)
            if row.prefix_checkpoint:
                self._save_prefix(row)
            if row.kind is RowKind.FEED and row.task.finished:
                self._save_final(row.task)
        return issued

    def _start_followers(self, leader: EngineTask) -> None:
        assert self.device_step is not None
        followers = self._scheduler.start_followers(leader)
        if not followers:
            return
        try:
            self.device_step.copy_slot(leader.slot, [task.slot for task in followers])
            self.metrics.record_shared_prefill(leader.prompt_pos * len(followers))
        except Exception as error:
            logger.exception("albatross worker %d: sharing a prefill failed", self.index)
            for task in followers:
                self._fail(task, error)

    # ---------------------------------------------------------------------------- host work

    def _process(self, issued: IssuedStep) -> None:
        try:
            ids = issued.token_ids()
        except Exception as error:  # a device error surfaces at the sync
            logger.exception("albatross worker %d: step failed on the device", self.index)
            self._fail_rows(issued.plan.rows, error)
            assert self.device_step is not None
            self.device_step.forget_last_step(issued)
            return
        produced = 0
        for row in issued.plan.rows:
            task = row.task
            if task.finished:
                continue  # aborted, failed, or finished one step earlier (its sample here is dropped)
            try:
                if row.samples:
                    produced += 1
                    self._accept(task, ids[row.sample_row], issued, row.sample_row)
                elif row.kind is RowKind.PREFILL and row.stop == task.prompt_len and task.sampling.max_tokens == 0:
                    self._finish(task, "length", self._event(task))
            except Exception as error:
                logger.exception("albatross worker %d: request %s failed", self.index, task.request_id)
                self._fail(task, error)
        self.metrics.add_generated(produced)

    def _accept(self, task: EngineTask, token: int, issued: IssuedStep, sample_row: int) -> None:
        assert task.text_stream is not None
        task.completion_tokens += 1
        stream = task.text_stream
        reason = None
        if token in task.sampling.stop_token_ids:
            text, token_ids, reason = stream.flush(), [], "stop"
        else:
            text, stopped = stream.push_token(token)
            token_ids = [token]
            if stopped:
                reason = "stop"
            elif task.completion_tokens >= task.sampling.max_tokens:
                text += stream.flush()
                reason = "stop" if stream.stopped else "length"
        event = self._event(task, text, token_ids)
        if issued.logprobs is not None and sample_row in issued.logprob_rows:
            event.logprobs = [self._logprob(task, token, issued.logprobs, issued.logprob_rows[sample_row])]
        if reason is None:
            self._outbox.add(task.channel, event)
        else:
            self._finish(task, reason, event)

    def _logprob(self, task: EngineTask, token: int, data: TopLogprobs, row: int) -> TokenLogprob:
        k = task.sampling.logprobs or 0
        assert data.chosen is not None
        top_ids = data.top_ids[row, :k].tolist()
        top_values = data.top_values[row, :k].tolist()
        decode = self.tokenizer.decode
        top = [(i, decode([i]), v) for i, v in zip(top_ids, top_values)]
        return TokenLogprob(token_id=token, text=decode([token]), logprob=float(data.chosen[row]), top=top)

    @staticmethod
    def _event(task: EngineTask, text: str = "", token_ids: list[int] | None = None) -> GenerationEvent:
        return GenerationEvent(
            text=text,
            token_ids=token_ids if token_ids is not None else [],
            prompt_tokens=task.prompt_len,
            completion_tokens=task.completion_tokens,
            cached_prompt_tokens=task.cached_prompt_tokens,
        )

    # ---------------------------------------------------------------------------- finishing

    def _finish(self, task: EngineTask, reason: str, event: GenerationEvent) -> None:
        task.finish_reason = reason  # type: ignore[assignment]
        event.finish_reason = reason  # type: ignore[assignment]
        self.metrics.record_finish(reason)
        if task.save_key is not None and reason in ("stop", "length"):
            task.held_event = event
            if task.fed >= task.completion_tokens:
                self._save_final(task)
            else:
                task.final_feed_pending = True  # the next step feeds the last token, then saves
            return
        self._outbox.add(task.channel, event)
        self._release(task)

    def _save_final(self, task: EngineTask) -> None:
        """The final state (prompt and every generated token fed) goes to the store, then the
        held final event goes out: a client told "stop" can rely on the saved state."""
        assert self.device_step is not None and task.save_key is not None
        event = task.held_event or self._event(task)
        task.held_event = None
        try:
            if self.store is None:
                raise BackendError(400, "this albatross engine has no state cache")
            self.store.put(task.save_key, self.device_step.read_state(task.slot))
            self.metrics.record_state_save()
        except Exception as error:
            logger.exception("albatross worker %d: saving state %r failed", self.index, task.save_key)
            event = self._error_event(task, error)
        self._outbox.add(task.channel, event)
        self._release(task)

    def _save_prefix(self, row: Row) -> None:
        task = row.task
        assert self.device_step is not None and task.prefix_hasher is not None
        try:
            key = task.prefix_hasher.key_at(row.stop)
            if self.store is not None and not self.store.contains(key):
                self.store.put(key, self.device_step.read_state(row.slot))
                self.metrics.record_state_save()
            if row.stop == task.prompt_len:
                self._prompt_ends.add(row.stop)
        except Exception:  # a cache failure costs a future hit, never this request
            logger.exception("albatross worker %d: saving a prefix state failed", self.index)

    def _abort(self, task: EngineTask) -> None:
        if task.finished:
            return
        if self._scheduler.remove_waiting(task):
            task.finish_reason = "abort"
            self._outbox.add(task.channel, GenerationEvent(finish_reason="abort", prompt_tokens=task.prompt_len))
            self.metrics.record_finish("abort")
            self._finished_one()
        elif task.task_id in self._scheduler.running:
            task.finish_reason = "abort"
            event = self._event(task)
            event.finish_reason = "abort"
            self._outbox.add(task.channel, event)
            self.metrics.record_finish("abort")
            self._release(task)

    def _abort_closed_channels(self) -> None:
        for task in [*self._scheduler.waiting, *self._scheduler.running.values()]:
            if task.channel.closed:
                self._abort(task)

    def _release(self, task: EngineTask) -> None:
        self._scheduler.release(task)
        self._finished_one()

    def _finished_one(self) -> None:
        with self._cond:
            self._load -= 1

    @staticmethod
    def _error_event(task: EngineTask, error: BaseException) -> GenerationEvent:
        return GenerationEvent(
            finish_reason="error",
            error=f"{type(error).__name__}: {error}",
            prompt_tokens=task.prompt_len,
            completion_tokens=task.completion_tokens,
            cached_prompt_tokens=task.cached_prompt_tokens,
        )

    def _fail(self, task: EngineTask, error: BaseException) -> None:
        """End one task with an error; the others carry on."""
        holds_slot = task.task_id in self._scheduler.running
        if not holds_slot and not self._scheduler.remove_waiting(task):
            return  # already finished and released
        task.finish_reason = "error"
        task.final_feed_pending = False
        task.held_event = None
        self._outbox.add(task.channel, error if isinstance(error, BackendError) else self._error_event(task, error))
        self.metrics.record_finish("error")
        if holds_slot:
            self._scheduler.release(task)
        self._finished_one()

    def _fail_rows(self, rows: list[Row], error: BaseException) -> None:
        """A step failed: fail its tasks and reset their slots (a failing reset kills the worker)."""
        assert self.device_step is not None
        slots = sorted({row.slot for row in rows})
        for row in rows:
            self._fail(row.task, error)
        if slots:
            self.device_step.reset_slots(slots)

    # ---------------------------------------------------------------------------- bookkeeping

    def _record(self, started: float, plan: StepPlan) -> None:
        metrics = self.metrics
        if plan:
            metrics.record_step(time.perf_counter() - started, plan.decode_tokens, plan.prefill_tokens)
        metrics.set_occupancy(len(self._scheduler.running), len(self._scheduler.waiting))
        if self.device_step is not None and self.device.type == "cuda":
            metrics.set_peak_memory(self.device_step.peak_memory_bytes())

    def _shut_down(self, error: BackendError) -> None:
        """Fail every task this worker holds or has queued, and take no more."""
        with self._cond:
            self._closed = True
            queued, self._inbox = self._inbox, []
        tasks = [*queued, *self._scheduler.waiting, *self._scheduler.running.values()]
        self._scheduler.waiting.clear()
        for task in tasks:
            if task.task_id in self._scheduler.running:
                self._scheduler.release(task)
            task.finish_reason = "error"
            self._outbox.add(task.channel, error)
        self._outbox.flush()
        with self._cond:
            self._load = 0
        self._pending = None

    def _release_device(self) -> None:
        self.device_step = None
        self._pending = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
