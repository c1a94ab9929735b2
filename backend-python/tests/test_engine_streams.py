"""Concurrent streams: interleaving, aborts that free their slot at once, and many requests
flowing through few slots without a leak."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from albatross.model import RWKV7
from albatross_engine.adapter import AlbatrossRWKV
from engine_helpers import WORKER_MODES, reference_tokens
from runner.interface import GenerationEvent, GenerationRequest, SamplingParams


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=())


@pytest.fixture(scope="module", params=WORKER_MODES)
def engine(request: pytest.FixtureRequest, tiny_checkpoint: Path) -> Iterator[AlbatrossRWKV]:
    backend = AlbatrossRWKV(str(tiny_checkpoint), worker_num=1, batch_size=8, device="cpu", worker_mode=request.param)
    yield backend
    backend.shutdown()


def wait_idle(backend: AlbatrossRWKV) -> None:
    """Aborts and releases happen on the worker thread; give it a moment to report idle."""
    for _ in range(200):
        metrics = backend.core.metrics()
        if metrics.active_slots == 0 and metrics.queue_depth == 0 and backend.core.workers[0].load == 0:
            return
        time.sleep(0.01)


def test_a_second_stream_starts_before_the_first_finishes(engine: AlbatrossRWKV) -> None:
    order: list[tuple[str, str | None]] = []

    async def stream(name: str, request: GenerationRequest, started: asyncio.Event | None) -> None:
        async for event in engine.async_generate(request):
            order.append((name, event.finish_reason))
            if started is not None:
                started.set()

    async def run() -> None:
        first_started = asyncio.Event()
        long_run = asyncio.create_task(stream("first", GenerationRequest([1, 2, 3], greedy(40)), first_started))
        await first_started.wait()
        await stream("second", GenerationRequest([4, 5], greedy(3)), None)
        await long_run

    asyncio.run(run())
    second_first = order.index(("second", None))
    first_last = order.index(("first", "length"))
    assert second_first < first_last, f"the second stream waited for the first to finish: {order}"


def test_closing_a_stream_aborts_it_frees_its_slot_and_leaves_the_others_intact(
    engine: AlbatrossRWKV, tiny_checkpoint: Path
) -> None:
    model = RWKV7.load(tiny_checkpoint, "cpu", progress=False)
    neighbour = GenerationRequest([7, 8, 9], greedy(16))
    expected = reference_tokens(model, neighbour.prompt_tokens, neighbour.sampling)
    before = engine.core.metrics()

    async def run() -> tuple[list[GenerationEvent], int]:
        doomed = engine.async_generate(GenerationRequest([10, 11], greedy(2000)))
        neighbour_run = asyncio.create_task(_collect(engine, neighbour))
        seen = 0
        async for _ in doomed:
            seen += 1
            if seen == 3:
                break
        await doomed.aclose()  # type: ignore[attr-defined]
        return await neighbour_run, seen

    neighbour_events, seen = asyncio.run(run())
    assert [t for e in neighbour_events for t in e.token_ids] == expected, "the neighbour's output changed"
    wait_idle(engine)
    after = engine.core.metrics()
    assert after.active_slots == 0, "the aborted request still holds a slot"
    assert after.requests_finished.get("abort", 0) == before.requests_finished.get("abort", 0) + 1
    generated = after.generated_tokens_total - before.generated_tokens_total
    assert generated < 100, f"the aborted request kept generating ({generated} tokens) instead of stopping"


def test_two_hundred_requests_through_eight_slots_complete_correctly_without_a_slot_leak(
    engine: AlbatrossRWKV, tiny_checkpoint: Path
) -> None:
    model = RWKV7.load(tiny_checkpoint, "cpu", progress=False)
    prompts = [[3, 1, 4], [1, 5], [9, 2, 6, 5], [35], [8, 9, 7, 9]]
    expected = [reference_tokens(model, p, greedy(3)) for p in prompts]
    requests = [GenerationRequest(prompts[i % len(prompts)], greedy(3)) for i in range(200)]

    async def run() -> list[list[GenerationEvent]]:
        return list(await asyncio.gather(*(_collect(engine, r) for r in requests)))

    results = asyncio.run(run())
    for index, events in enumerate(results):
        got = [t for e in events for t in e.token_ids]
        assert got == expected[index % len(prompts)], f"request {index}: {got}"
        assert events[-1].finish_reason == "length"
    wait_idle(engine)
    worker = engine.core.workers[0]
    assert worker.load == 0 and engine.core.metrics().active_slots == 0
    if engine.worker_mode == "thread":  # a worker process's scheduler is in that process
        assert worker._scheduler.free_slot_count == 8, "every slot is free again"


def test_cancelling_the_consumer_task_aborts_the_request(engine: AlbatrossRWKV) -> None:
    before = engine.core.metrics().requests_finished.get("abort", 0)

    async def run() -> None:
        got_one = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.async_generate(GenerationRequest([12, 13], greedy(2000))):
                got_one.set()

        task = asyncio.create_task(consume())
        await got_one.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    wait_idle(engine)
    assert engine.core.metrics().requests_finished.get("abort", 0) == before + 1


def test_the_sync_generator_yields_the_same_events_as_the_async_one(engine: AlbatrossRWKV) -> None:
    request = GenerationRequest([21, 22, 23], greedy(5))
    sync_ids = [t for e in engine.generate(request) for t in e.token_ids]
    async_ids = [t for e in asyncio.run(_collect(engine, request)) for t in e.token_ids]
    assert sync_ids == async_ids and len(sync_ids) == 5


async def _collect(backend: AlbatrossRWKV, request: GenerationRequest) -> list[GenerationEvent]:
    return [event async for event in backend.async_generate(request)]


def test_logprobs_report_the_chosen_token_and_the_top_k(engine: AlbatrossRWKV) -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0, frequency_penalty=0.0, stop_token_ids=(), logprobs=2)
    events = asyncio.run(_collect(engine, GenerationRequest([14, 15], params)))
    # A caller that falls behind gets several tokens in one event: one logprob per token either way.
    assert all(len(event.logprobs or []) == len(event.token_ids) for event in events), "one logprob per token"
    entries = [(entry, token) for event in events for entry, token in zip(event.logprobs or [], event.token_ids)]
    assert len(entries) == 3
    for entry, token in entries:
        assert entry.token_id == token and entry.text == engine.decode([entry.token_id])
        assert len(entry.top) == 2 and entry.top[0][2] >= entry.top[1][2], f"top-2 in descending order: {entry.top}"
        assert entry.top[0][0] == entry.token_id and entry.logprob == pytest.approx(entry.top[0][2]), (
            "greedy without penalties picks the most likely token"
        )
        assert entry.logprob <= 0.0
    plain = asyncio.run(_collect(engine, GenerationRequest([14, 15], greedy(3))))
    assert all(e.logprobs is None for e in plain), "no logprobs unless asked"


def test_a_caller_that_fell_behind_gets_the_queued_tokens_as_one_merged_event(engine: AlbatrossRWKV) -> None:
    request = GenerationRequest(prompt_tokens=[7, 8, 9, 10], sampling=greedy(12))

    async def read(slow: bool) -> list[GenerationEvent]:
        events: list[GenerationEvent] = []
        finished_before = sum(engine.status()["requests_finished"].values())
        iterator = engine.async_generate(request)
        events.append(await iterator.__anext__())
        if slow:  # let the engine finish the request before reading on
            for _ in range(600):
                if sum(engine.status()["requests_finished"].values()) > finished_before:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)  # the step's events reach this loop right after it is counted
        async for event in iterator:
            events.append(event)
        return events

    prompt_read = asyncio.run(read(slow=False))
    late_read = asyncio.run(read(slow=True))
    assert len(late_read) == 2, f"expected the first event and one merged event, got {len(late_read)} events"
    for name, events in (("prompt", prompt_read), ("late", late_read)):
        assert events[-1].finish_reason == "length" and events[-1].completion_tokens == 12, name
    assert [t for e in late_read for t in e.token_ids] == [t for e in prompt_read for t in e.token_ids]
    assert "".join(e.text for e in late_read) == "".join(e.text for e in prompt_read)
