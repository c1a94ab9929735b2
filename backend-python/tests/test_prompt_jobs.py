"""runner/jobs.py: how every completion route turns prompts into the jobs it runs."""

from __future__ import annotations

import asyncio
import threading

import pytest
from fastapi.testclient import TestClient

from runner.errors import ApiError
from runner.interface import END_OF_TEXT_TOKEN, SamplingParams, StateRef
from runner.jobs import INLINE_ENCODE_CHARS, build_jobs, check_item_count, encode_prompts
from runner_fakes import ScriptedBackend, make_app, settings_with


class ThreadRecordingBackend(ScriptedBackend):
    def __init__(self) -> None:
        super().__init__()
        self.encoded_on: list[threading.Thread] = []

    def encode(self, text: str) -> list[int]:
        self.encoded_on.append(threading.current_thread())
        return super().encode(text)


def test_long_prompts_are_encoded_off_the_event_loop_and_short_ones_on_it() -> None:
    """A long prompt would stall every stream while it is tokenized; a short one is quicker to
    encode than a thread hop, which in a burst sends each request behind all the others."""
    long_prompt = "x" * (INLINE_ENCODE_CHARS - 1)

    async def run(prompts: list[str]) -> tuple[list[list[int]], threading.Thread, list[threading.Thread]]:
        backend = ThreadRecordingBackend()
        return await encode_prompts(backend, prompts, 10**6, "prompt"), threading.current_thread(), backend.encoded_on

    encoded, loop_thread, threads = asyncio.run(run(["ab", "c"]))
    assert encoded == [[97, 98], [99]] and threads == [loop_thread, loop_thread]
    encoded, loop_thread, threads = asyncio.run(run([long_prompt, "yz"]))  # one character over, in all
    assert encoded == [[120] * len(long_prompt), [121, 122]]
    assert len(threads) == 2 and loop_thread not in threads
    _, loop_thread, threads = asyncio.run(run([long_prompt, "y"]))  # exactly the limit
    assert threads == [loop_thread, loop_thread]


def test_an_empty_prompt_starts_a_new_document_and_continues_a_loaded_state_as_is() -> None:
    backend = ScriptedBackend()
    fresh = asyncio.run(encode_prompts(backend, ["", "x"], 100, "prompt"))
    continued = asyncio.run(encode_prompts(backend, [""], 100, "prompt", StateRef(load_key="s", save_key="s")))
    saved_only = asyncio.run(encode_prompts(backend, [""], 100, "prompt", StateRef(save_key="s")))
    assert fresh == [[END_OF_TEXT_TOKEN], [120]]
    assert continued == [[]]
    assert saved_only == [[END_OF_TEXT_TOKEN]]


def test_a_prompt_over_the_cap_is_400_naming_the_field_and_the_prompt() -> None:
    with pytest.raises(ApiError) as raised:
        asyncio.run(encode_prompts(ScriptedBackend(), ["ok", "far too long"], 5, "contents"))
    assert raised.value.status_code == 400 and raised.value.param == "contents"
    assert "prompt 1 has 12 tokens" in raised.value.message and "--max-prompt-tokens" in raised.value.message


@pytest.mark.parametrize(("count", "message"), [(0, "at least one prompt"), (4, "4 prompts exceed the server cap of 3")])
def test_item_counts_outside_one_to_the_cap_are_400(count: int, message: str) -> None:
    with pytest.raises(ApiError) as raised:
        check_item_count(count, 3, "contents")
    assert raised.value.status_code == 400 and message in raised.value.message


def test_jobs_number_choices_per_prompt_and_give_sample_j_seed_plus_j() -> None:
    state = StateRef(use_prefix_cache=True)
    jobs = build_jobs([[1], [2, 3]], SamplingParams(seed=40), "req", state, n=2)
    assert [job.index for job in jobs] == [0, 1, 2, 3]
    assert [job.request.prompt_tokens for job in jobs] == [[1], [1], [2, 3], [2, 3]]
    assert [job.request.sampling.seed for job in jobs] == [40, 41, 40, 41]
    assert [job.request.request_id for job in jobs] == ["req-0", "req-1", "req-2", "req-3"]
    assert all(job.request.state == state and job.request.state is not state for job in jobs)
    assert len({id(job.request.state) for job in jobs}) == 4


def test_unseeded_jobs_leave_the_seed_to_the_backend() -> None:
    jobs = build_jobs([[1]], SamplingParams(), "req", n=3)
    assert [job.request.sampling.seed for job in jobs] == [None, None, None]


def test_an_empty_prompt_reaches_the_backend_as_the_same_tokens_on_the_openai_and_native_routes() -> None:
    backend = ScriptedBackend(["x"], concurrent=True)
    with TestClient(make_app(settings_with(), backend)) as client:
        text = client.post("/v1/completions", json={"prompt": "", "max_tokens": 1})
        native = client.post("/v2/chat/completions", json={"contents": [""], "max_tokens": 1})
    assert text.status_code == 200, text.text
    assert native.status_code == 200, native.text
    assert [request.prompt_tokens for request in backend.requests] == [[END_OF_TEXT_TOKEN], [END_OF_TEXT_TOKEN]]
