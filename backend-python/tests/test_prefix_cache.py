"""Prefix cache and state sessions on the real Albatross engine (tiny random model, CPU):
hit/miss accounting, identical greedy output with and without the cache, a second chat turn that
prefills only its new tokens, and a state session that matches a replay of the conversation."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from albatross_engine.adapter import AlbatrossRWKV, create_backend
from albatross_engine.state_cache import StateCache
from runner.interface import GenerationRequest, SamplingParams, StateRef
from runner_fakes import install_backend, make_app, settings_with

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, stop=())


@pytest.fixture(params=["thread", "process"], ids=["one worker thread", "two worker processes"])
def engine(request: pytest.FixtureRequest, tiny_checkpoint: Path, tmp_path: Path) -> Iterator[AlbatrossRWKV]:
    if request.param == "thread":
        backend = AlbatrossRWKV(str(tiny_checkpoint), 1, 4, device="cpu", state_store_factory=lambda fingerprint, device: StateCache(tmp_path / "states.sqlite3", fingerprint, device=device))
    else:  # as create_backend builds it: sessions in this process's store, a prefix cache in each worker process
        backend = create_backend(str(tiny_checkpoint), "albatross workers=2 batch=4 device=cpu worker_mode=process",
                                 settings_with(state_cache_path=tmp_path / "states.sqlite3"))  # fmt: skip
        assert len(backend.status()["worker_prefix_caches"]) == 2, "each worker process keeps its own prefix cache"
    yield backend
    backend.shutdown()


def run(backend: AlbatrossRWKV, tokens: list[int], state: StateRef | None = None, sampling: SamplingParams = GREEDY) -> tuple[str, list[int], int]:
    """(text, generated token ids, cached prompt tokens) of one request."""

    async def consume() -> tuple[str, list[int], int]:
        text, ids, cached = "", [], 0
        async for event in backend.async_generate(GenerationRequest(list(tokens), sampling, "t", state)):
            text += event.text
            ids += event.token_ids
            cached = max(cached, event.cached_prompt_tokens)
            assert event.finish_reason in (None, "length", "stop"), event.error
        return text, ids, cached

    return asyncio.run(consume())


def counters(backend: AlbatrossRWKV) -> tuple[int, int, int]:
    status = backend.status()
    return int(status["prefix_cache_hits"]), int(status["prefix_cache_misses"]), int(status["prefill_tokens_total"])


def test_second_chat_turn_resumes_the_first_prompt_and_prefills_only_the_rest(engine: AlbatrossRWKV) -> None:
    first_prompt = engine.encode("User: a first question about rivers\n\nAssistant:")
    reply_text, reply_ids, cached = run(engine, first_prompt, StateRef(use_prefix_cache=True))
    assert cached == 0
    hits, misses, prefilled = counters(engine)
    assert (hits, misses) == (0, 1), "the first turn is a miss"
    second_prompt = first_prompt + reply_ids + engine.encode("\n\nUser: and lakes?\n\nAssistant:")
    with_cache, _, cached = run(engine, second_prompt, StateRef(use_prefix_cache=True))
    assert cached == len(first_prompt), f"expected to resume after the {len(first_prompt)} tokens of the first prompt, resumed after {cached}"
    hits_after, misses_after, prefilled_after = counters(engine)
    assert (hits_after, misses_after) == (1, 1)
    assert prefilled_after - prefilled == len(second_prompt) - len(first_prompt), "only the new tokens are prefilled"
    without_cache, _, cached = run(engine, second_prompt)
    assert cached == 0
    assert with_cache == without_cache, "greedy output must not depend on the prefix cache"


def test_a_long_prompt_repeated_resumes_from_its_last_boundary(engine: AlbatrossRWKV) -> None:
    long_prompt = engine.encode(" ".join(f"word{i}" for i in range(200)))
    assert len(long_prompt) > 256
    first, _, _ = run(engine, long_prompt, StateRef(use_prefix_cache=True))
    second, _, cached = run(engine, long_prompt, StateRef(use_prefix_cache=True))
    assert cached == 256 * ((len(long_prompt) - 1) // 256), f"resumed after {cached} of {len(long_prompt)} tokens"
    assert first == second


def test_boundaries_inside_one_chunk_are_saved_and_resume_exactly(engine: AlbatrossRWKV) -> None:
    """A long prompt goes in one chunk; the states at its boundaries inside that chunk are the
    forward's captures (RWKV7.forward_saving). Prompts that share 300 and 530 of its tokens resume
    from 256 and 512, and answer as they do without the cache."""
    long_prompt = engine.encode(" ".join(f"item{i}" for i in range(400)))
    assert len(long_prompt) > 600
    run(engine, long_prompt, StateRef(use_prefix_cache=True))
    for shared, boundary in ((300, 256), (530, 512)):
        prompt = long_prompt[:shared] + engine.encode(f" and then something else {shared}")
        with_cache, _, cached = run(engine, prompt, StateRef(use_prefix_cache=True))
        assert cached == boundary, f"sharing {shared} tokens resumed after {cached}"
        without_cache, _, _ = run(engine, prompt)
        assert with_cache == without_cache, "a captured prefix state continues exactly as a fresh prefill"


def test_openai_native_route_uses_the_prefix_cache_by_default(engine: AlbatrossRWKV) -> None:
    app = make_app(settings_with(max_tokens=64))
    install_backend(app, engine, strategy="albatross workers=1 batch=4")
    question = " ".join(f"item{i}" for i in range(160))
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": 4, "temperature": 0}
    with TestClient(app) as client:
        first = client.post("/openai/v1/chat/completions", json=body)
        second = client.post("/openai/v1/chat/completions", json=body)
        off = client.post("/openai/v1/chat/completions", json={**body, "use_prefix_cache": False})
        hits, misses, _ = counters(engine)  # read before the app's shutdown stops the engine
    assert first.status_code == second.status_code == off.status_code == 200, first.text
    assert (hits, misses) == (1, 1), "the repeated long prompt hits, the first misses, the opted-out one is not looked up"
    texts = {r.json()["choices"][0]["message"]["content"] for r in (first, second, off)}
    assert len(texts) == 1, f"greedy replies differ with and without the cache: {texts}"


def test_state_session_over_http_matches_a_token_replay_of_the_conversation(engine: AlbatrossRWKV) -> None:
    app = make_app(settings_with(max_tokens=64))
    install_backend(app, engine, strategy="albatross workers=1 batch=4")
    turns = ["User: hi\n\nAssistant:", "User: more please\n\nAssistant:", "User: why?\n\nAssistant:", "User: ok\n\nAssistant:", "User: bye\n\nAssistant:"]
    conversation: list[int] = []
    with TestClient(app) as client:
        for number, prompt in enumerate(turns):
            reply = client.post("/state/chat/completions", json={"session_id": "real", "contents": [prompt], "max_tokens": 6, "temperature": 0, "stop_tokens": []})
            assert reply.status_code == 200, reply.text
            # The engine feeds every generated token, so the saved state is the whole conversation.
            conversation += engine.encode(prompt if number == 0 else "\n\n" + prompt)
            replay_text, replay_ids, _ = run(engine, conversation)
            assert reply.json()["choices"][0]["message"]["content"] == replay_text, f"turn {number + 1} differs from the replay"
            conversation += replay_ids


def test_runner_chat_route_resumes_a_multi_turn_chat_from_the_cached_first_turn(engine: AlbatrossRWKV) -> None:
    app = make_app(settings_with(max_tokens=64))
    install_backend(app, engine, strategy="albatross workers=1 batch=4")
    question = " ".join(f"river{i}" for i in range(40))
    first_turn = [{"role": "user", "content": question}]
    body = {"max_tokens": 4, "temperature": 0, "stop": ["\n\nNever"]}
    with TestClient(app) as client:
        first = client.post("/v1/chat/completions", json={**body, "messages": first_turn})
        assert first.status_code == 200, first.text
        reply = first.json()["choices"][0]["message"]["content"]
        _, _, prefilled_before = counters(engine)
        second_turn = first_turn + [{"role": "assistant", "content": reply}, {"role": "user", "content": "and lakes?"}]
        second = client.post("/v1/chat/completions", json={**body, "messages": second_turn})
        hits, misses, prefilled_after = counters(engine)
    assert second.status_code == 200, second.text
    assert (hits, misses) == (1, 1), "the second turn resumes from the first turn's cached prompt"
    second_prompt_tokens = second.json()["usage"]["prompt_tokens"]
    assert prefilled_after - prefilled_before < second_prompt_tokens // 2, (
        f"the second turn prefilled {prefilled_after - prefilled_before} of {second_prompt_tokens} prompt tokens"
    )
