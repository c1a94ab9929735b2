"""How a worker's tasks end: finished (stop, length), aborted, or failed, and what each one sends.

Every end frees the task's grammar matcher at once (including `fail_all`, a stopping worker's
path), and frees its slot at once (the next step can admit another) and is counted once,
except a completed turn with a `save_key`: its slot is kept until the last generated token has
been fed, then the state is saved and only then does the final event go out, so a client told
"stop" can rely on the saved state. A failed save turns the final event into an error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from albatross.stopping import StopReason
from albatross_engine.metrics import WorkerMetrics
from albatross_engine.saved_states import SavedStates
from albatross_engine.scheduler import Row, Scheduler
from albatross_engine.tasks import EngineTask, EventOutbox
from runner.interface import BackendError, GenerationEvent

if TYPE_CHECKING:
    from albatross_engine.device_step import DeviceStep

logger = logging.getLogger(__name__)


class Finisher:
    def __init__(
        self,
        scheduler: Scheduler,
        outbox: EventOutbox,
        metrics: WorkerMetrics,
        saved_states: SavedStates,
        device_step: DeviceStep,
        on_done: Callable[[], None],
    ) -> None:
        self.scheduler = scheduler
        self.outbox = outbox
        self.metrics = metrics
        self.saved_states = saved_states
        self.device_step = device_step
        self.on_done = on_done  # called once per task that leaves the worker

    def finish(self, task: EngineTask, reason: StopReason, event: GenerationEvent) -> None:
        """`event` is the task's last."""
        task.finish_reason = event.finish_reason = reason
        task.free_matcher()
        self.metrics.record_finish(reason)
        if task.save_key is not None:
            task.held_event = event
            if task.fed >= task.completion_tokens:
                self.save_final(task)
            else:
                task.final_feed_pending = True  # the next step feeds the last token, then saves
            return
        self.outbox.add(task.channel, event)
        self._release(task)

    def save_final(self, task: EngineTask) -> None:
        """The final state goes to the store, then the held final event goes out."""
        event = task.held_event or task.event()
        task.held_event = None
        try:
            self.saved_states.save_final(task)
        except Exception as error:
            logger.exception("saving state %r failed", task.save_key)
            event = task.error_event(error)
        self.outbox.add(task.channel, event)
        self._release(task)

    def abort(self, task: EngineTask) -> None:
        if task.finished:
            return
        task.free_matcher()
        if self.scheduler.remove_waiting(task):
            task.finish_reason = "abort"
            self.outbox.add(task.channel, GenerationEvent(finish_reason="abort", prompt_tokens=task.prompt_len))
            self.metrics.record_finish("abort")
            self.on_done()
        elif task.task_id in self.scheduler.running:
            task.finish_reason = "abort"
            event = task.event()
            event.finish_reason = "abort"
            self.outbox.add(task.channel, event)
            self.metrics.record_finish("abort")
            self._release(task)

    def abort_closed_channels(self) -> None:
        for task in [*self.scheduler.waiting, *self.scheduler.running.values()]:
            if task.channel.closed:
                self.abort(task)

    def fail(self, task: EngineTask, error: BaseException) -> None:
        """End one task with an error; the others carry on."""
        holds_slot = task.task_id in self.scheduler.running
        if not holds_slot and not self.scheduler.remove_waiting(task):
            return  # already finished and released
        task.finish_reason = "error"
        task.free_matcher()
        task.final_feed_pending = False
        task.held_event = None
        self.outbox.add(task.channel, error if isinstance(error, BackendError) else task.error_event(error))
        self.metrics.record_finish("error")
        if holds_slot:
            self.scheduler.release(task)
        self.on_done()

    def fail_rows(self, rows: list[Row], error: BaseException) -> None:
        """A step failed: fail its tasks and reset their slots (a failing reset kills the worker)."""
        slots = sorted({row.slot for row in rows})
        for row in rows:
            self.fail(row.task, error)
        if slots:
            self.device_step.reset_slots(slots)

    def _release(self, task: EngineTask) -> None:
        self.scheduler.release(task)
        self.on_done()


def fail_all(scheduler: Scheduler, outbox: EventOutbox, tasks: list[EngineTask], error: BackendError) -> None:
    """A worker that stops: every task it holds or has queued gets `error`, and no slot stays taken.
    Needs no device (the worker may have lost it), so it is not a Finisher method."""
    scheduler.waiting.clear()
    for task in tasks:
        if task.task_id in scheduler.running:
            scheduler.release(task)
        task.free_matcher()
        task.finish_reason = "error"
        outbox.add(task.channel, error)
    outbox.flush()
