"""The host work of an issued step: its sampled ids become each task's next event.

Wait for the ids (the one sync per step); advance the grammar matchers of the constrained rows,
all at once, and read what the events need from them (the worker then starts the next step's mask
fill on other threads); then per sampling row, in plan order: count the token (a token its grammar refused
fails the task), decide with `albatross.stopping` whether it ends the task (a grammar with nothing
left to match ends it with "stop"), attach logprobs when asked, and queue the event (or finish the
task). A row of a task that already finished (aborted, failed, or done one step earlier under
overlap) is skipped: its sample is dropped and not counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from albatross.constraints import advance_all
from albatross.sampler import TopLogprobs
from albatross.stopping import accept_token
from albatross.tokenizer import Tokenizer
from albatross_engine.finishing import Finisher
from albatross_engine.metrics import WorkerMetrics
from albatross_engine.scheduler import RowKind
from albatross_engine.tasks import EngineTask, EventOutbox
from runner.interface import BackendError, TokenLogprob, output_grammar_failed

if TYPE_CHECKING:
    from albatross_engine.device_step import DeviceStep, IssuedStep

logger = logging.getLogger(__name__)


class ResultProcessor:
    def __init__(
        self, device_step: DeviceStep, finisher: Finisher, outbox: EventOutbox, metrics: WorkerMetrics, tokenizer: Tokenizer
    ) -> None:
        self.device_step = device_step
        self.finisher = finisher
        self.outbox = outbox
        self.metrics = metrics
        self.tokenizer = tokenizer

    def process(self, issued: IssuedStep, advanced: Callable[[], None] | None = None) -> None:
        """`advanced` runs once the matchers have moved and been read (the worker starts the next
        step's mask fill there, on other threads, while this one queues the events): from then on
        nothing here touches a matcher."""
        try:
            ids = issued.token_ids()
        except Exception as error:  # a device error surfaces at the sync
            logger.exception("a step failed on the device")
            self.finisher.fail_rows(issued.plan.rows, error)
            self.device_step.forget_last_step(issued)
            return
        produced = 0
        refused, complete = self._advance_matchers(issued, ids)
        if advanced is not None:
            advanced()
        for row in issued.plan.rows:
            task = row.task
            if task.finished:
                continue
            try:
                if row.samples:
                    produced += 1
                    self._accept(task, ids[row.sample_row], issued, row.sample_row, refused.get(task.task_id), task.task_id in complete)
                elif row.kind is RowKind.PREFILL and row.stop == task.prompt_len and task.sampling.max_tokens == 0:
                    self.finisher.finish(task, "length", task.event())
            except BackendError as error:  # the request's own doing (its grammar failed): no traceback
                logger.warning("request %s failed: %s", task.request_id, error.message)
                self.finisher.fail(task, error)
            except Exception as error:
                logger.exception("request %s failed", task.request_id)
                self.finisher.fail(task, error)
        self.metrics.add_generated(produced)

    @staticmethod
    def _advance_matchers(issued: IssuedStep, ids: list[int]) -> tuple[dict[int, str], set[int]]:
        """Every live matcher of the step advanced by its row's id, all at once (GIL released);
        returns the tasks whose grammar refused its token (by task id, with the matcher's error)
        and those whose grammar is now complete."""
        rows = [row for row in issued.plan.rows if row.samples and row.task.matcher is not None and not row.task.finished]
        if not rows:
            return {}, set()
        matchers = [row.task.matcher for row in rows]
        accepted = advance_all([(matcher, ids[row.sample_row]) for row, matcher in zip(rows, matchers) if matcher is not None])
        refused: dict[int, str] = {}
        complete: set[int] = set()
        for row, matcher, ok in zip(rows, matchers, accepted):
            assert matcher is not None
            if not ok:
                refused[row.task.task_id] = matcher.error() or "no reason given"
            elif matcher.is_terminated():
                complete.add(row.task.task_id)
        return refused, complete

    def _accept(
        self, task: EngineTask, token: int, issued: IssuedStep, sample_row: int, refused: str | None = None, complete: bool = False
    ) -> None:
        """`refused`: the task's grammar (already advanced by `token`) did not allow it, and why;
        `complete`: its grammar has nothing left to match."""
        assert task.text_stream is not None
        task.completion_tokens += 1
        sampling = task.sampling
        if refused is not None:
            raise output_grammar_failed(f"it refused the sampled token {token}: {refused}")
        text, reason, stop_token = accept_token(
            task.text_stream, token, sampling.stop_token_ids, task.completion_tokens, sampling.max_tokens, complete
        )
        event = task.event(text, [] if stop_token else [token])
        if issued.logprobs is not None and sample_row in issued.logprob_rows:
            event.logprobs = [self._logprob(task, token, issued.logprobs, issued.logprob_rows[sample_row])]
        if reason is None:
            self.outbox.add(task.channel, event)
        else:
            self.finisher.finish(task, reason, event)

    def _logprob(self, task: EngineTask, token: int, data: TopLogprobs, row: int) -> TokenLogprob:
        k = task.sampling.logprobs or 0
        assert data.chosen is not None
        top_ids = data.top_ids[row, :k].tolist()
        top_values = data.top_values[row, :k].tolist()
        decode = self.tokenizer.decode
        top = [(i, decode([i]), v) for i, v in zip(top_ids, top_values)]
        return TokenLogprob(token_id=token, text=decode([token]), logprob=float(data.chosen[row]), top=top)
