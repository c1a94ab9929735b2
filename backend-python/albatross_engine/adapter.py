"""`AlbatrossRWKV`: the runner's AbstractRWKV on top of the continuous-batching engine.

This is the only module that knows the runner's interface. The runner finds it through
`runner/backends.py` and calls `create_backend(model_path, strategy, settings)`.

Model specs (model_specs.py): a checkpoint path, or `random:<shape>[:<seed>]` for random weights
built on each worker's device. Benchmarks may instead pass `model=` an already-built RWKV7 (one
worker thread, on that model's device), or `device_step_factory=` a simulated device.

Workers run as threads of this process or as processes of their own (`worker_mode`, see
config.py). With worker processes, the backend's `state_store` (the one the state routes manage)
lives here, on the host, and holds the sessions; each worker process keeps its own prefix cache
on its device when the store comes from the server settings (docs/engine.md, "Worker processes").
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from albatross.constraints import CompiledGrammar, ConstraintCompiler
from albatross.model import RWKV7
from albatross.tokenizer import Tokenizer, get_tokenizer
from albatross_engine import gc_policy
from albatross_engine.config import AlbatrossBackendConfig, config_field_names, parse_albatross_strategy
from albatross_engine.core import INIT_ERROR_PREFIX, EngineCore, EngineWorker
from albatross_engine.initial_state import EngineInitialState, NamespacedStateStore, namespace_for, slot_state_from_wkv
from albatross_engine.model_specs import ModelLoader, ModelSource, model_loader, model_name, parse_random_spec, shape_config
from albatross_engine.process_boundary import PREFIX_CACHE_STATS, merge_items
from albatross_engine.state_store import PromptEndIndex, StateStore
from albatross_engine.tasks import AsyncChannel, EngineTask, EventChannel, EventItem, PackedDelta, SyncChannel
from albatross_engine.worker import DeviceStepFactory, Worker
from albatross_engine.worker_process import QUERY_TIMEOUT_S, WorkerProcess, visible_device_of
from albatross_engine.worker_process_main import WorkerProcessSpec, with_l2_share
from runner.interface import AbstractRWKV, BackendError, GenerationEvent, GenerationRequest, compile_request_grammar

if TYPE_CHECKING:
    from albatross.checkpoint import ModelConfig
    from runner.settings import ServerSettings
    from runner.state_file import InitialState

logger = logging.getLogger(__name__)

__all__ = ["AlbatrossRWKV", "create_backend", "parse_random_spec", "shape_config"]

INIT_TIMEOUT_SECONDS = 300.0
# (model fingerprint, device) -> store; called with `l1_bytes=` when the memory plan lowered the L1 budget
StateStoreFactory = Callable[..., StateStore]


class AlbatrossRWKV(AbstractRWKV):
    version = 7
    tokenizer_len = 65536
    backend_name = "albatross"
    concurrent = True
    state_store: StateStore | None = None  # the engine's view: slot states by key

    def __init__(
        self,
        model_path: str,
        worker_num: int = 1,
        batch_size: int = 32,
        tokenizer: Tokenizer | str | Path | None = None,
        *,
        state_store: StateStore | None = None,
        state_store_factory: StateStoreFactory | None = None,
        settings: ServerSettings | None = None,
        model: RWKV7 | None = None,
        device_step_factory: DeviceStepFactory | None = None,
        init_timeout: float = INIT_TIMEOUT_SECONDS,
        **extras: Any,
    ) -> None:
        unknown = set(extras) - set(config_field_names())
        if unknown:
            raise TypeError(f"unknown albatross options {sorted(unknown)}; known: {', '.join(config_field_names())}")
        self.config = AlbatrossBackendConfig(worker_num=worker_num, batch_size=batch_size, **extras)
        self.settings = settings
        self.model_path = model_path
        self.name = model.name if model is not None else model_name(model_path)
        self.tokenizer = _resolve_tokenizer(tokenizer)
        # Built now (the vocabulary's token trie, once per process) so that the first constrained
        # request waits only for its own grammar.
        self._grammars = ConstraintCompiler(self.tokenizer)
        self.state_store = state_store  # what the state routes see (see set_initial_state)
        self._raw_store: StateStore | None = state_store  # the cache itself, as the workers use it
        self._state_store_factory = state_store_factory
        self._owns_store = False
        self._initial: EngineInitialState | None = None  # a state file's state (set_initial_state)
        self._model_config: ModelConfig | None = None
        self.fingerprint: str | None = None
        self.devices = _worker_devices(self.config, model)
        self.worker_mode = "thread" if model is not None else self.config.effective_worker_mode(self.devices[0].type)
        if model is not None and self.config.worker_mode == "process":
            raise ValueError("an already-built model is served by a worker thread (worker_mode=thread)")
        self._device_step_factory = device_step_factory
        # Worker processes keep their own prefix caches when the store is built from the server
        # settings; with a store passed in (tests), every state goes to that one.
        self._worker_prefix_caches = (
            self.worker_mode == "process" and settings is not None and state_store_factory is not None and state_store is None
        )
        self._core: EngineCore | None = None
        if self.worker_mode == "process":
            self._init_engine(self._worker_processes(), init_timeout, affinity=self._worker_prefix_caches)
        else:
            loader = _prebuilt_loader(model) if model is not None else model_loader(model_path, self.config)
            self._init_engine(self._worker_threads(loader), init_timeout, affinity=False)

    # ---------------------------------------------------------------------------- engine lifecycle

    def _l1_bytes(self) -> int:
        return int(getattr(self.settings, "state_l1_bytes", 0) or 0) if self._state_store_factory is not None else 0

    def _worker_threads(self, loader: ModelSource | ModelLoader) -> list[EngineWorker]:
        prompt_ends = PromptEndIndex()  # one store, so one index of its prompt ends
        l1_bytes = self._l1_bytes()  # the L1 state cache lives on worker 0's device: its plan leaves room for it
        return [
            Worker(i, device, loader, self.config, self.tokenizer, prompt_ends, cache_bytes=l1_bytes if i == 0 else 0,
                   device_step_factory=self._device_step_factory)  # fmt: skip
            for i, device in enumerate(self.devices)
        ]

    def _worker_processes(self) -> list[EngineWorker]:
        own_caches = self._worker_prefix_caches
        server_store = self.state_store is not None or self._state_store_factory is not None
        prefix_settings = with_l2_share(self.settings, len(self.devices)) if own_caches else None
        # Each worker process's own prefix cache has its L1 on its GPU: its plan leaves room for it.
        l1_bytes = self._l1_bytes() if own_caches else 0
        return [
            WorkerProcess(WorkerProcessSpec(
                index=i, device="cuda:0" if device.type == "cuda" else str(device), model_path=self.model_path, config=self.config,
                vocab_path=str(self.tokenizer.vocab_path), server_store=server_store, prefix_cache_settings=prefix_settings,
                device_step_factory=self._device_step_factory, log_level=logging.getLogger("albatross_engine").getEffectiveLevel(),
                cpu_threads=max(1, torch.get_num_threads() // len(self.devices)), cache_bytes=l1_bytes,
            ), device, visible_device_of(device))  # fmt: skip
            for i, device in enumerate(self.devices)
        ]

    def _init_engine(self, workers: list[EngineWorker], timeout: float, affinity: bool) -> None:
        core = EngineCore(workers, affinity=affinity)
        try:
            core.start(timeout, on_ready=lambda: self._attach_state_store(workers))
        except RuntimeError as error:
            message = str(error)
            raise RuntimeError(message if message.startswith(INIT_ERROR_PREFIX) else f"{INIT_ERROR_PREFIX}: {message}") from error
        self._core = core
        gc_policy.engine_started()
        logger.info(
            "Albatross engine initialized: workers=%d, batch_size=%d (worker mode %s on %s, overlap %s)",
            self.config.worker_num,
            self.config.batch_size,
            self.worker_mode,
            ", ".join(str(w.device) for w in workers),
            getattr(workers[0], "overlap", None),
        )

    def _attach_state_store(self, workers: list[EngineWorker]) -> None:
        first = workers[0]
        fingerprint = self.fingerprint = first.fingerprint  # type: ignore[attr-defined]
        self._model_config = first.model_config  # type: ignore[attr-defined]
        if self.state_store is None and self._state_store_factory is not None:
            if isinstance(first, WorkerProcess):  # worker processes reach it through their pipes: host memory here
                self.state_store = self._state_store_factory(fingerprint, torch.device("cpu"))
            elif first.plan is not None and first.plan.cache_bytes < first.cache_bytes:  # type: ignore[attr-defined]
                self.state_store = self._state_store_factory(fingerprint, first.device, l1_bytes=first.plan.cache_bytes)  # type: ignore[attr-defined]  # the plan lowered the L1 budget
            else:
                self.state_store = self._state_store_factory(fingerprint, first.device)
            self._owns_store = True
        self._raw_store = self.state_store
        for worker in workers:
            worker.store = self.state_store  # type: ignore[attr-defined]

    def shutdown(self) -> None:
        core, self._core = self._core, None
        if core is not None:
            core.shutdown()
            gc_policy.engine_stopped()
        close = getattr(self._raw_store, "close", None)
        if self._owns_store and callable(close):
            close()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def health(self) -> str | None:
        """None while every worker serves, else why not (GET /readyz)."""
        core = self._core
        return "the albatross engine is shut down" if core is None else core.health()

    @property
    def core(self) -> EngineCore:
        if self._core is None:
            raise BackendError(503, "the albatross engine is shut down")
        return self._core

    # ---------------------------------------------------------------------------- text

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    # ---------------------------------------------------------------------------- generation

    def _task(self, request: GenerationRequest, channel: EventChannel, grammar: CompiledGrammar | None) -> EngineTask:
        ref = request.state
        initial = self._initial
        # Saved states made from a state file live in its own key space (initial_state.py).
        namespace = namespace_for(initial.state_id if initial is not None else None)
        load_key = namespace + ref.load_key if ref and ref.load_key is not None else None
        save_key = namespace + ref.save_key if ref and ref.save_key is not None else None
        if (load_key or save_key) and self.state_store is None:
            raise BackendError(400, "this albatross engine was started without a state cache")
        if load_key is not None and not request.prompt_tokens and request.sampling.max_tokens > 0:
            raise BackendError(400, "continuing a saved state needs at least one prompt token to generate from")
        bad = [token_id for token_id, _ in request.sampling.logit_bias if token_id >= self.tokenizer_len]
        if bad:
            raise BackendError(400, f"logit_bias token ids must lie in [0, {self.tokenizer_len}); got {bad[:5]}")
        seed = request.sampling.seed
        return EngineTask(
            prompt_tokens=list(request.prompt_tokens),
            sampling=request.sampling,
            seed=secrets.randbits(64) if seed is None else seed,
            channel=channel,
            request_id=request.request_id,
            load_key=load_key,
            save_key=save_key,
            use_prefix_cache=bool(ref and ref.use_prefix_cache and load_key is None and self.state_store is not None),
            initial_state=initial,
            penalized_prompt_ids=list(request.penalized_prompt_ids),
            grammar=grammar,
        )

    def _compile(self, request: GenerationRequest) -> CompiledGrammar | None:
        """The request's output grammar, compiled for this vocabulary (cached by its text); a
        grammar that cannot be enforced is a 400 before anything is queued."""
        return compile_request_grammar(self._grammars, request.constraint)

    async def _compile_off_loop(self, request: GenerationRequest) -> CompiledGrammar | None:
        """`_compile` without holding up the caller's loop: a grammar not compiled yet (tens of
        milliseconds, the GIL released) compiles on a thread while the loop serves other streams."""
        if request.constraint is None:
            return None
        cached = self._grammars.cached_grammar(request.constraint.grammar)
        if cached is not None:
            return cached
        return await asyncio.to_thread(self._compile, request)

    async def async_generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """Events on the caller's loop. Closing the iterator (or cancelling its consumer) aborts."""
        channel = AsyncChannel(asyncio.get_running_loop())
        task = self._task(request, channel, await self._compile_off_loop(request))
        core = self.core
        core.submit(task)
        done = False
        queued: list[EventItem] = []
        at = 0  # the next unread item of `queued`
        try:
            while True:
                if at == len(queued):
                    queued, at = await channel.next_items(), 0
                item = queued[at]
                at += 1
                if isinstance(item, BaseException):
                    done = True
                    raise item
                # Under load the caller falls behind the engine; what has queued up meanwhile goes
                # out as one event (up to the finish; an error is raised on the next round). A
                # tuple is a worker process's plain delta, never final (process_boundary.py).
                later: list[GenerationEvent | PackedDelta] = []
                while isinstance(item, tuple) or item.finish_reason is None:
                    if at == len(queued):
                        queued, at = channel.take(), 0
                        if not queued:
                            break
                    following = queued[at]
                    if isinstance(following, BaseException):
                        break
                    at += 1
                    later.append(following)
                    if not isinstance(following, tuple) and following.finish_reason is not None:
                        break
                event = merge_items(item, later, task.prompt_len)
                done = event.finish_reason is not None
                yield event
                if done:
                    return
        finally:
            if not done:
                core.abort(task)

    def generate(self, request: GenerationRequest) -> Iterator[GenerationEvent]:
        """Blocking generation for scripts; closing the generator aborts the request."""
        channel = SyncChannel()
        task = self._task(request, channel, self._compile(request))
        core = self.core
        core.submit(task)
        done = False
        try:
            while True:
                item = channel.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if isinstance(item, tuple):  # a worker process's plain delta
                    item = merge_items(item, [], task.prompt_len)
                done = item.finish_reason is not None
                yield item
                if done:
                    return
        finally:
            if not done:
                core.abort(task)

    def generation_slots(self) -> int:
        return self.config.worker_num * self.config.batch_size

    def run_rnn(self, *args: object, **kwargs: object) -> object:
        raise NotImplementedError(
            "the albatross backend runs batch inference inside its engine and has no run_rnn(); use generate() or async_generate()"
        )

    def set_initial_state(self, state: InitialState | None) -> None:
        """A state file's WKV matrices start every task that has no saved state and no cached
        prefix; the state routes then see only the sessions made from it (initial_state.py)."""
        if state is None:
            self._initial = None
            self.state_store = self._raw_store
            return
        config = self._model_config
        if config is None:
            raise BackendError(503, "the albatross engine has not loaded its model")
        state.check_fits(config.n_layer, config.n_head, config.head_size)
        initial = EngineInitialState(state.state_id, slot_state_from_wkv(state.wkv, config.n_embd))
        self._initial = initial
        self.state_store = None if self._raw_store is None else NamespacedStateStore(self._raw_store, initial.key_namespace)

    # ---------------------------------------------------------------------------- status

    def status(self) -> dict[str, object]:
        core = self._core
        metrics = core.metrics().as_dict() if core is not None else {}
        result: dict[str, object] = {
            "worker_num": self.config.worker_num,
            "batch_size": self.config.batch_size,
            "device": ", ".join(str(d) for d in self.devices),
            "dtype": self.config.effective_dtype(self.devices[0].type),
            "weights": self.config.weights,
            "state_dtype": self.config.effective_state_dtype(self.devices[0].type),
            "prefill_chunk": self.config.prefill_chunk,
            "prefill_budget": self.config.prefill_budget,
            "itl_target_ms": self.config.itl_target_ms,
            "prefill_order": self.config.prefill_order,
            "worker_mode": self.worker_mode,
            "engine_running": core is not None and core.running,
            "workers": [] if core is None else [_worker_state(w) for w in core.workers],
            **metrics,
        }
        if core is not None:  # weights, states, activations, graphs, cache and free memory per worker
            plans = [(worker.device, _plan_status(worker)) for worker in core.workers]
            result["memory_plan"] = [{"device": str(device), **plan} for device, plan in plans if plan is not None]
        stats = getattr(self.state_store, "stats", None)
        if callable(stats):
            result["state_cache"] = stats()
        if core is not None and self._worker_prefix_caches:
            asked = [w.query(PREFIX_CACHE_STATS) for w in core.workers if isinstance(w, WorkerProcess)]  # all at once
            result["worker_prefix_caches"] = [_answer_or_none(answer) for answer in asked]
        return result


def create_backend(
    model_path: str, strategy: str, settings: ServerSettings, device_step_factory: DeviceStepFactory | None = None
) -> AlbatrossRWKV:
    """The runner's factory (runner/backends.py). The state cache seam: pass `state_store=` or
    `state_store_factory=` (called with the model's fingerprint and device once it has loaded).
    `device_step_factory` is the benchmarks' seam (bench/bench_server.py): None, the real step."""
    from albatross_engine.state_cache import build_state_cache

    config = parse_albatross_strategy(strategy)
    extras = {name: getattr(config, name) for name in config_field_names() if name not in ("worker_num", "batch_size")}

    def state_cache(fingerprint: str, device: torch.device, l1_bytes: int | None = None) -> StateStore:
        # Sized by --state-cache-path and --state-l{1,2,3}-bytes (L1 as the memory plan allows);
        # closed (flushed) by shutdown().
        sized = settings if l1_bytes is None else dataclasses.replace(settings, state_l1_bytes=l1_bytes)
        return build_state_cache(sized, fingerprint, device)

    factory = state_cache if settings is not None else None  # no server settings (scripts): no cache
    return AlbatrossRWKV(model_path, config.worker_num, config.batch_size, settings=settings, state_store_factory=factory,
                         device_step_factory=device_step_factory, **extras)  # fmt: skip


# ---------------------------------------------------------------------------- models and devices


def _answer_or_none(answer: Future[Any]) -> object:
    try:
        return answer.result(QUERY_TIMEOUT_S)
    except TimeoutError:
        return None


def _worker_state(worker: EngineWorker) -> str:
    if isinstance(worker, WorkerProcess):
        return worker.state
    return "serving" if worker.alive else "down"


def _plan_status(worker: EngineWorker) -> dict[str, object] | None:
    if isinstance(worker, WorkerProcess):
        return worker.plan_status
    plan = worker.plan  # type: ignore[attr-defined]
    return None if plan is None else plan.as_status()


def _prebuilt_loader(model: RWKV7) -> ModelLoader:  # planned once built, its weights resident
    def use_model(device: torch.device) -> RWKV7:
        return model

    return use_model


def _worker_devices(config: AlbatrossBackendConfig, model: RWKV7 | None) -> list[torch.device]:
    if model is not None:
        if config.worker_num != 1:
            raise ValueError("an already-built model serves exactly one worker")
        return [model.device]
    requested = config.effective_device(torch.cuda.is_available())
    if config.device is None and requested == "cpu":
        logger.info("Albatross: no CUDA device visible; running on the CPU")
    if requested == "cpu":
        return [torch.device("cpu")] * config.worker_num
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    first = torch.device(requested).index or 0
    if first + config.worker_num > visible:
        raise RuntimeError(
            f"{INIT_ERROR_PREFIX}: workers={config.worker_num} from {requested} needs "
            f"{first + config.worker_num} GPUs, but {visible} {'is' if visible == 1 else 'are'} visible"
        )
    return [torch.device("cuda", first + i) for i in range(config.worker_num)]


def _resolve_tokenizer(tokenizer: Tokenizer | str | Path | None) -> Tokenizer:
    if tokenizer is None:
        return get_tokenizer()
    if isinstance(tokenizer, (str, Path)):
        return Tokenizer(Path(tokenizer))
    return tokenizer
