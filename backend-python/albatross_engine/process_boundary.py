"""What crosses between the server process and a worker process, and how it is packed.

One duplex pipe per worker process (multiprocessing, spawn start method). Every message is one
pickled tuple whose first item names its kind. Per step a worker process sends ONE message: the
step's events as plain tuples (ints, strings, lists), because pickling the event dataclasses cost
about ten times as much (docs/performance.md, "Worker processes"). The server sends tasks and aborts
as they come. States cross as `SlotState.to_bytes()` when a session turn loads or saves one (and
prefix states when the worker process keeps no cache of its own), never per step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Union

from albatross_engine.initial_state import EngineInitialState
from albatross_engine.tasks import EngineTask, EventChannel, EventItem, PackedDelta, merge_events
from runner.interface import BackendError, GenerationEvent, TokenLogprob

if TYPE_CHECKING:
    from albatross.constraints import CompiledGrammar, ConstraintCompiler
    from albatross.tokenizer import Tokenizer

# server -> worker process
SUBMIT = "submit"  # (SUBMIT, TaskSpec)
INITIAL_STATE = "initial_state"  # (INITIAL_STATE, state id, SlotState bytes): once per process, before the first task that starts from it
ABORT = "abort"  # (ABORT, task_id)
STOP = "stop"  # (STOP,): fail what is left with 503 and exit
QUERY = "query"  # (QUERY, request_id, what): one of QUERIES
STORE_REPLY = "store_reply"  # (STORE_REPLY, request_id, result): the answer to a STORE_GET or STORE_CONTAINS
# worker process -> server
READY = "ready"  # (READY, model fingerprint, device, overlap, ModelConfig, memory plan status or None)
LOAD_FAILED = "load_failed"  # (LOAD_FAILED, message)
EVENTS = "events"  # (EVENTS, [packed event, ...]): one step's events
STORE_GET = "store_get"  # (STORE_GET, request_id, key) -> SlotState bytes or None
STORE_CONTAINS = "store_contains"  # (STORE_CONTAINS, request_id, key) -> bool
STORE_PUT = "store_put"  # (STORE_PUT, key, SlotState bytes): no reply; ordered before the events after it
QUERY_REPLY = "query_reply"  # (QUERY_REPLY, request_id, result)
DIED = "died"  # (DIED, message): the worker's step loop failed; the process exits next

METRICS = "metrics"  # -> MetricsSnapshot
DEVICE_REPORT = "device_report"  # -> dict (Worker.device_report)
PREFIX_CACHE_STATS = "prefix_cache_stats"  # -> dict, or None without a cache of its own
PREFILL_BUDGET_FIT = "prefill_budget_fit"  # -> dict (Worker.prefill_budget_fit)
QUERIES = (METRICS, DEVICE_REPORT, PREFIX_CACHE_STATS, PREFILL_BUDGET_FIT)

Message = tuple[object, ...]
# (task_id, text, token_ids, completion_tokens, cached_prompt_tokens, finish_reason, error, logprobs)
# or, for a BackendError: (task_id, status_code, message)
PackedItem = tuple[object, ...]
PackedLogprob = tuple[int, str, float, list[tuple[int, str, float]]]


# The fields of EngineTask fixed at submit (those before `abort_requested`), less its channel: a
# field added there crosses the boundary without a change here, unless its value is a host object
# that must not ride along with every task (or cannot be pickled): those cross as a reference,
# below, and the worker process rebuilds them (TaskContext).
_SUBMIT_FIELDS = tuple(f.name for f in fields(EngineTask)[: [f.name for f in fields(EngineTask)].index("abort_requested")] if f.name != "channel")

@dataclass(slots=True)
class TaskContext:
    """What a worker process holds to rebuild its tasks' host objects from their references."""

    tokenizer: Tokenizer
    initial_states: dict[str, EngineInitialState] = field(default_factory=dict)  # by state id
    _grammars: ConstraintCompiler | None = None  # the vocabulary's trie and encoder: ~1 s to build
    _grammars_lock: threading.Lock = field(default_factory=threading.Lock)

    def compiler(self) -> ConstraintCompiler:
        """This process's grammar compiler, built at the first call (`warm_in_background` makes
        that call at the worker's start, so that the first constrained request, and every message
        the pipe reader would take meanwhile, does not wait for it)."""
        with self._grammars_lock:
            if self._grammars is None:
                from albatross.constraints import ConstraintCompiler

                self._grammars = ConstraintCompiler(self.tokenizer)
            return self._grammars

    def warm_in_background(self) -> threading.Thread:
        thread = threading.Thread(target=self.compiler, name="grammar-vocabulary", daemon=True)
        thread.start()
        return thread

    def grammar(self, text: str) -> CompiledGrammar:
        return self.compiler().compile(text)



# Field -> (its reference, how the worker process rebuilds it); None crosses as None. A state
# file's initial state crosses once per process (INITIAL_STATE) and a task names it by its id. An
# output grammar crosses as its text: the compiled form holds llguidance objects (not picklable),
# and the matchers made from it live with the worker, so the worker process compiles the text again
# with its own compiler (cached by text); the adapter's compile is the 400 check.
_BY_REFERENCE: dict[str, tuple[Callable[[Any], Any], Callable[[TaskContext, Any], Any]]] = {
    "initial_state": (lambda state: state.state_id, lambda context, state_id: context.initial_states[state_id]),
    "grammar": (lambda grammar: grammar.text, TaskContext.grammar),
}


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """What a worker process needs of an `EngineTask`: everything fixed at submit."""

    task_id: int
    values: dict[str, Any]  # _SUBMIT_FIELDS -> value, or its reference (_BY_REFERENCE)


def task_spec(task: EngineTask) -> TaskSpec:
    values = {name: getattr(task, name) for name in _SUBMIT_FIELDS}
    for name, (reference, _) in _BY_REFERENCE.items():
        if values.get(name) is not None:
            values[name] = reference(values[name])
    return TaskSpec(task.task_id, values)


def task_from_spec(spec: TaskSpec, channel: EventChannel, context: TaskContext) -> EngineTask:
    """The worker process's copy of the task; it keeps the server's task id, which its events name."""
    values = dict(spec.values)
    for name, (_, rebuild) in _BY_REFERENCE.items():
        if values.get(name) is not None:
            values[name] = rebuild(context, values[name])
    return EngineTask(channel=channel, **values)


def pack_item(task_id: int, item: EventItem) -> PackedItem:
    if isinstance(item, BackendError):
        return (task_id, item.status_code, item.message)
    if not isinstance(item, GenerationEvent):
        raise TypeError(f"a worker sends events and BackendErrors, not {type(item).__name__}")  # Finisher turns other errors into events
    logprobs = None if item.logprobs is None else [(e.token_id, e.text, e.logprob, e.top) for e in item.logprobs]
    return (task_id, item.text, item.token_ids, item.completion_tokens, item.cached_prompt_tokens, item.finish_reason, item.error, logprobs)


def unpack_item(packed: PackedItem, prompt_tokens: int) -> EventItem:
    """The event (or error) of `pack_item`; `prompt_tokens` is the task's, known to the server."""
    if len(packed) == 3:
        _, status, message = packed
        return BackendError(int(status), str(message))  # type: ignore[call-overload]
    _, text, token_ids, completion_tokens, cached, finish_reason, error, logprobs = packed
    return GenerationEvent(
        text=text,  # type: ignore[arg-type]
        token_ids=token_ids,  # type: ignore[arg-type]
        finish_reason=finish_reason,  # type: ignore[arg-type]
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,  # type: ignore[arg-type]
        cached_prompt_tokens=cached,  # type: ignore[arg-type]
        error=error,  # type: ignore[arg-type]
        logprobs=None if logprobs is None else [TokenLogprob(*entry) for entry in logprobs],  # type: ignore[attr-defined]
    )


def is_final(item: EventItem) -> bool:
    """The last item a task's caller receives."""
    if isinstance(item, tuple):
        return len(item) == 3 or item[5] is not None
    return not isinstance(item, GenerationEvent) or item.finish_reason is not None


def is_plain_delta(packed: PackedItem) -> bool:
    """A delta without finish, error or logprobs: the server hands these to callers unbuilt."""
    return len(packed) == 8 and packed[5] is None and packed[7] is None


def merge_items(first: GenerationEvent | PackedDelta, later: list[GenerationEvent | PackedDelta], prompt_tokens: int) -> GenerationEvent:
    """One event equal to `first` followed by `later`, where any of them may be a plain delta
    straight from a worker process's pipe (counters from the last, as tasks.merge_events)."""
    if not later and not isinstance(first, tuple):
        return first
    items = [first, *later]
    if all(isinstance(item, tuple) for item in items):  # deltas only: the common case under load
        last = items[-1]
        return GenerationEvent(
            "".join(item[1] for item in items),  # type: ignore[index]
            [token for item in items for token in item[2]],  # type: ignore[index]
            None, prompt_tokens, last[3], max(item[4] for item in items),  # type: ignore[index]
        )  # fmt: skip
    events = [item if isinstance(item, GenerationEvent) else unpack_item(item, prompt_tokens) for item in items]
    return merge_events(events[0], events[1:])  # type: ignore[arg-type]


StoreResult = Union[bytes, bool, None]
