"""Helpers shared by the engine tests: run requests concurrently, read their token ids, and the
reference they are held to (the model core and sampler driven one slot at a time)."""

from __future__ import annotations

import asyncio

import torch

from albatross.dtypes import DTYPES
from albatross.model import RWKV7
from albatross.sampler import PenaltyPool, SamplingBatch, sample, seed_to_seed32
from albatross_engine.adapter import AlbatrossRWKV
from runner.interface import GenerationEvent, GenerationRequest, SamplingParams


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

    def live_state(self, slot: int) -> object:
        return self.states.get(slot, f"state of slot {slot}")

    def reset_slots(self, slots: list[int]) -> None:
        self.resets.append(list(slots))
        for slot in slots:
            self.states.pop(slot, None)

    def forget_last_step(self, step: object | None = None) -> None:
        self.forgotten.append(step)


def reference_tokens(model: RWKV7, prompt: list[int], params: SamplingParams, seed: int = 0, state_dtype: str | None = None) -> list[int]:
    """What one request alone gets from the model core and the sampler: the whole prompt in one
    call, then a token a step with the request's seed, up to a stop token or `max_tokens`.
    `state_dtype`: the WKV state's (None: the pool's default on the model's device)."""
    pool = model.new_pool(1) if state_dtype is None else model.new_pool(1, DTYPES[state_dtype])
    penalties = PenaltyPool(1, model.config.vocab_size, model.device)
    slot = torch.tensor([0], device=model.device)
    logits = model.forward(pool, [0], [prompt])
    out: list[int] = []
    for step in range(params.max_tokens):
        batch = SamplingBatch.from_params([params], [seed_to_seed32(seed)], [step], device=model.device)
        token = int(sample(logits, slot, batch, penalties)[0])
        out.append(token)
        if token in params.stop_token_ids:
            break
        logits = model.forward(pool, [0], [[token]])
    return out
