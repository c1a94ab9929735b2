"""Helpers shared by the engine tests: run requests concurrently and read their token ids."""

from __future__ import annotations

import asyncio

from albatross_engine.adapter import AlbatrossRWKV
from runner.interface import GenerationEvent, GenerationRequest


# Engine tests that apply to both run with workers as threads and as processes (worker_mode).
WORKER_MODES = ("thread", "process")


def collect(backend: AlbatrossRWKV, requests: list[GenerationRequest]) -> list[list[GenerationEvent]]:
    """Every event of each request, all requests in flight at once."""

    async def one(request: GenerationRequest) -> list[GenerationEvent]:
        return [event async for event in backend.async_generate(request)]

    async def run() -> list[list[GenerationEvent]]:
        return list(await asyncio.gather(*(one(r) for r in requests)))

    return asyncio.run(run())


def token_ids(events: list[GenerationEvent]) -> list[int]:
    return [token for event in events for token in event.token_ids]


class RecordingDeviceStep:
    """The part of `DeviceStep` that the worker's host-side classes call, as plain Python: a slot's
    "state" is whatever was last written to it, and every call is recorded."""

    def __init__(self) -> None:
        self.states: dict[int, object] = {}
        self.resets: list[list[int]] = []
        self.forgotten: list[object] = []

    def write_state(self, slot: int, state: object) -> None:
        self.states[slot] = state

    def read_state(self, slot: int) -> object:
        return self.states.get(slot, f"state of slot {slot}")

    def reset_slots(self, slots: list[int]) -> None:
        self.resets.append(list(slots))
        for slot in slots:
            self.states.pop(slot, None)

    def forget_last_step(self, step: object | None = None) -> None:
        self.forgotten.append(step)
