"""albatross_engine/finishing.py: how tasks end, what each end sends, and that slots come back."""

from __future__ import annotations

from albatross_engine.finishing import Finisher, fail_all
from albatross_engine.metrics import WorkerMetrics
from albatross_engine.saved_states import SavedStates
from albatross_engine.scheduler import Row, RowKind, Scheduler
from albatross_engine.state_store import DictStateStore, PromptEndIndex
from albatross_engine.tasks import EngineTask, EventItem, EventOutbox, SyncChannel
from engine_helpers import RecordingDeviceStep
from runner.interface import BackendError, GenerationEvent, SamplingParams


class Harness:
    def __init__(self, batch_size: int = 2, store: DictStateStore | None = None) -> None:
        self.scheduler = Scheduler(batch_size)
        self.outbox = EventOutbox()
        self.metrics = WorkerMetrics()
        self.device = RecordingDeviceStep()
        self.done = 0
        saved = SavedStates(self.device, self.metrics, PromptEndIndex(), store)  # type: ignore[arg-type]
        self.finisher = Finisher(self.scheduler, self.outbox, self.metrics, saved, self.device, self.count_done)  # type: ignore[arg-type]

    def count_done(self) -> None:
        self.done += 1

    def admitted(self, save_key: str | None = None) -> EngineTask:
        task = EngineTask([1, 2, 3], SamplingParams(max_tokens=4), seed=1, channel=SyncChannel(), save_key=save_key)
        self.scheduler.add(task)
        assert self.scheduler.admit() == [task]
        return task


def sent(task: EngineTask) -> list[EventItem]:
    assert isinstance(task.channel, SyncChannel)
    items = []
    while not task.channel.queue.empty():
        items.append(task.channel.queue.get())
    return items


def test_a_finished_task_sends_its_last_event_and_frees_its_slot() -> None:
    harness = Harness()
    task = harness.admitted()
    task.completion_tokens = 2
    harness.finisher.finish(task, "length", task.event("tail", [7]))
    [event] = sent(task)
    assert isinstance(event, GenerationEvent)
    assert (event.text, event.token_ids, event.finish_reason, event.completion_tokens) == ("tail", [7], "length", 2)
    assert task.finish_reason == "length" and harness.scheduler.free_slot_count == 2 and harness.done == 1
    assert harness.metrics.snapshot().requests_finished == {"length": 1}


def test_a_turn_to_save_holds_its_event_until_the_last_token_is_fed_and_saved() -> None:
    store = DictStateStore()
    harness = Harness(store=store)
    task = harness.admitted(save_key="chat")
    task.completion_tokens, task.fed = 3, 2  # the third token has not been fed yet
    harness.finisher.finish(task, "stop", task.event("x", [5]))
    assert sent(task) == [] and task.final_feed_pending, "nothing goes out before the state is saved"
    assert harness.scheduler.free_slot_count == 1, "the slot stays until the last token is fed"
    harness.device.states[task.slot] = "fed everything"
    harness.finisher.save_final(task)
    [event] = sent(task)
    assert isinstance(event, GenerationEvent) and event.finish_reason == "stop" and event.text == "x"
    assert store.get("chat") == "fed everything" and harness.scheduler.free_slot_count == 2 and harness.done == 1


def test_a_turn_whose_tokens_are_all_fed_saves_at_once() -> None:
    store = DictStateStore()
    harness = Harness(store=store)
    task = harness.admitted(save_key="chat")
    task.completion_tokens = task.fed = 1
    harness.finisher.finish(task, "length", task.event())
    assert store.contains("chat") and [e.finish_reason for e in sent(task)] == ["length"]  # type: ignore[union-attr]


def test_a_failed_final_save_turns_the_final_event_into_an_error() -> None:
    harness = Harness(store=None)
    task = harness.admitted(save_key="chat")
    harness.finisher.finish(task, "stop", task.event())
    [event] = sent(task)
    assert isinstance(event, GenerationEvent) and event.finish_reason == "error" and "no state cache" in (event.error or "")
    assert harness.scheduler.free_slot_count == 2


def test_aborting_a_waiting_task_takes_it_out_of_the_queue() -> None:
    harness = Harness(batch_size=1)
    harness.admitted()
    waiting = EngineTask([1], SamplingParams(), seed=1, channel=SyncChannel())
    harness.scheduler.add(waiting)
    harness.finisher.abort(waiting)
    assert [e.finish_reason for e in sent(waiting)] == ["abort"]  # type: ignore[union-attr]
    assert not harness.scheduler.waiting and harness.done == 1


def test_aborting_a_running_task_frees_its_slot_and_a_second_abort_does_nothing() -> None:
    harness = Harness()
    task = harness.admitted()
    harness.finisher.abort(task)
    harness.finisher.abort(task)
    assert [e.finish_reason for e in sent(task)] == ["abort"]  # type: ignore[union-attr]
    assert harness.scheduler.free_slot_count == 2 and harness.done == 1
    assert harness.metrics.snapshot().requests_finished == {"abort": 1}


def test_a_failure_sends_an_error_event_or_the_backend_error_itself_once() -> None:
    harness = Harness()
    plain, refused = harness.admitted(), harness.admitted()
    harness.finisher.fail(plain, ValueError("bad token"))
    harness.finisher.fail(refused, BackendError(404, "state 'x' not found"))
    harness.finisher.fail(plain, ValueError("again"))
    [error_event] = sent(plain)
    [raised] = sent(refused)
    assert isinstance(error_event, GenerationEvent) and error_event.error == "ValueError: bad token"
    assert isinstance(raised, BackendError) and raised.status_code == 404
    assert harness.scheduler.free_slot_count == 2 and harness.done == 2


def test_a_failed_step_fails_its_tasks_and_resets_their_slots_once() -> None:
    harness = Harness()
    first, second = harness.admitted(), harness.admitted()
    rows = [Row(first, first.slot, RowKind.DECODE), Row(second, second.slot, RowKind.PREFILL), Row(first, first.slot, RowKind.FEED)]
    harness.finisher.fail_rows(rows, RuntimeError("device lost"))
    assert harness.device.resets == [[0, 1]]
    assert first.finish_reason == second.finish_reason == "error" and harness.done == 2


def test_aborting_closed_channels_ends_only_their_tasks() -> None:
    harness = Harness()
    gone, kept = harness.admitted(), harness.admitted()
    gone.channel.closed = True
    harness.finisher.abort_closed_channels()
    assert gone.finish_reason == "abort" and kept.finish_reason is None and harness.scheduler.free_slot_count == 1


def test_a_stopping_worker_fails_queued_waiting_and_running_tasks_and_frees_every_slot() -> None:
    harness = Harness(batch_size=1)
    running = harness.admitted()
    waiting = EngineTask([1], SamplingParams(), seed=1, channel=SyncChannel())
    queued = EngineTask([1], SamplingParams(), seed=1, channel=SyncChannel())
    harness.scheduler.add(waiting)
    error = BackendError(503, "shutting down")
    fail_all(harness.scheduler, harness.outbox, [queued, *harness.scheduler.waiting, running], error)
    assert all(sent(task) == [error] for task in (queued, waiting, running))
    assert harness.scheduler.free_slot_count == 1 and not harness.scheduler.waiting
