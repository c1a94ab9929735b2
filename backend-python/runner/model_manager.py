"""Holds the loaded backend and switches it: one load at a time, in a worker thread.

Status follows the runner: 0 offline, 2 loading, 3 working. A switch checks what it can first
(strategy, path, file format) and then shuts the old backend down (threads stopped, device memory
released) before the new one loads, because two large models rarely fit side by side. It also
keeps the Runner's state-file setting (`/update-config` `state`) and applies it to each model.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from enum import IntEnum
from pathlib import Path
from typing import Any

from runner.backends import (
    BACKENDS,
    BackendEntry,
    BackendLoadError,
    LoadRefused,
    UnknownStrategy,
    find_backend,
    load_factory,
    preflight,
)
from runner import heap
from runner.errors import ApiError, ClientGone
from runner.interface import AbstractRWKV, BackendError, SamplingDefaults
from runner.model_files import find_file
from runner.settings import ServerSettings
from runner.state_file import InitialState, load_state_file

RANDOM_MODEL_PREFIX = "random:"
TURN_DISCONNECT_POLL_S = 0.25  # how often a request waiting for the completion lock checks its client
log = logging.getLogger("runner.model_manager")

UNSUPPORTED_MODEL_SUFFIXES = (".gguf",)


class ModelStatus(IntEnum):
    OFFLINE = 0
    LOADING = 2
    WORKING = 3


class SwitchInProgress(Exception):
    """A load is already running (the route answers 304, as the runner does)."""


class ModelManager:
    def __init__(self, settings: ServerSettings, registry: Sequence[BackendEntry] = BACKENDS) -> None:
        self.settings = settings
        self.registry = registry
        self.status = ModelStatus.OFFLINE
        self.backend: AbstractRWKV | None = None
        self.backend_entry: BackendEntry | None = None
        self.strategy: str | None = None
        self.model_path: str | None = None
        self.completion_lock = asyncio.Lock()  # serialises requests of non-concurrent backends
        self._config_overrides: dict[str, Any] = {}
        self.initial_state: InitialState | None = None  # /update-config `state`, kept across switches
        self._switching = False

    # ---- loading -------------------------------------------------------------------------------

    def resolve_model_path(self, model: str) -> Path:
        """Absolute, or relative to the working directory, then to --models-dir; `.pth` optional."""
        if model.lower().endswith(UNSUPPORTED_MODEL_SUFFIXES):
            raise ApiError(400, f"{Path(model).suffix} models are not supported; load an RWKV-7 .pth checkpoint", "model")
        return find_file(model, self.settings.models_dir, "model file", "model")

    async def switch(self, model: str, strategy: str) -> None:
        """Load `model` with `strategy` (an empty model unloads). Raises SwitchInProgress, ApiError.

        Everything that can be checked without loading (the strategy, the path, the file's format)
        is checked while the old model still serves: a refused switch changes nothing. Only then is
        the old model shut down (two large models rarely fit side by side) and the new one loaded."""
        if self._switching or self.status is ModelStatus.LOADING:
            raise SwitchInProgress()
        if not model:
            await self.unload()
            return
        self._switching = True  # before the first await: a concurrent switch sees it
        try:
            entry, path = await self._checked_target(model, strategy)
            self.status = ModelStatus.LOADING
            previous = f" (replacing {self.model_path} with {self.strategy!r})" if self.model_path else ""
            log.info("loading %s with %r%s", path, strategy, previous)
            try:
                backend = await asyncio.to_thread(self._replace_backend, entry, path, strategy)
            except asyncio.CancelledError:
                self._forget_backend()
                raise
            except Exception as exc:
                self._forget_backend()
                reason = str(exc) or type(exc).__name__
                log.exception("failed to load %s with %r", path, strategy)
                raise ApiError(500, f"failed to load: {reason} (the previous model was unloaded first; no model is loaded now)") from exc
        finally:
            self._switching = False
        self.backend, self.backend_entry = backend, entry
        self.strategy, self.model_path = strategy, path
        self.status = ModelStatus.WORKING
        log.info("loaded %s with %r (%s backend)", path, strategy, entry.name)
        self._apply_initial_state_after_load(backend)

    async def _checked_target(self, model: str, strategy: str) -> tuple[BackendEntry, str]:
        try:
            entry = find_backend(strategy, self.registry)
        except UnknownStrategy as exc:
            raise ApiError(400, str(exc), "strategy") from exc
        # `random:<shape>` asks a backend for random weights of a real shape (benchmarks); only
        # backends that know the spec accept it, the others refuse it in their preflight.
        path = model if model.startswith(RANDOM_MODEL_PREFIX) else str(self.resolve_model_path(model))
        try:
            await asyncio.to_thread(preflight, entry, path, strategy)
        except LoadRefused as exc:
            raise ApiError(400, exc.message, exc.param) from exc
        except BackendLoadError as exc:
            raise ApiError(500, f"failed to load: {exc}") from exc
        return entry, path

    def _replace_backend(self, entry: BackendEntry, path: str, strategy: str) -> AbstractRWKV:
        """Runs in a worker thread: shut the old backend down, then build the new one."""
        self._shutdown_current()
        factory = load_factory(entry)
        try:
            return factory(path, strategy, self.settings)
        except BackendLoadError:
            raise
        except Exception as exc:
            raise BackendLoadError(str(exc) or type(exc).__name__) from exc

    def _shutdown_current(self) -> None:
        """Detach and shut down the serving backend; the status is the caller's business."""
        old = self.backend
        self.backend, self.backend_entry = None, None
        if old is not None:
            try:
                old.shutdown()
            except Exception:
                log.exception("shutting down the %s backend failed", old.backend_name)
            del old
            heap.trim()  # what the old model freed goes back to the OS, not into glibc's arenas

    def _forget_backend(self) -> None:
        self.backend, self.backend_entry = None, None
        self.strategy, self.model_path = None, None
        self.status = ModelStatus.OFFLINE

    async def unload(self) -> None:
        if self.status is ModelStatus.LOADING:
            raise SwitchInProgress()
        if self.backend is not None:
            self.status = ModelStatus.OFFLINE  # requests arriving during the shutdown get 503
            await asyncio.to_thread(self._shutdown_current)
            log.info("unloaded %s", self.model_path)
        self._forget_backend()

    # ---- serving -------------------------------------------------------------------------------

    def require_backend(self) -> AbstractRWKV:
        backend = self.backend
        if backend is None or self.status is not ModelStatus.WORKING:
            raise ApiError(503, "no model is loaded" if self.status is not ModelStatus.LOADING else "a model is loading")
        return backend

    @contextlib.asynccontextmanager
    async def generation_turn(self, backend: AbstractRWKV, client_gone: Callable[[], Awaitable[bool]] | None = None) -> AsyncIterator[None]:
        """Concurrent backends run at once; the others one request at a time, in arrival order.
        A request waiting for its turn gives up (ClientGone) once `client_gone()` says its client left."""
        if backend.concurrent:
            yield
            return
        await self._wait_for_turn(client_gone)
        try:
            yield
        finally:
            self.completion_lock.release()

    async def _wait_for_turn(self, client_gone: Callable[[], Awaitable[bool]] | None) -> None:
        acquiring = asyncio.ensure_future(self.completion_lock.acquire())
        try:
            while True:
                done, _ = await asyncio.wait({acquiring}, timeout=TURN_DISCONNECT_POLL_S)
                if done:
                    return
                if client_gone is not None and await client_gone():
                    raise ClientGone()
        except BaseException:
            if acquiring.done() and not acquiring.cancelled() and acquiring.exception() is None:
                self.completion_lock.release()  # the turn came just as we gave up: pass it on
            else:
                acquiring.cancel()
            raise

    # ---- sampling defaults ---------------------------------------------------------------------

    @property
    def config_overrides(self) -> Mapping[str, Any]:
        return dict(self._config_overrides)

    def update_config(self, values: Mapping[str, Any]) -> None:
        known = {f.name for f in dataclasses.fields(SamplingDefaults)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"not sampling defaults: {sorted(unknown)}")
        if "max_tokens" in values and values["max_tokens"] > self.settings.max_tokens:
            raise ApiError(400, f"max_tokens {values['max_tokens']} exceeds the server cap of {self.settings.max_tokens} (--max-tokens)", "max_tokens")
        self._config_overrides = {**self._config_overrides, **values}

    def sampling_defaults(self, backend: AbstractRWKV | None = None) -> SamplingDefaults:
        backend = backend or self.backend
        base = backend.defaults if backend is not None else SamplingDefaults()
        return dataclasses.replace(base, **self._config_overrides)

    # ---- the state file (RWKV-Runner's `state` setting) ------------------------------------------

    async def set_state_file(self, name: str) -> None:
        """`""` clears it. Otherwise the file is found (cwd, then --models-dir), loaded and checked
        (400 when it is no state file), and applied to the loaded model (400 when it does not fit
        it); on any refusal the previous setting stays. Without a loaded model it waits for the
        next one (the GUI sends it while its model is still loading)."""
        if not name:
            self.initial_state = None
            if self.backend is not None:
                self.backend.set_initial_state(None)
            log.info("state file cleared")
            return
        path = find_file(name, self.settings.models_dir, "state file", "state")
        try:
            state = await asyncio.to_thread(load_state_file, path)
        except LoadRefused as exc:
            raise ApiError(400, exc.message, exc.param) from exc
        backend = self.backend
        if backend is not None and self.status is ModelStatus.WORKING:
            try:
                backend.set_initial_state(state)
            except BackendError as exc:
                raise ApiError(exc.status_code, exc.message, "state") from exc
        self.initial_state = state
        log.info("state file %s set (%s)", path, "applied" if backend is not None else "applied at the next load")

    def _apply_initial_state_after_load(self, backend: AbstractRWKV) -> None:
        if self.initial_state is None:
            return
        try:
            backend.set_initial_state(self.initial_state)
        except BackendError as exc:
            log.warning("the state file %s is not applied to %s: %s", self.initial_state.path, backend.name, exc.message)
            self.initial_state = None

    async def shutdown(self) -> None:
        if self.backend is not None:
            self.status = ModelStatus.OFFLINE
            await asyncio.to_thread(self._shutdown_current)
            log.info("unloaded %s (shutting down)", self.model_path)
        self._forget_backend()
