"""Event delivery from a worker to a caller's loop: AsyncChannel, EventOutbox, and how
`AlbatrossRWKV.async_generate` reads a channel (merging queued events, raising errors in order)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from albatross_engine.tasks import AsyncChannel, EventOutbox
from runner.interface import BackendError, GenerationEvent


def test_items_put_before_and_while_waiting_arrive_in_order() -> None:
    async def scenario() -> list[object]:
        channel = AsyncChannel(asyncio.get_running_loop())
        channel.put(1)
        channel.put(2)
        first = await channel.next_items()
        reader = asyncio.create_task(channel.next_items())
        await asyncio.sleep(0)  # the reader now waits
        channel.put(3)
        channel.put(4)
        return [first, await reader, channel.take()]

    assert asyncio.run(scenario()) == [[1, 2], [3, 4], []]


def test_a_cancelled_reader_does_not_lose_later_items() -> None:
    async def scenario() -> list[object]:
        channel = AsyncChannel(asyncio.get_running_loop())
        reader = asyncio.create_task(channel.next_items())
        await asyncio.sleep(0)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        channel.put("after")  # the cancelled waiter is skipped, the item kept
        return await asyncio.wait_for(channel.next_items(), 1)

    assert asyncio.run(scenario()) == ["after"]


def test_the_outbox_delivers_one_batch_per_loop_from_another_thread() -> None:
    async def scenario() -> list[object]:
        loop = asyncio.get_running_loop()
        channels = [AsyncChannel(loop) for _ in range(3)]

        def worker() -> None:
            outbox = EventOutbox()
            for step in range(2):
                for n, channel in enumerate(channels):
                    outbox.add(channel, (step, n))
                outbox.flush()

        thread = threading.Thread(target=worker)
        thread.start()
        await asyncio.to_thread(thread.join)
        got = []
        for channel in channels:
            items = []
            while len(items) < 2:
                items += await asyncio.wait_for(channel.next_items(), 1)
            got.append(items)
        return got

    assert asyncio.run(scenario()) == [[(0, n), (1, n)] for n in range(3)]


def test_async_generate_merges_queued_events_and_raises_a_queued_error_after_them() -> None:
    """Reads a channel the way the adapter does, with a fake engine core that only records."""
    from albatross_engine.adapter import AlbatrossRWKV

    class Core:
        def __init__(self) -> None:
            self.aborted = 0

        def submit(self, task: object) -> None:
            self.task = task

        def abort(self, task: object) -> None:
            self.aborted += 1

    backend = AlbatrossRWKV.__new__(AlbatrossRWKV)
    core = Core()
    backend._core = core  # type: ignore[assignment]
    # A stand-in task: the channel and the prompt length (which plain deltas from a worker process take)
    backend._task = lambda request, channel, grammar: SimpleNamespace(channel=channel, prompt_len=0)  # type: ignore[method-assign]

    async def no_grammar(request: object) -> None:
        return None

    backend._compile_off_loop = no_grammar  # type: ignore[method-assign,assignment]

    async def scenario() -> tuple[list[GenerationEvent], BaseException | None]:
        stream = backend.async_generate(None)  # type: ignore[arg-type]
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        channel: AsyncChannel = core.task.channel
        for text in "abc":
            channel.put(GenerationEvent(text=text, token_ids=[ord(text)]))
        channel.put(BackendError(500, "boom"))
        channel.put(GenerationEvent(text="never"))
        events = [await first]
        error = None
        try:
            async for event in stream:
                events.append(event)
        except BackendError as raised:
            error = raised
        return events, error

    events, error = asyncio.run(scenario())
    assert [e.text for e in events] == ["abc"] and events[0].token_ids == [97, 98, 99]
    assert isinstance(error, BackendError) and error.status_code == 500
    assert core.aborted == 0  # an error from the engine ends the stream; nothing to abort
