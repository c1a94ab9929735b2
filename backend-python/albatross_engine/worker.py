"""A worker: one thread that owns one device's model, state slots and penalties, and steps them.

The step loop (docs/engine.md, "A request's walk"): take new tasks and aborts from the inbox;
admit waiting tasks into free slots and prepare their starting states (`SavedStates`); plan the
step (`Scheduler`); issue it, ONE model call and ONE sampler call (`DeviceStep`); process the
sampled ids into events (`ResultProcessor`, which ends tasks through the `Finisher`).

With `overlap` the host work of step N runs after step N+1 has been issued, so on a GPU it runs
while the device computes. A task found finished while processing step N already has a row in
step N+1; that row's sample is dropped and not counted, so outputs are identical either way.

Rows under a grammar sample once their masks are known (`GrammarMasks`): after the host work of
the step before (which advanced their matchers), before the next step is issued.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from albatross import cuda_ops, int8_dispatch
from albatross.checkpoint import ModelConfig
from albatross.detokenizer import TextStream
from albatross.dtypes import DTYPES
from albatross.model import RWKV7
from albatross.sampler import seed_to_seed32
from albatross.tokenizer import Tokenizer
from albatross_engine.allocator import use_expandable_segments
from albatross_engine.config import AlbatrossBackendConfig
from albatross_engine.device_step import DeviceStep, IssuedStep, RowInputsRefused, free_device_memory
from albatross_engine.finishing import Finisher, fail_all
from albatross_engine.memory_plan import MemoryPlan, MemoryPlanError, MemoryRequest, plan_memory
from albatross_engine.grammar_masks import GrammarMasks
from albatross_engine.metrics import MetricsSnapshot, WorkerMetrics
from albatross_engine.model_specs import ModelLoader, ModelSource
from albatross_engine.results import ResultProcessor
from albatross_engine.saved_states import SavedStates
from albatross_engine.scheduler import Row, RowKind, Scheduler, StepPlan
from albatross_engine.state_store import PromptEndIndex, StateStore
from albatross_engine.tasks import EngineTask, EventOutbox
from runner.interface import BackendError

logger = logging.getLogger(__name__)

# (model, batch_size, state_dtype, cuda_graphs) -> the device side; benchmarks pass a simulated one.
DeviceStepFactory = Callable[[RWKV7, int, str, bool], DeviceStep]


class Worker:
    isolated = False  # its death ends the engine: a thread's failure may have broken the process's CUDA context

    def __init__(
        self,
        index: int,
        device: torch.device,
        loader: ModelSource | ModelLoader,
        config: AlbatrossBackendConfig,
        tokenizer: Tokenizer,
        prompt_ends: PromptEndIndex | None = None,
        on_death: Callable[[Worker, BaseException], None] | None = None,
        cache_bytes: int = 0,
        *,
        outbox: EventOutbox | None = None,
        device_step_factory: DeviceStepFactory | None = None,  # None: DeviceStep
    ) -> None:
        self.index = index
        self.device = device
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = WorkerMetrics()
        self.ready: Future[None] = Future()
        self.overlap = config.overlap if config.overlap is not None else device.type == "cuda"
        self._source = loader if isinstance(loader, ModelSource) else ModelSource(loader)
        self.cache_bytes = cache_bytes  # the L1 state cache's budget asked for on this device (worker 0 holds it)
        self.plan: MemoryPlan | None = None  # made on this worker's thread at load
        self._prompt_ends = prompt_ends or PromptEndIndex()
        self.on_death = on_death  # the engine core's: a dead worker ends the engine
        self._scheduler = Scheduler(
            config.batch_size, config.prefill_chunk, config.prefill_budget, itl_target_s=config.itl_target_s,
            prefill_order=config.prefill_order,
        )
        self._cond = threading.Condition()
        self._inbox: list[EngineTask] = []
        self._aborts: list[EngineTask] = []
        self._load = 0  # tasks placed here and not yet finished
        self._closed = False
        self._stopping = False
        self._outbox = outbox if outbox is not None else EventOutbox()  # a worker process passes one that pipes events
        self._device_step_factory: DeviceStepFactory = device_step_factory or DeviceStep
        self._store: StateStore | None = None
        self.device_step: DeviceStep | None = None
        # Made with the device step, on this worker's thread (_load_model):
        self._saved_states: SavedStates | None = None
        self._finisher: Finisher | None = None
        self._results: ResultProcessor | None = None
        self._masks: GrammarMasks | None = None
        self._pending: IssuedStep | None = None  # issued, host work not done yet (overlap)
        self._last_ids_at: float | None = None  # when the last processed step's ids reached the host
        self._thread = threading.Thread(target=self._run, name=f"albatross-worker-{index}", daemon=True)

    # ---------------------------------------------------------------------------- other threads

    @property
    def load(self) -> int:
        return self._load

    @property
    def model(self) -> RWKV7 | None:
        return None if self.device_step is None else self.device_step.model

    @property
    def model_config(self) -> ModelConfig:
        return self._loaded_model().config

    @property
    def fingerprint(self) -> str:
        return self._loaded_model().fingerprint

    def _loaded_model(self) -> RWKV7:
        model = self.model
        if model is None:
            raise RuntimeError(f"worker {self.index} has no model loaded")
        return model

    def metrics_future(self) -> Future[MetricsSnapshot]:
        """The counters now (the core asks worker processes without waiting; a thread answers at once)."""
        future: Future[MetricsSnapshot] = Future()
        future.set_result(self.metrics.snapshot())
        return future

    def device_report(self) -> dict[str, object]:
        """What the device side reports about itself, when it keeps a report (the benchmarks'
        simulated and profiled devices do); read it before shutdown."""
        report = getattr(self.device_step, "report", None)
        return report() if callable(report) else {}

    def prefill_budget_fit(self) -> dict[str, float | int | None]:
        """The adaptive prefill budget's state (PrefillBudget.describe): its target, the last
        budget and the step-time fit this worker has measured."""
        return self._scheduler.budget.describe()

    @property
    def store(self) -> StateStore | None:
        return self._store

    @store.setter
    def store(self, store: StateStore | None) -> None:
        """Set by the engine once the model's fingerprint is known, before any request arrives."""
        self._store = store
        if self._saved_states is not None:
            self._saved_states.store = store

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
        except BaseException as error:  # any load failure must reach the engine start
            self._release_device()
            self.ready.set_exception(error)
            return
        self.ready.set_result(None)
        try:
            self._serve()
            self._shut_down(BackendError(503, "the albatross engine is shutting down"))
        except BaseException as error:  # a dead worker must fail its requests, not hang them
            logger.exception("albatross worker %d died", self.index)
            try:
                # The engine records why it stopped before the failed requests wake their callers,
                # so a request that follows at once is told the engine died, not that it restarts.
                if self.on_death is not None:
                    self.on_death(self, error)
            finally:
                self._shut_down(BackendError(503, f"the albatross engine stopped: {type(error).__name__}: {error}"))
        finally:
            self._release_device()

    def _load_model(self) -> None:
        if self.device.type == "cuda":
            use_expandable_segments()  # before the weights: reserved memory follows the plan's allocations
            cuda_ops.enable_cuda_kernels()  # once per process: prebuilt binary, else JIT, else torch ops
        source = self._source
        try:
            if source.config is not None:  # refuse (or lower) before reading a weight
                self._plan(source.config(), self.config.weights, DTYPES[self.config.effective_dtype(self.device.type)])
            model = source.build(self.device)
            self.device = model.device
            if self.plan is None:  # a model built before the plan: its weights are already resident
                self._plan(model.config, model.weights, model.dtype, resident_weight_bytes=model.weight_bytes())
            plan = self.plan
            assert plan is not None
            state_dtype = self.config.effective_state_dtype(self.device.type)
            device_step = self.device_step = self._device_step_factory(model, plan.batch_size, state_dtype, self.config.cuda_graphs)
            device_step.warm_long_prefill(plan.prefill_budget)
        except torch.OutOfMemoryError as error:  # the plan's estimate fell short: one message, no traceback
            raise MemoryPlanError(_out_of_memory_message(self.plan, error)) from None
        self._saved_states = SavedStates(device_step, self.metrics, self._prompt_ends, self._store)
        self._finisher = Finisher(self._scheduler, self._outbox, self.metrics, self._saved_states, device_step, self._finished_one)
        self._results = ResultProcessor(device_step, self._finisher, self._outbox, self.metrics, self.tokenizer)
        self._masks = GrammarMasks(device_step, self._finisher, self.metrics)

    def _plan(self, model_config: ModelConfig, weights: str, dtype: torch.dtype, resident_weight_bytes: int = 0) -> None:
        """Check the request against this device's free memory; lower what may be lowered (one log
        line), or raise MemoryPlanError. On the CPU the plan only records the sizes."""
        request = MemoryRequest(
            config=model_config,
            weights=weights,
            dtype_bytes=dtype.itemsize,
            state_dtype_bytes=DTYPES[self.config.effective_state_dtype(self.device.type)].itemsize,
            batch_size=self.config.batch_size,
            prefill_chunk=self.config.prefill_chunk,
            prefill_budget=self.config.prefill_budget,
            cuda_graphs=self.config.cuda_graphs and self.device.type == "cuda",
            cache_bytes=self.cache_bytes if self.device.type == "cuda" else 0,
            resident_weight_bytes=resident_weight_bytes,
        )
        free = _free_bytes(self.device)
        plan = self.plan = plan_memory(request, free, int8_dispatch.dequantize_above_rows(self.device.type))
        if plan.lowered:
            logger.warning(
                "albatross worker %d: memory plan for %s (%.1f GB free): lowered %s",
                self.index, self.device, (free or 0) / 1e9, "; ".join(plan.lowered),
            )  # fmt: skip
            self._scheduler = Scheduler(
                plan.batch_size, plan.prefill_chunk, plan.prefill_budget, itl_target_s=self.config.itl_target_s,
                prefill_order=self.config.prefill_order,
            )

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
        finisher, results = self._finisher, self._results
        assert finisher is not None and results is not None
        started = time.perf_counter()
        for task in aborts:
            finisher.abort(task)
        admitted = self._scheduler.admit()
        if admitted:
            self._prepare(admitted, finisher)
            self._scheduler.share_prefills(admitted)
        plan = self._scheduler.plan()
        issued, after_issue = self._issue(plan, finisher) if plan else (None, [])
        if self.overlap:
            previous, self._pending = self._pending, issued
            if previous is not None:
                # advances the matchers that the masks of `issued` need, then lets their fill start
                results.process(previous, self._start_masks(issued))
                if self._outbox.flush():  # the previous step's tokens go out before the copies below are queued
                    finisher.abort_closed_channels()
            self._after_issue(after_issue)
            if issued is not None:
                self._sample_masked(issued, finisher)
        else:
            previous = issued
            self._after_issue(after_issue)
            if issued is not None:
                self._sample_masked(issued, finisher)
                results.process(issued)
        self._feed_step_time(previous)
        if not (plan or previous or admitted or aborts) and self._scheduler.running:
            # Running tasks with nothing to do would never finish: fail them rather than hang.
            finisher.fail_rows([Row(t, t.slot, RowKind.FEED) for t in self._scheduler.running.values()],
                               RuntimeError("scheduler stalled"))
        if self._outbox.flush():
            finisher.abort_closed_channels()
        self._record(started, plan)

    def _feed_step_time(self, processed: IssuedStep | None) -> None:
        """The adaptive prefill budget learns from the spacing of consecutive steps' ids on the
        host, which is what a decoding stream waits per token; taken where the host already waited
        for them (no sync of its own)."""
        ids_at = processed.ids_at if processed is not None else None
        if processed is not None and ids_at is not None and self._last_ids_at is not None:
            self._scheduler.observe_step(processed.plan, ids_at - self._last_ids_at)
        self._last_ids_at = ids_at

    def _prepare(self, tasks: list[EngineTask], finisher: Finisher) -> None:
        """Admitted tasks: zeroed slots (one call), then each task's checks and starting state."""
        device_step, saved_states = self.device_step, self._saved_states
        assert device_step is not None and saved_states is not None
        device_step.reset_slots([task.slot for task in tasks])
        vocab = device_step.vocab_size
        for task in tasks:
            try:
                if task.prompt_tokens and not (0 <= min(task.prompt_tokens) and max(task.prompt_tokens) < vocab):
                    raise ValueError(f"prompt token ids must be within [0, {vocab})")
                task.seed32 = seed_to_seed32(task.seed)
                task.text_stream = TextStream(self.tokenizer, task.sampling.stop)
                if task.grammar is not None:
                    task.matcher = task.grammar.matcher()
                saved_states.prepare(task)
                if task.penalized_prompt_ids:
                    device_step.penalties.seed(task.slot, task.penalized_prompt_ids, task.sampling)
                if not task.prompt_tokens:  # a loaded state with nothing to generate
                    finisher.finish(task, "length", task.event())
            except Exception as error:
                finisher.fail(task, error)

    def _issue(self, plan: StepPlan, finisher: Finisher) -> tuple[IssuedStep | None, list[Callable[[], None]]]:
        """The step queued on the device, and what must follow it before the next step is queued:
        the prefix-state saves, the followers' state copies and the final-state saves of its rows
        (each decided now, run by `_after_issue`). With overlap they run after the previous step's
        results are processed: on a GPU a step's ~800 launches and a burst step's ~60 saves of
        several copies each fill the device's launch queue, so a launch blocks until the device
        drains room; queued before that processing, the saves held the previous step's tokens
        until the device was well into this step (docs/performance.md, "Session 26")."""
        device_step, saved_states = self.device_step, self._saved_states
        assert device_step is not None and saved_states is not None
        try:
            issued = device_step.issue(plan)
        except RowInputsRefused as refused:
            logger.warning("albatross worker %d: failing %d of %d rows whose inputs the step refused: %s",
                           self.index, len(refused.rows), len(plan.rows), refused)
            finisher.fail_rows(refused.rows, refused.error)
            rest = plan.without({row.task.task_id for row in refused.rows})
            return self._issue(rest, finisher) if rest else (None, [])
        except Exception as error:
            logger.exception("albatross worker %d: step failed; failing its %d rows", self.index, len(plan.rows))
            finisher.fail_rows(plan.rows, error)
            device_step.forget_last_step()  # the failed step's ids never existed
            return None, []
        after: list[Callable[[], None]] = []
        for index, row in enumerate(plan.rows):  # states that only needed this step's forward to be issued
            task = row.task
            if row.starts_followers:
                after.append(functools.partial(self._start_followers, task, finisher))
            for length, state in zip(row.checkpoints, issued.captured.get(index, ())):
                after.append(functools.partial(self._unless_ended, task, saved_states.save_prefix_state, task, length, state))
            if row.prefix_checkpoint:
                after.append(functools.partial(self._unless_ended, task, saved_states.save_prefix, row))
            if row.kind is RowKind.FEED and task.finished:  # ended before this step: its final state is in this step
                after.append(functools.partial(finisher.save_final, task))
        return issued, after

    @staticmethod
    def _unless_ended(task: EngineTask, save: Callable[..., None], *args: object) -> None:
        """A prefix save for a task still running: one that failed in between (the previous step's
        results) has its slot back in the free list, and nothing of it is worth keeping."""
        if not task.finished:
            save(*args)

    @staticmethod
    def _after_issue(actions: list[Callable[[], None]]) -> None:
        for action in actions:
            action()

    def _start_masks(self, issued: IssuedStep | None) -> Callable[[], None] | None:
        masks = self._masks
        if issued is None or issued.masked is None or masks is None:
            return None
        return lambda: masks.start(issued)

    def _sample_masked(self, issued: IssuedStep, finisher: Finisher) -> None:
        masks, device_step = self._masks, self.device_step
        assert masks is not None and device_step is not None
        try:
            masks.sample(issued)
        except Exception as error:
            logger.exception("albatross worker %d: sampling masked rows failed; failing the step's %d rows", self.index, len(issued.plan.rows))
            issued.masked = None  # its ids are lost with its rows
            finisher.fail_rows(issued.plan.rows, error)
            device_step.forget_last_step(issued)

    def _start_followers(self, leader: EngineTask, finisher: Finisher) -> None:
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
                finisher.fail(task, error)

    def _record(self, started: float, plan: StepPlan) -> None:
        scheduler, device_step = self._scheduler, self.device_step
        peak = device_step.peak_memory_bytes() if device_step is not None and self.device.type == "cuda" else 0
        seconds = time.perf_counter() - started if plan else None
        self.metrics.record_step(seconds, plan.decode_tokens, plan.prefill_tokens, len(scheduler.running), len(scheduler.waiting), peak)

    # ---------------------------------------------------------------------------- ending

    def _finished_one(self) -> None:
        with self._cond:
            self._load -= 1

    def _shut_down(self, error: BackendError) -> None:
        """Fail every task this worker holds or has queued, and take no more."""
        with self._cond:
            self._closed = True
            queued, self._inbox = self._inbox, []
        scheduler = self._scheduler
        fail_all(scheduler, self._outbox, [*queued, *scheduler.waiting, *scheduler.running.values()], error)
        with self._cond:
            self._load = 0
        self._pending = None

    def _release_device(self) -> None:
        self.device_step = None
        self._saved_states = self._finisher = self._results = None
        if self._masks is not None:
            self._masks.close()
        self._masks = None
        self._pending = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _free_bytes(device: torch.device) -> int | None:
    """What the plan may use on `device`; None on the CPU (not checked). CPU tests simulate a GPU's
    free memory by replacing this."""
    return free_device_memory(device) if device.type == "cuda" else None


def _out_of_memory_message(plan: MemoryPlan | None, error: BaseException) -> str:
    first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
    planned = ""
    if plan is not None and plan.free_bytes is not None:
        planned = f" (the memory plan counted {plan.planned_bytes / 1e9:.1f} GB of {plan.free_bytes / 1e9:.1f} GB free)"
    return (
        f"the GPU ran out of memory while loading the model{planned}: lower batch or prefill_budget, "
        f"or use weights=int8 ({first_line})"
    )
