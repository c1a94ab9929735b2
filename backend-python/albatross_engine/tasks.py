"""A request inside the engine (`EngineTask`) and the channels its events travel back on.

Events cross from a worker thread to the caller's event loop in batches: a worker collects one
step's events in an `EventOutbox` and delivers them with one `call_soon_threadsafe` per caller
loop, never one call per token.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from albatross_engine.state_store import PrefixHasher
from runner.interface import FinishReason, GenerationEvent, SamplingParams

if TYPE_CHECKING:
    from albatross.constraints import CompiledGrammar, TokenMatcher
    from albatross.detokenizer import TextStream
    from albatross_engine.initial_state import EngineInitialState

# A worker process's plain delta as it came through the pipe (process_boundary.py: text, token ids
# and counters, never final): the server hands it on unbuilt, and the caller's reader builds one
# event from however many have queued up (process_boundary.merge_items), not one object per token.
PackedDelta = tuple[Any, ...]
EventItem = Union[GenerationEvent, BaseException, PackedDelta]  # an exception ends the stream by being raised

_task_ids = itertools.count(1)


def merge_events(first: GenerationEvent, later: list[GenerationEvent]) -> GenerationEvent:
    """One event equal to `first` followed by `later` (deltas joined, counters from the last), so a
    caller that fell behind pays the per-event cost of the HTTP layer once, not once per token."""
    if not later:
        return first
    events = [first, *later]
    last = events[-1]
    logprobs = [entry for event in events for entry in (event.logprobs or ())]
    return GenerationEvent(
        text="".join(event.text for event in events),
        token_ids=[token for event in events for token in event.token_ids],
        finish_reason=last.finish_reason,
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
        cached_prompt_tokens=max(event.cached_prompt_tokens for event in events),
        error=last.error,
        logprobs=logprobs if any(event.logprobs is not None for event in events) else None,
    )


class AsyncChannel:
    """Events for a caller on an asyncio loop; only that loop calls `put` and `next_items`.

    A list and one waiter future rather than an `asyncio.Queue`: with hundreds of streams, every
    step puts one event per stream on the caller's loop, and the queue's bookkeeping (its getter
    deque, `join()` counters and loop checks) was a measurable part of the host's time per step,
    which bounds the step rate (bench/host_overhead.py)."""

    __slots__ = ("loop", "_items", "_waiter", "closed")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: list[EventItem] = []
        self._waiter: asyncio.Future[None] | None = None
        self.closed = False  # the caller's loop is gone: nobody reads this channel any more

    def put(self, item: EventItem) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # a cancelled reader leaves a done future behind
                waiter.set_result(None)

    def take(self) -> list[EventItem]:
        """Everything queued now, possibly nothing."""
        items, self._items = self._items, []
        return items

    async def next_items(self) -> list[EventItem]:
        """Everything queued, waiting for at least one item."""
        while not self._items:
            waiter = self._waiter = self.loop.create_future()
            await waiter
        return self.take()


class SyncChannel:
    """Events for a synchronous caller blocked on a thread-safe queue."""

    __slots__ = ("queue", "closed")

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[EventItem] = queue.SimpleQueue()
        self.closed = False


class RemoteChannel:
    """Events for a caller in another process: a worker process's outbox sends them through its
    pipe (worker_process_main.py), and the server process hands them to the caller's own channel."""

    __slots__ = ("task_id", "closed")

    def __init__(self, task_id: int) -> None:
        self.task_id = task_id
        self.closed = False


EventChannel = Union[AsyncChannel, SyncChannel, RemoteChannel]


def _deliver(batch: list[tuple[AsyncChannel, EventItem]]) -> None:
    for channel, item in batch:
        channel.put(item)


class EventOutbox:
    """Collects events during a step; `flush()` hands them over, one callback per caller loop."""

    __slots__ = ("_by_loop", "_channels_by_loop")

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, list[tuple[AsyncChannel, EventItem]]] = {}
        self._channels_by_loop: dict[asyncio.AbstractEventLoop, list[AsyncChannel]] = {}

    def add(self, channel: EventChannel, item: EventItem) -> None:
        if channel.closed:
            return
        if not isinstance(channel, AsyncChannel):
            if not isinstance(channel, SyncChannel):
                raise TypeError(f"{type(channel).__name__} needs the outbox of a worker process")
            channel.queue.put(item)
            return
        batch = self._by_loop.get(channel.loop)
        if batch is None:
            batch = self._by_loop[channel.loop] = []
            self._channels_by_loop[channel.loop] = []
        batch.append((channel, item))
        self._channels_by_loop[channel.loop].append(channel)

    def flush(self) -> bool:
        """Deliver everything; True when some caller's loop turned out to be closed (its channels
        are marked `closed`, so the worker aborts their tasks)."""
        closed = False
        for loop, batch in self._by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:
                closed = True
                for channel in self._channels_by_loop[loop]:
                    channel.closed = True
        self._by_loop.clear()
        self._channels_by_loop.clear()
        return closed


@dataclass(slots=True, eq=False)
class EngineTask:
    """One request's progress. Fields up to `worker_index` are fixed at submit (the core and the
    worker set `abort_requested` and `worker_index` from the caller's thread); the rest belong to
    the worker thread that owns the task."""

    prompt_tokens: list[int]
    sampling: SamplingParams
    seed: int  # the request's seed, or one drawn at submit
    channel: EventChannel
    request_id: str = ""
    load_key: str | None = None  # start from this saved state
    save_key: str | None = None  # save the final state of a completed run here
    use_prefix_cache: bool = False  # resume from / checkpoint prompt prefixes (zero-state prompts only)
    # A state file's state, the start of a task with no saved state and no cached prefix (None: zeros).
    initial_state: EngineInitialState | None = None
    penalized_prompt_ids: list[int] = field(default_factory=list)  # counted in the penalties from the start
    grammar: CompiledGrammar | None = None  # the output constraint, compiled by the adapter
    task_id: int = field(default_factory=lambda: next(_task_ids))
    abort_requested: bool = False
    worker_index: int = -1

    # Launch side: what the steps issued so far have done (the device may still be running them).
    slot: int = -1
    admitted_step: int = 0  # the scheduler's step count at admission: ages the task's prefill order
    prompt_pos: int = 0  # prompt tokens fed (or skipped thanks to a cached state)
    cached_prompt_tokens: int = 0
    sampled: int = 0  # tokens sampled by issued steps
    fed: int = 0  # generated tokens fed back as model inputs by issued steps
    last_sample_row: int = -1  # row of this task's newest sample in the last issued step's ids
    seed32: int = 0
    prefix_hasher: PrefixHasher | None = None  # keys of the prompt's prefix checkpoints
    # n samples of one prompt share its prefill: a follower waits while its leader feeds all but the
    # last prompt token, then starts from a copy of the leader's state.
    leader: EngineTask | None = None
    followers: list[EngineTask] = field(default_factory=list)

    # Host side: what has been processed and sent to the caller.
    completion_tokens: int = 0
    finish_reason: FinishReason | None = None
    final_feed_pending: bool = False  # finished, but its last token must be fed before the state is saved
    held_event: GenerationEvent | None = None  # the final event, sent once the state is saved
    text_stream: TextStream | None = None
    # The grammar's position: made at admission, advanced by each processed token, freed when the
    # task ends (`free_matcher`), so that a waiting task holds none and an ended one none either.
    matcher: TokenMatcher | None = None

    def __post_init__(self) -> None:
        if self.sampling.max_tokens > 0 and not self.prompt_tokens:
            raise ValueError("generating needs at least one prompt token")
        if self.use_prefix_cache and self.load_key is not None:
            raise ValueError("prefix caching applies to prompts fed from a zero state, not to a loaded state")

    @property
    def initial_state_id(self) -> str | None:
        return None if self.initial_state is None else self.initial_state.state_id

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_tokens)

    @property
    def prefilling(self) -> bool:
        return self.prompt_pos < len(self.prompt_tokens)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def wants_sample(self) -> bool:
        """Whether an issued step may still sample a token for this task."""
        return self.finish_reason is None and self.sampled < self.sampling.max_tokens

    def free_matcher(self) -> None:
        if self.matcher is not None:
            self.matcher.free()
            self.matcher = None

    def event(self, text: str = "", token_ids: list[int] | None = None) -> GenerationEvent:
        """An event of this task's output so far (its counters as they are now)."""
        return GenerationEvent(
            text=text,
            token_ids=token_ids if token_ids is not None else [],
            prompt_tokens=self.prompt_len,
            completion_tokens=self.completion_tokens,
            cached_prompt_tokens=self.cached_prompt_tokens,
        )

    def error_event(self, error: BaseException) -> GenerationEvent:
        event = self.event()
        event.finish_reason = "error"
        event.error = f"{type(error).__name__}: {error}"
        return event
