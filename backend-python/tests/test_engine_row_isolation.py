"""One request's bad values fail only its own row: a step refused before it reached the device is
issued again without that row, and the others' outputs are what they are alone. A queued request
whose caller left never takes a slot."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from albatross_engine.adapter import AlbatrossRWKV
from albatross_engine.scheduler import Row, RowKind, StepPlan
from runner.interface import GenerationEvent, GenerationRequest, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=())


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> Iterator[AlbatrossRWKV]:
    backend = AlbatrossRWKV(str(tiny_checkpoint), worker_num=1, batch_size=8, device="cpu")
    yield backend
    backend.shutdown()


async def collect(backend: AlbatrossRWKV, request: GenerationRequest) -> list[GenerationEvent]:
    return [event async for event in backend.async_generate(request)]


def run_all(backend: AlbatrossRWKV, requests: list[GenerationRequest]) -> list[list[GenerationEvent]]:
    async def run() -> list[list[GenerationEvent]]:
        return list(await asyncio.gather(*(collect(backend, r) for r in requests)))

    return asyncio.run(run())


def tokens(events: list[GenerationEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def test_a_top_k_the_sampler_cannot_take_fails_only_its_own_request(engine: AlbatrossRWKV) -> None:
    """top_k of 2^63 made the step raise and failed six innocent neighbours with it."""
    innocents = [GenerationRequest([10 + i, 20 + i, 30 + i], GREEDY) for i in range(6)]
    alone = [run_all(engine, [request])[0] for request in innocents]
    hostile = GenerationRequest([1, 2, 3], SamplingParams(max_tokens=6, temperature=1.0, top_k=2**63, stop_token_ids=()))
    results = run_all(engine, [*innocents[:3], hostile, *innocents[3:]])
    failed = results[3]
    assert failed[-1].finish_reason == "error", failed[-1]
    for index, (events, expected) in enumerate(zip([*results[:3], *results[4:]], alone)):
        assert events[-1].finish_reason == "length", f"innocent request {index} ended with {events[-1].finish_reason}: {events[-1].error}"
        assert tokens(events) == tokens(expected), f"innocent request {index} changed"
    assert run_all(engine, [innocents[0]])[0][-1].finish_reason == "length", "the worker still serves"


def test_a_plan_without_some_tasks_renumbers_its_sample_rows(engine: AlbatrossRWKV) -> None:
    from albatross_engine.tasks import EngineTask, SyncChannel

    tasks = [EngineTask([1, 2], GREEDY, seed=1, channel=SyncChannel()) for _ in range(3)]
    rows = [Row(tasks[0], 0, RowKind.DECODE, input_row=0, sample_row=0), Row(tasks[1], 1, RowKind.PREFILL, 0, 2, sample_row=1),
            Row(tasks[2], 2, RowKind.DECODE, input_row=1, sample_row=2)]
    for task, row in zip(tasks, rows):
        task.last_sample_row = row.sample_row
    plan = StepPlan(rows=rows, sample_count=3, decode_tokens=2, prefill_tokens=2)
    rest = plan.without({tasks[0].task_id})
    assert [r.task for r in rest.rows] == tasks[1:]
    assert [r.sample_row for r in rest.rows] == [0, 1] and [t.last_sample_row for t in tasks[1:]] == [0, 1]
    assert (rest.sample_count, rest.decode_tokens, rest.prefill_tokens) == (2, 1, 2)
    assert [r.input_row for r in rest.rows] == [-1, 1], "input rows point into the previous step's ids: unchanged"


def test_a_queued_request_whose_caller_left_is_never_prefilled(tiny_checkpoint: Path) -> None:
    backend = AlbatrossRWKV(str(tiny_checkpoint), worker_num=1, batch_size=1, device="cpu")
    try:
        holder_prompt = [5, 6, 7]
        queued_prompt = list(range(100, 160))

        async def scenario() -> None:
            holder = backend.async_generate(GenerationRequest(holder_prompt, SamplingParams(max_tokens=10_000, temperature=0.0, stop_token_ids=())))
            await holder.__anext__()  # the only slot is taken
            queued = asyncio.ensure_future(collect(backend, GenerationRequest(queued_prompt, GREEDY)))
            for _ in range(200):
                await asyncio.sleep(0.01)
                if backend.core.metrics().queue_depth == 1:
                    break
            queued.cancel()  # the caller left while the request waited for a slot
            await asyncio.gather(queued, return_exceptions=True)
            deadline = time.monotonic() + 60
            while backend.core.metrics().requests_finished.get("abort", 0) < 1:
                assert time.monotonic() < deadline, "the queued request was never dropped"
                await asyncio.sleep(0.01)
            await holder.aclose()

        asyncio.run(scenario())
        metrics = backend.core.metrics()
        assert metrics.prefill_tokens_total == len(holder_prompt), f"{metrics.prefill_tokens_total} prompt tokens were prefilled"
    finally:
        backend.shutdown()
