"""Running a native request's rows on the backend and shaping the replies (rwkv_lightning API).

Each prompt is its own `GenerationRequest` (a `ChoiceJob`); the runner's `GenerationDriver` submits
them together to a concurrent backend, where they join the engine's shared batch, or in turn under
the completion lock otherwise, and closes every backend iterator (an abort) however the route ends.
The event loop only awaits: tokenising runs in a thread (runner/jobs.py), generation in the backend.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from runner.context import context
from runner.errors import ApiError, internal_error
from runner.generation import ChoiceJob, ChoiceOutcome, GenerationDriver, collect, stream_events
from runner.interface import BackendError, FinishReason, GenerationEvent, SamplingParams, StateRef
from runner.jobs import build_jobs, check_item_count, check_max_tokens, encode_prompts
from runner.sse import DONE_EVENT, error_event, event_bytes, sse_response

BATCH_OBJECT = "chat.completion"
CHUNK_OBJECT = "chat.completion.chunk"


def usage(outcomes: Sequence[ChoiceOutcome]) -> dict[str, int]:
    prompt = sum(o.prompt_tokens for o in outcomes)
    completion = sum(o.completion_tokens for o in outcomes)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def batch_reply(response_id: str, model: str, outcomes: Sequence[ChoiceOutcome], obj: str = BATCH_OBJECT) -> dict[str, Any]:
    """One choice per prompt, in order, each with its own finish reason."""
    choices = [
        {"index": o.index, "message": {"role": "assistant", "content": o.text}, "finish_reason": o.finish_reason}
        for o in outcomes
    ]
    return {"id": response_id, "object": obj, "model": model, "choices": choices, "usage": usage(outcomes)}


class NativeStreamFormatter:
    """Native SSE chunks `{"object": "chat.completion.chunk", "choices": [{"index", "delta":
    {"content"}, "finish_reason"}]}`: a row is sent once it has `chunk_size` new tokens with text,
    and when it finishes; a chunk holds only that row (only rows with news)."""

    def __init__(self, rows: int, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.unsent = [""] * rows
        self.flushed_tokens = [0] * rows
        self.finish_reasons: list[FinishReason | None] = [None] * rows

    def opening(self) -> list[bytes]:
        return []

    def event(self, index: int, event: GenerationEvent) -> bytes | None:
        if event.text:
            self.unsent[index] += event.text
        finish = event.finish_reason
        if finish is None:
            if not self.unsent[index] or event.completion_tokens - self.flushed_tokens[index] < self.chunk_size:
                return None
        else:
            self.finish_reasons[index] = finish
        text, self.unsent[index] = self.unsent[index], ""
        self.flushed_tokens[index] = event.completion_tokens
        return event_bytes({"object": CHUNK_OBJECT, "choices": [{"index": index, "delta": {"content": text}, "finish_reason": finish}]})

    def closing(self) -> list[bytes]:
        return []

    @property
    def completed(self) -> bool:
        """Every row finished normally (the driver turns error and abort into an error event)."""
        return all(reason in ("stop", "length") for reason in self.finish_reasons)


async def with_trailer(stream: AsyncIterator[bytes], trailer: Callable[[], Awaitable[bytes | None]]) -> AsyncIterator[bytes]:
    """Passes `stream` through and, just before its `[DONE]`, sends `await trailer()` (if not None)."""
    try:
        async for chunk in stream:
            if chunk == DONE_EVENT:
                extra = await trailer()
                if extra is not None:
                    yield extra
            yield chunk
    finally:
        close = getattr(stream, "aclose", None)
        if close is not None:
            await close()


# -> extra fields for the reply, once every row completed normally.
AfterSuccess = Callable[[], Awaitable[dict[str, Any] | None]]


@dataclass(frozen=True, slots=True)
class NativeSpec:
    """A native request, ready to run: prompts (verbatim), sampling, and how to answer."""

    prompts: Sequence[str]
    sampling: SamplingParams
    model: str
    response_id: str
    stream: bool
    chunk_size: int
    field_name: str = "contents"
    state: StateRef | None = None
    obj: str = BATCH_OBJECT


async def run_native(
    request: Request,
    spec: NativeSpec,
    after_success: AfterSuccess | None = None,
    stream_trailer: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    on_finish: Callable[[], None] | None = None,
) -> Response:
    """Runs every prompt as its own generation and answers in the native shapes.

    `after_success` runs once all rows ended with stop/length (state routes: wait for the saved
    state to reach disk, number the dialogue node); its fields join the non-stream reply, and on a
    stream `stream_trailer(fields)` becomes one event before `[DONE]`. `on_finish` runs exactly once
    when the request is over, whichever way (releases a session reservation)."""
    ctx = context(request)
    finish_guard = _Once(on_finish)
    try:
        driver, jobs = await _prepare(request, spec)
        if spec.stream:
            try:
                await driver.prime()  # a refusal (unknown state, shutting down) is still an HTTP status
            except BaseException:
                await driver.aclose()
                raise
            body = _native_stream(driver, NativeStreamFormatter(len(jobs), spec.chunk_size), after_success, stream_trailer, finish_guard)
            weakref.finalize(body, finish_guard)  # a stream whose body never ran still releases
            return sse_response(body)
        outcomes = await collect(driver, jobs)
        reply = batch_reply(spec.response_id, spec.model, outcomes, spec.obj)
        if after_success is not None and all(o.finish_reason in ("stop", "length") for o in outcomes):
            reply.update(await after_success() or {})
        finish_guard()
        return JSONResponse(reply)
    except (ApiError, BackendError) as error:
        ctx.metrics.count_error(error.status_code)
        finish_guard()
        raise
    except BaseException:
        finish_guard()
        raise


async def collect_native(request: Request, spec: NativeSpec) -> list[ChoiceOutcome]:
    """Every row's whole result, for routes with their own reply shape (translation)."""
    ctx = context(request)
    try:
        driver, jobs = await _prepare(request, spec)
        return await collect(driver, jobs)
    except (ApiError, BackendError) as error:
        ctx.metrics.count_error(error.status_code)
        raise


async def _prepare(request: Request, spec: NativeSpec) -> tuple[GenerationDriver, list[ChoiceJob]]:
    ctx = context(request)
    ctx.metrics.count_request(request.url.path)
    if ctx.profile.enabled:
        ctx.profile.requests += 1
    backend = ctx.manager.require_backend()
    check_item_count(len(spec.prompts), ctx.settings.max_batch_items, spec.field_name)
    check_max_tokens(spec.sampling.max_tokens, ctx.settings.max_tokens)
    ticket = ctx.admission.admit(len(spec.prompts), backend.generation_slots())  # 429 past the queue
    try:
        encoded = await encode_prompts(backend, spec.prompts, ctx.settings.max_prompt_tokens, spec.field_name, spec.state)
        # The native reply's id is fixed per route; the engine's request ids stay unique.
        jobs = build_jobs(encoded, spec.sampling, f"{spec.response_id}-{time.monotonic_ns():x}", spec.state)
        return GenerationDriver(request, ctx.manager, backend, jobs, ctx.profile, ctx.metrics, ticket), jobs
    except BaseException:
        ticket.release()  # the driver releases it from here on
        raise


async def _native_stream(
    driver: GenerationDriver,
    formatter: NativeStreamFormatter,
    after_success: AfterSuccess | None,
    stream_trailer: Callable[[dict[str, Any]], dict[str, Any]] | None,
    finish_guard: _Once,
) -> AsyncIterator[bytes]:
    async def trailer() -> bytes | None:
        if after_success is None or not formatter.completed:
            return None
        try:
            fields = await after_success() or {}
        except (ApiError, BackendError) as error:
            return error_event(error.status_code, error.message)
        except Exception as error:
            request_id, message = internal_error(error, "native stream trailer")
            return error_event(500, message, request_id)
        return event_bytes(stream_trailer(fields)) if stream_trailer is not None and fields else None

    try:
        async for chunk in with_trailer(stream_events(driver, formatter), trailer):
            yield chunk
    finally:
        finish_guard()


class _Once:
    """Calls `callback` the first time it is called, never again."""

    __slots__ = ("callback",)

    def __init__(self, callback: Callable[[], None] | None) -> None:
        self.callback = callback

    def __call__(self) -> None:
        callback, self.callback = self.callback, None
        if callback is not None:
            callback()
