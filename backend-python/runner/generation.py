"""Drives one HTTP request's generations on the loaded backend, for every completion route.

A request becomes one or more `ChoiceJob`s. `GenerationDriver` merges their events (choices of a
concurrent backend run at once; otherwise one after another, each under the completion lock),
measures time-to-first-token and inter-token gaps, watches for a client that left, and closes
every backend iterator (which aborts it) however the route ends. `collect` and `stream_events`
are the two ways a route consumes it; the per-token path does no heavy work.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import anyio
from starlette.requests import Request

from runner.admission import Ticket
from runner.errors import ApiError, ClientGone, internal_error
from runner.interface import AbstractRWKV, BackendError, FinishReason, GenerationEvent, GenerationRequest, TokenLogprob
from runner.metrics import ServerMetrics
from runner.model_manager import ModelManager
from runner.profile import RouteProfile
from runner.request_log import request_record
from runner.sse import DONE_EVENT, error_event

log = logging.getLogger("runner.generation")

ChoiceEvent = tuple[int, GenerationEvent]


def disconnect_check_interval() -> int:
    """Tokens between two `is_disconnected()` checks on a stream (ALBATROSS_DISCONNECT_CHECK_INTERVAL)."""
    try:
        return max(1, int(os.environ.get("ALBATROSS_DISCONNECT_CHECK_INTERVAL", "64")))
    except ValueError:
        return 64


@dataclass(slots=True)
class ChoiceJob:
    index: int
    request: GenerationRequest


@dataclass(slots=True)
class ChoiceOutcome:
    index: int
    parts: list[str] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)


async def close_quietly(iterator: object) -> None:
    """Close an async iterator even inside a cancelled scope (a client that left cancels the
    stream's task), so that the backend hears the abort."""
    aclose = getattr(iterator, "aclose", None)
    if aclose is None:
        return
    with anyio.CancelScope(shield=True):
        try:
            await aclose()
        except Exception:
            log.exception("closing a generation failed")


DisconnectCheck = Callable[[], Awaitable[bool]]


async def _choice_events(manager: ModelManager, backend: AbstractRWKV, job: ChoiceJob, client_gone: DisconnectCheck) -> AsyncIterator[GenerationEvent]:
    async with manager.generation_turn(backend, client_gone):
        iterator = backend.async_generate(job.request)
        try:
            async for event in iterator:
                yield event
        finally:
            await close_quietly(iterator)


async def _in_turn(manager: ModelManager, backend: AbstractRWKV, jobs: Sequence[ChoiceJob], client_gone: DisconnectCheck) -> AsyncIterator[ChoiceEvent]:
    for job in jobs:
        events = _choice_events(manager, backend, job, client_gone)
        try:
            async for event in events:
                yield job.index, event
        finally:
            await close_quietly(events)


async def _at_once(manager: ModelManager, backend: AbstractRWKV, jobs: Sequence[ChoiceJob], client_gone: DisconnectCheck) -> AsyncIterator[ChoiceEvent]:
    queue: asyncio.Queue[tuple[int, GenerationEvent | BaseException | None]] = asyncio.Queue()

    async def pump(job: ChoiceJob) -> None:
        try:
            async for event in _choice_events(manager, backend, job, client_gone):
                queue.put_nowait((job.index, event))
        except Exception as exc:
            queue.put_nowait((job.index, exc))
        finally:
            queue.put_nowait((job.index, None))

    tasks = [asyncio.create_task(pump(job)) for job in jobs]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)


class GenerationDriver:
    """Iterates `(choice index, event)` of all jobs; `prime()` fetches the first event early so a
    backend's refusal (BackendError) can still become an HTTP status before a stream starts."""

    def __init__(
        self,
        request: Request,
        manager: ModelManager,
        backend: AbstractRWKV,
        jobs: Sequence[ChoiceJob],
        profile: RouteProfile,
        metrics: ServerMetrics,
        ticket: Ticket | None = None,
        transform: Callable[[int, GenerationEvent], GenerationEvent] | None = None,
    ) -> None:
        self.request = request
        self._transform = transform  # a route's rewrite of each event (e.g. runner.stop_echo)
        self.profile = profile
        self.metrics = metrics
        run = _at_once if backend.concurrent and len(jobs) > 1 else _in_turn
        self._events = run(manager, backend, jobs, request.is_disconnected)
        self._pending: ChoiceEvent | None = None
        self._started = time.perf_counter()
        self._last_token_at: float | None = None
        self._check_interval = disconnect_check_interval()
        self._tokens_since_check = 0
        self._checked_once = False
        self._awaiting_first = True
        self._record = request_record(request)  # the request's log line (runner.request_log)
        self._ticket = ticket or Ticket(None, 0)  # its place in runner.admission's count
        self._ticket.release_with(self)
        self._closed = False

    async def prime(self) -> None:
        self._pending = await self._next()

    def __aiter__(self) -> GenerationDriver:
        return self

    async def __anext__(self) -> ChoiceEvent:
        if self._pending is not None:
            primed, self._pending = self._pending, None
            return primed
        item = await self._next()
        if item is None:
            raise StopAsyncIteration
        return item

    async def _next(self) -> ChoiceEvent | None:
        waited_from = time.perf_counter()
        try:
            if self._awaiting_first:
                index, event = await self._first_event()
                self._awaiting_first = False
            else:
                index, event = await self._events.__anext__()
        except StopAsyncIteration:
            return None
        now = time.perf_counter()
        if self.profile.enabled:
            self.profile.completion_wait_ms += (now - waited_from) * 1000.0
            self.profile.tokens += len(event.token_ids)
        record = self._record
        if event.token_ids:
            if self._last_token_at is None:
                self.metrics.time_to_first_token.observe(now - self._started)
                if record is not None:
                    record.ttft_s = now - self._started
            else:
                self.metrics.inter_token.observe((now - self._last_token_at) / len(event.token_ids))
            self._last_token_at = now
        if event.finish_reason is not None:
            self.metrics.prompt_tokens += event.prompt_tokens
            self.metrics.completion_tokens += event.completion_tokens
            if record is not None:
                record.prompt_tokens += event.prompt_tokens
                record.completion_tokens += event.completion_tokens
                record.finish_reasons.append(event.finish_reason)
        if self._transform is not None:
            event = self._transform(index, event)
        return index, event

    async def _first_event(self) -> ChoiceEvent:
        """The first event, or ClientGone as soon as the client disconnects while the request still
        waits for it (queued for a slot, or prefilling): the read is cancelled then, which closes
        the events and aborts the request before it takes a slot. Nothing else reads the
        connection before the first event.

        The events are read in this task, so the request reaches the backend before this task
        yields. Read in a task of their own, they started only after every callback already in
        the loop's queue: in a burst of 960 streams no request reached the engine before all 960
        had been parsed (docs/performance.md, "Session 26"). The disconnect watcher runs beside
        and cancels this task instead."""
        task = asyncio.current_task()
        assert task is not None
        reading, left = True, False

        def on_gone(watch: asyncio.Future[None]) -> None:
            nonlocal left
            if reading and not watch.cancelled() and watch.exception() is None:
                left = True
                task.cancel()

        gone = asyncio.ensure_future(_disconnected(self.request))
        gone.add_done_callback(on_gone)
        try:
            return await self._events.__anext__()
        except asyncio.CancelledError:
            if left:  # our own cancel: the client left
                task.uncancel()
                raise ClientGone() from None
            raise
        finally:
            reading = False  # a disconnect from here on is for the stream to notice
            if not gone.done():
                gone.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(gone, return_exceptions=True)

    async def client_gone(self, new_tokens: int) -> bool:
        """Checks on the first event and then every `interval` tokens; cheap otherwise."""
        self._tokens_since_check += new_tokens
        if self._checked_once and self._tokens_since_check < self._check_interval:
            return False
        self._checked_once = True
        self._tokens_since_check = 0
        checked_from = time.perf_counter()
        gone = await self.request.is_disconnected()
        if self.profile.enabled:
            self.profile.disconnect_check_ms += (time.perf_counter() - checked_from) * 1000.0
        return gone

    async def aclose(self) -> None:
        if self.profile.enabled and not self._closed:
            self.profile.request_wall_ms += (time.perf_counter() - self._started) * 1000.0
        self._closed = True
        await close_quietly(self._events)
        self._ticket.release()


async def _disconnected(request: Request) -> None:
    """Returns once the client has disconnected (the body was read already: the only message the
    connection still has to give is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def raise_for_failure(event: GenerationEvent) -> None:
    if event.finish_reason == "error":
        raise BackendError(500, f"generation failed: {event.error or 'unknown error'}")
    if event.finish_reason == "abort":
        raise BackendError(503, "generation was aborted (the backend is shutting down or was switched)")


async def collect(driver: GenerationDriver, jobs: Sequence[ChoiceJob]) -> list[ChoiceOutcome]:
    """A non-stream reply: every choice's full text, finish reason and usage. Raises ClientGone."""
    outcomes = {job.index: ChoiceOutcome(job.index) for job in jobs}
    try:
        async for index, event in driver:
            outcome = outcomes[index]
            if event.text:
                outcome.parts.append(event.text)
            if event.logprobs:
                outcome.logprobs = (outcome.logprobs or []) + event.logprobs
            outcome.completion_tokens = max(outcome.completion_tokens, event.completion_tokens)
            outcome.prompt_tokens = max(outcome.prompt_tokens, event.prompt_tokens)
            if event.finish_reason is not None:
                raise_for_failure(event)
                outcome.finish_reason = event.finish_reason
            if await driver.client_gone(len(event.token_ids)):
                raise ClientGone()
    finally:
        await driver.aclose()
    if await driver.request.is_disconnected():
        raise ClientGone()
    return [outcomes[job.index] for job in jobs]


class StreamFormatter(Protocol):
    """Turns a route's events into SSE bytes (OpenAI chunks, native chunks, ...)."""

    def opening(self) -> list[bytes]: ...

    def event(self, index: int, event: GenerationEvent) -> bytes | None: ...

    def closing(self) -> list[bytes]: ...


async def stream_events(driver: GenerationDriver, formatter: StreamFormatter) -> AsyncIterator[bytes]:
    """The body of an SSE reply; errors after the start become an error event, then [DONE]."""
    profile = driver.profile
    profiling = profile.enabled
    if profiling:
        profile.stream_requests += 1
    try:
        for opening in formatter.opening():
            yield opening
        async for index, event in driver:
            if event.finish_reason is not None:
                raise_for_failure(event)
            built_from = time.perf_counter() if profiling else 0.0
            chunk = formatter.event(index, event)
            if chunk is not None:
                if profiling:
                    sent_from = time.perf_counter()
                    profile.json_dump_ms += (sent_from - built_from) * 1000.0
                    profile.stream_chunks += 1
                    profile.bytes += len(chunk)
                    yield chunk
                    profile.yield_resume_ms += (time.perf_counter() - sent_from) * 1000.0
                else:
                    yield chunk
            if await driver.client_gone(len(event.token_ids)):
                log.info("client left a stream; aborting its generation")
                return
        for closing in formatter.closing():
            yield closing
    except (ApiError, BackendError) as exc:
        status = exc.status_code
        yield error_event(status, exc.message)
    except Exception as exc:
        request_id, message = internal_error(exc, "stream")
        yield error_event(500, message, request_id)
    finally:
        await driver.aclose()
    yield DONE_EVENT
