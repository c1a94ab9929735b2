"""Test doubles for the runner's route tests: a scripted backend and helpers to serve it.

`ScriptedBackend` tokenizes one token per UTF-8 byte and replies with text pieces chosen by the
test (one event per piece), so routes can be checked against exact token boundaries without a model.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from ports import free_port
from runner.app import ROUTE_MODULES, create_app
from runner.backends import BACKENDS, BackendEntry
from runner.context import app_context
from runner.interface import AbstractRWKV, BackendError, GenerationEvent, GenerationRequest, SamplingDefaults
from runner.model_manager import ModelStatus
from runner.server import uvicorn_config
from runner.settings import ServerSettings

Script = Callable[[GenerationRequest], list[str]]


def echo_seed_script(request: GenerationRequest) -> list[str]:
    """Pieces that show which seed and prompt length the request had."""
    return ["seed=", str(request.sampling.seed), f" prompt={len(request.prompt_tokens)}"]


class ScriptedBackend(AbstractRWKV):
    backend_name = "scripted"

    def __init__(
        self,
        script: Script | list[str] = echo_seed_script,
        name: str = "scripted-model",
        concurrent: bool = False,
        fail_before_start: BackendError | None = None,
        fail_after_pieces: int | None = None,
        defaults: SamplingDefaults = SamplingDefaults(),
        piece_delay_s: float = 0.0,
    ) -> None:
        self.script = (lambda _request: list(script)) if isinstance(script, list) else script
        self.name = name
        self.concurrent = concurrent
        self.fail_before_start = fail_before_start
        self.fail_after_pieces = fail_after_pieces
        self.defaults = defaults
        self.piece_delay_s = piece_delay_s
        self.requests: list[GenerationRequest] = []
        self.finished: list[str] = []  # request ids that ran to their end
        self.aborted: list[str] = []  # request ids closed before their end
        self.active = 0
        self.max_active = 0
        self.shutdown_calls = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")

    def _events(self, request: GenerationRequest) -> Iterator[GenerationEvent]:
        pieces = self.script(request)
        limit = request.sampling.max_tokens
        produced = 0
        for number, piece in enumerate(pieces):
            if self.fail_after_pieces is not None and number == self.fail_after_pieces:
                yield GenerationEvent(finish_reason="error", error="scripted failure", prompt_tokens=len(request.prompt_tokens), completion_tokens=produced)
                return
            if produced >= limit:
                yield GenerationEvent(finish_reason="length", prompt_tokens=len(request.prompt_tokens), completion_tokens=produced)
                return
            produced += 1
            yield GenerationEvent(text=piece, token_ids=[1000 + number], prompt_tokens=len(request.prompt_tokens), completion_tokens=produced)
        yield GenerationEvent(finish_reason="stop", prompt_tokens=len(request.prompt_tokens), completion_tokens=produced)

    def generate(self, request: GenerationRequest) -> Iterator[GenerationEvent]:
        if self.fail_before_start is not None:
            raise self.fail_before_start
        self.requests.append(request)
        yield from self._events(request)

    async def async_generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        if self.fail_before_start is not None:
            raise self.fail_before_start
        self.requests.append(request)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        completed = False
        try:
            for event in self._events(request):
                await asyncio.sleep(self.piece_delay_s)
                yield event
            completed = True
        finally:
            self.active -= 1
            (self.finished if completed else self.aborted).append(request.request_id)

    def status(self) -> dict[str, object]:
        return {"worker_num": 1, "batch_size": 4, "active_slots": self.active, "cache_hits": {"l1": 2, "l2": 1}}

    def shutdown(self) -> None:
        self.shutdown_calls += 1


# The factory the registry entry below points at: strategy "fake" [concurrent].
CREATED: list[tuple[str, str, ScriptedBackend]] = []


def create_backend(model_path: str, strategy: str, settings: ServerSettings) -> ScriptedBackend:
    if "explode" in strategy.split():
        raise RuntimeError("the scripted load failed")
    backend = ScriptedBackend(name=Path(model_path).stem, concurrent="concurrent" in strategy.split())
    CREATED.append((model_path, strategy, backend))
    return backend


FAKE_ENTRY = BackendEntry("fake", ("fake",), "runner_fakes:create_backend", "fake")
TEST_REGISTRY: tuple[BackendEntry, ...] = (FAKE_ENTRY, *BACKENDS)


def make_app(settings: ServerSettings | None = None, backend: AbstractRWKV | None = None, route_modules: Sequence[str] = ROUTE_MODULES) -> FastAPI:
    app = create_app(settings or ServerSettings(), registry=TEST_REGISTRY, route_modules=route_modules)
    if backend is not None:
        install_backend(app, backend)
    return app


def install_backend(app: FastAPI, backend: AbstractRWKV, strategy: str = "fake") -> None:
    """Serve `backend` as if /switch-model had loaded it."""
    manager = app_context(app).manager
    manager.backend, manager.backend_entry = backend, FAKE_ENTRY
    manager.strategy, manager.model_path = strategy, f"/models/{backend.name}.pth"
    manager.status = ModelStatus.WORKING


def settings_with(**changes: object) -> ServerSettings:
    return dataclasses.replace(ServerSettings(), **changes)  # type: ignore[arg-type]


def sse_payloads(text: str) -> list[str]:
    """The `data:` payloads of an SSE body, in order."""
    events = [block for block in text.split("\n\n") if block.strip()]
    assert all(block.startswith("data: ") for block in events), f"not SSE events: {events!r}"
    return [block[len("data: ") :] for block in events]


@contextlib.contextmanager
def live_server(app: FastAPI, settings: ServerSettings | None = None) -> Iterator[str]:
    """Serve `app` with uvicorn on a free local port in a thread; yields the base URL. With
    `settings`, the server is configured as main.py configures it (runner.server)."""
    port = free_port()
    if settings is None:
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    else:
        config = uvicorn_config(app, dataclasses.replace(settings, host="127.0.0.1", port=port, log_level="warning"))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    try:
        for _ in range(500):
            if server.started:
                break
            if not thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        else:
            raise RuntimeError("the test server did not start in time")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
