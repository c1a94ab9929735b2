"""The state-store seam: sessions save the final state of completed turns and continue from it;
the prefix cache resumes from the longest cached prompt prefix without changing any output."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from albatross.model import RWKV7
from albatross_engine.adapter import AlbatrossRWKV
from albatross_engine.state_store import DictStateStore, prefix_key
from engine_helpers import WORKER_MODES
from runner.interface import BackendError, GenerationEvent, GenerationRequest, SamplingParams, StateRef


def greedy(max_tokens: int, stop: tuple[str, ...] = ()) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop, stop_token_ids=())


@pytest.fixture(scope="module", params=[(overlap, mode) for mode in WORKER_MODES for overlap in (False, True)],
                ids=lambda p: f"{'overlap' if p[0] else 'plain'}-{p[1]}")  # fmt: skip
def engine(request: pytest.FixtureRequest, tiny_checkpoint: Path) -> Iterator[AlbatrossRWKV]:
    """With worker processes the store stays in this process: every state crosses the pipe."""
    overlap, mode = request.param
    backend = AlbatrossRWKV(
        str(tiny_checkpoint), worker_num=1, batch_size=4, state_store=DictStateStore(), overlap=overlap, device="cpu", worker_mode=mode
    )
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Path) -> RWKV7:
    return RWKV7.load(tiny_checkpoint, "cpu", progress=False)


def run(backend: AlbatrossRWKV, request: GenerationRequest) -> list[GenerationEvent]:
    async def collect() -> list[GenerationEvent]:
        return [event async for event in backend.async_generate(request)]

    return asyncio.run(collect())


def ids(events: list[GenerationEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def store(backend: AlbatrossRWKV) -> DictStateStore:
    assert isinstance(backend.state_store, DictStateStore)
    return backend.state_store


@pytest.mark.parametrize("max_tokens", [0, 1, 5])
def test_a_saved_state_has_consumed_the_prompt_and_every_generated_token(
    engine: AlbatrossRWKV, model: RWKV7, max_tokens: int
) -> None:
    prompt = [31, 41, 59, 26, 53]
    key = f"session-a-{max_tokens}"
    events = run(engine, GenerationRequest(prompt, greedy(max_tokens), state=StateRef(save_key=key)))
    assert events[-1].finish_reason == "length" and events[-1].completion_tokens == max_tokens
    saved = store(engine).get(key)
    assert saved is not None, "a completed turn saves its state"
    pool = model.new_pool(1)
    model.forward(pool, [0], [prompt + ids(events)])
    expected = pool.read(0)
    for name in ("att_shift", "ffn_shift", "wkv"):
        torch.testing.assert_close(getattr(saved, name), getattr(expected, name), atol=1e-4, rtol=1e-4, msg=name)


def test_a_turn_ended_by_a_stop_string_saves_its_state_too(engine: AlbatrossRWKV) -> None:
    free = run(engine, GenerationRequest([7, 7, 7], greedy(8)))
    stop = "".join(e.text for e in free)[2:4]
    assert stop, "the free run produced text to stop on"
    events = run(engine, GenerationRequest([7, 7, 7], greedy(8, stop=(stop,)), state=StateRef(save_key="stopped")))
    assert events[-1].finish_reason == "stop"
    assert store(engine).contains("stopped")


def test_continuing_a_saved_state_equals_one_long_prompt(engine: AlbatrossRWKV) -> None:
    first_prompt, second_prompt = [11, 22, 33], [44, 55]
    first = run(engine, GenerationRequest(first_prompt, greedy(4), state=StateRef(save_key="chat")))
    second = run(engine, GenerationRequest(second_prompt, greedy(6), state=StateRef(load_key="chat", save_key="chat2")))
    whole = run(engine, GenerationRequest(first_prompt + ids(first) + second_prompt, greedy(6)))
    assert ids(second) == ids(whole), "a continued session must match the same text fed in one prompt"


def test_a_missing_state_is_a_404(engine: AlbatrossRWKV) -> None:
    with pytest.raises(BackendError) as caught:
        run(engine, GenerationRequest([1], greedy(2), state=StateRef(load_key="nobody")))
    assert caught.value.status_code == 404


def test_an_aborted_turn_leaves_the_saved_state_as_it_was(engine: AlbatrossRWKV) -> None:
    run(engine, GenerationRequest([3, 4], greedy(2), state=StateRef(save_key="kept")))
    before = store(engine).get("kept")

    async def abort_early() -> None:
        stream = engine.async_generate(GenerationRequest([5, 6], greedy(500), state=StateRef(save_key="kept")))
        async for _ in stream:
            break
        await stream.aclose()  # type: ignore[attr-defined]

    asyncio.run(abort_early())
    after = store(engine).get("kept")
    assert before is not None and after is not None
    assert torch.equal(before.wkv, after.wkv), "an aborted turn overwrote the saved state"


def test_the_prefix_cache_resumes_from_the_longest_cached_prefix_with_identical_output(engine: AlbatrossRWKV) -> None:
    rng = random.Random(5)
    base = [rng.randrange(1, 65530) for _ in range(600)]
    extended = base + [rng.randrange(1, 65530) for _ in range(20)]
    uncached = run(engine, GenerationRequest(extended, greedy(4)))
    before = engine.core.metrics()
    first = run(engine, GenerationRequest(base, greedy(2), state=StateRef(use_prefix_cache=True)))
    assert first[-1].cached_prompt_tokens == 0
    for length in (256, 512, 600):
        assert store(engine).contains(prefix_key(base[:length])), f"no checkpoint at {length} tokens"
    second = run(engine, GenerationRequest(extended, greedy(4), state=StateRef(use_prefix_cache=True)))
    assert second[-1].cached_prompt_tokens == 600, "the previous prompt's end is the longest cached prefix"
    assert second[-1].prompt_tokens == len(extended)
    assert ids(second) == ids(uncached), "resuming from a cached prefix changed the output"
    after = engine.core.metrics()
    assert after.prefix_cache_hits == before.prefix_cache_hits + 1
    assert after.prefix_cache_misses == before.prefix_cache_misses + 1


def test_a_state_request_without_a_store_is_refused(tiny_checkpoint: Path) -> None:
    backend = AlbatrossRWKV(str(tiny_checkpoint), worker_num=1, batch_size=1, device="cpu")
    try:
        with pytest.raises(BackendError) as caught:
            run(backend, GenerationRequest([1], greedy(1), state=StateRef(save_key="x")))
        assert caught.value.status_code == 400
    finally:
        backend.shutdown()
