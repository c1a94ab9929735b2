"""albatross_engine/results.py: an issued step's sampled ids become each task's events."""

from __future__ import annotations

import pytest
import torch

from albatross.detokenizer import TextStream
from albatross.sampler import TopLogprobs
from albatross.tokenizer import Tokenizer, get_tokenizer
from albatross_engine.device_step import IssuedStep
from albatross_engine.finishing import Finisher
from albatross_engine.metrics import WorkerMetrics
from albatross_engine.results import ResultProcessor
from albatross_engine.saved_states import SavedStates
from albatross_engine.scheduler import Scheduler, StepPlan
from albatross_engine.state_store import PromptEndIndex
from albatross_engine.tasks import EngineTask, EventOutbox, SyncChannel
from engine_helpers import RecordingDeviceStep
from runner.interface import GenerationEvent, SamplingParams


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return get_tokenizer()


class Harness:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(batch_size=4)
        self.outbox = EventOutbox()
        self.metrics = WorkerMetrics()
        self.device = RecordingDeviceStep()
        saved = SavedStates(self.device, self.metrics, PromptEndIndex())  # type: ignore[arg-type]
        finisher = Finisher(self.scheduler, self.outbox, self.metrics, saved, self.device, lambda: None)  # type: ignore[arg-type]
        self.results = ResultProcessor(self.device, finisher, self.outbox, self.metrics, tokenizer)  # type: ignore[arg-type]

    def admitted(self, sampling: SamplingParams) -> EngineTask:
        task = EngineTask([1, 2], sampling, seed=1, channel=SyncChannel())
        task.text_stream = TextStream(self.tokenizer, sampling.stop)
        self.scheduler.add(task)
        self.scheduler.admit()
        return task

    def step(self, ids: list[int], logprobs: TopLogprobs | None = None, logprob_rows: dict[int, int] | None = None) -> StepPlan:
        plan = self.scheduler.plan()
        issued = IssuedStep(plan, host_ids=torch.tensor(ids, dtype=torch.int64), logprobs=logprobs, logprob_rows=logprob_rows or {})
        self.results.process(issued)
        return plan


def events(task: EngineTask) -> list[GenerationEvent]:
    assert isinstance(task.channel, SyncChannel)
    out = []
    while not task.channel.queue.empty():
        item = task.channel.queue.get()
        assert isinstance(item, GenerationEvent), item
        out.append(item)
    return out


def byte_id(char: str) -> int:
    return ord(char) + 1  # World ids 1..256 are the single bytes


def test_each_sampled_token_becomes_one_event_with_its_text_and_counters(tokenizer: Tokenizer) -> None:
    harness = Harness(tokenizer)
    first = harness.admitted(SamplingParams(max_tokens=3, stop_token_ids=()))
    second = harness.admitted(SamplingParams(max_tokens=3, stop_token_ids=()))
    harness.step([byte_id("a"), byte_id("x")])
    harness.step([byte_id("b"), byte_id("y")])
    assert [(e.text, e.token_ids, e.completion_tokens, e.prompt_tokens) for e in events(first)] == [
        ("a", [byte_id("a")], 1, 2), ("b", [byte_id("b")], 2, 2)
    ]
    assert [e.text for e in events(second)] == ["x", "y"]
    assert harness.metrics.snapshot().generated_tokens_total == 4


def test_a_stop_token_ends_the_task_with_stop_and_emits_no_token(tokenizer: Tokenizer) -> None:
    harness = Harness(tokenizer)
    task = harness.admitted(SamplingParams(max_tokens=5, stop_token_ids=(0,)))
    harness.step([byte_id("a")])
    harness.step([0])
    last = events(task)[-1]
    assert (last.finish_reason, last.token_ids, last.completion_tokens) == ("stop", [], 2)
    assert harness.scheduler.free_slot_count == 4


def test_max_tokens_ends_the_task_with_length(tokenizer: Tokenizer) -> None:
    harness = Harness(tokenizer)
    task = harness.admitted(SamplingParams(max_tokens=1, stop_token_ids=()))
    harness.step([byte_id("a")])
    assert [(e.text, e.finish_reason) for e in events(task)] == [("a", "length")]


def test_a_sample_of_a_task_that_already_finished_is_dropped_and_not_counted(tokenizer: Tokenizer) -> None:
    harness = Harness(tokenizer)
    task = harness.admitted(SamplingParams(max_tokens=4, stop_token_ids=()))
    plan = harness.scheduler.plan()
    task.finish_reason = "abort"  # as when the task was aborted while its step ran
    harness.results.process(IssuedStep(plan, host_ids=torch.tensor([byte_id("a")])))
    assert events(task) == [] and harness.metrics.snapshot().generated_tokens_total == 0


def test_a_prompt_fed_with_max_tokens_zero_finishes_with_length_and_no_tokens(tokenizer: Tokenizer) -> None:
    harness = Harness(tokenizer)
    task = harness.admitted(SamplingParams(max_tokens=0))
    plan = harness.step([])
    assert plan.sample_count == 0
    assert [(e.finish_reason, e.completion_tokens, e.token_ids) for e in events(task)] == [("length", 0, [])]


def test_logprobs_go_with_the_rows_that_asked_for_them(tokenizer: Tokenizer) -> None:
    harness = Harness(tokenizer)
    plain = harness.admitted(SamplingParams(max_tokens=2, stop_token_ids=()))
    asking = harness.admitted(SamplingParams(max_tokens=2, stop_token_ids=(), logprobs=2))
    data = TopLogprobs(
        chosen=torch.tensor([-0.5]), top_values=torch.tensor([[-0.5, -1.5, -9.0]]),
        top_ids=torch.tensor([[byte_id("y"), byte_id("z"), byte_id("q")]]),
    )  # fmt: skip
    harness.step([byte_id("a"), byte_id("y")], logprobs=data, logprob_rows={1: 0})
    assert events(plain)[0].logprobs is None
    [entry] = events(asking)[0].logprobs or []
    assert (entry.token_id, entry.text, entry.logprob) == (byte_id("y"), "y", -0.5)
    assert entry.top == [(byte_id("y"), "y", -0.5), (byte_id("z"), "z", -1.5)], "the top k the request asked for"


class BrokenIds(IssuedStep):
    def token_ids(self) -> list[int]:
        raise RuntimeError("device lost")


def test_a_failure_at_the_sync_fails_the_steps_tasks_resets_their_slots_and_forgets_the_step(tokenizer: Tokenizer) -> None:
    harness = Harness(tokenizer)
    task = harness.admitted(SamplingParams(max_tokens=2))
    broken = BrokenIds(harness.scheduler.plan())
    harness.results.process(broken)
    [event] = events(task)
    assert event.finish_reason == "error" and "device lost" in (event.error or "")
    assert harness.device.resets == [[task.slot]] and harness.device.forgotten == [broken]
