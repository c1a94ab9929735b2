"""Helpers shared by the engine tests: run requests concurrently and read their token ids."""

from __future__ import annotations

import asyncio

from albatross_engine.adapter import AlbatrossRWKV
from runner.interface import GenerationEvent, GenerationRequest


def collect(backend: AlbatrossRWKV, requests: list[GenerationRequest]) -> list[list[GenerationEvent]]:
    """Every event of each request, all requests in flight at once."""

    async def one(request: GenerationRequest) -> list[GenerationEvent]:
        return [event async for event in backend.async_generate(request)]

    async def run() -> list[list[GenerationEvent]]:
        return list(await asyncio.gather(*(one(r) for r in requests)))

    return asyncio.run(run())


def token_ids(events: list[GenerationEvent]) -> list[int]:
    return [token for event in events for token in event.token_ids]
