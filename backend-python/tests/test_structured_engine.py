"""Constraints inside the Albatross engine's batch: the same constrained greedy answers as the
classic backend, unconstrained rows untouched by masked rows next to them (with and without
overlap), the grammar's end and max_tokens, and no matcher outliving its request however it ends."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from fastapi.testclient import TestClient

from albatross.constraints import CompiledGrammar, ConstraintCompiler, TokenMatcher, json_schema_grammar
from albatross.tokenizer import get_tokenizer
from albatross_engine import grammar_masks
from albatross_engine.adapter import AlbatrossRWKV
from engine_helpers import collect, token_ids
from runner.app import create_app
from runner.interface import BackendError, GenerationEvent, GenerationRequest, OutputConstraint, SamplingParams
from runner_fakes import settings_with
from structured_cases import BACKENDS, GREEDY, SCHEMAS, TOOLS, USER, json_schema_format

# ---------------------------------------------------------------------------- both backends, one answer


@pytest.fixture(scope="module")
def clients(tiny_checkpoint: Path) -> Iterator[dict[str, TestClient]]:
    apps = {name: create_app(settings_with(model_path=str(tiny_checkpoint), strategy=strategy)) for name, strategy in BACKENDS.items()}
    with TestClient(apps["classic"]) as classic, TestClient(apps["albatross"]) as albatross:
        yield {"classic": classic, "albatross": albatross}


NAMED = {"type": "function", "function": {"name": "get_time"}}
CHAT_CASES: dict[str, dict[str, Any]] = {
    **{f"schema-{name}": {"response_format": json_schema_format(schema), "max_tokens": 120} for name, schema in SCHEMAS.items()},
    "json-object": {"response_format": {"type": "json_object"}, "max_tokens": 40},
    "tools-required": {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 80},
    "tools-named": {"tools": TOOLS, "tool_choice": NAMED, "max_tokens": 80},
    "tools-auto": {"tools": TOOLS, "max_tokens": 60},
    "tools-parallel": {"tools": TOOLS, "tool_choice": "required", "max_tokens": 80},
    "penalties": {"response_format": json_schema_format(SCHEMAS["flat"]), "presence_penalty": 0.5, "frequency_penalty": 1.0, "max_tokens": 80},
}


def without_call_ids(reply: dict[str, Any]) -> dict[str, Any]:
    """The reply less what is random by design (ids, timestamps)."""
    choice = reply["choices"][0]
    for call in choice["message"].get("tool_calls") or []:
        call.pop("id")
    return {"choice": choice, "usage": reply["usage"]}


@pytest.mark.parametrize("case", list(CHAT_CASES))
def test_both_backends_give_the_same_constrained_greedy_chat_answer(clients: dict[str, TestClient], case: str) -> None:
    body = {"messages": USER, **GREEDY, **CHAT_CASES[case]}
    replies = {}
    for name, client in clients.items():
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, f"{name}: {response.text}"
        replies[name] = without_call_ids(response.json())
    assert replies["albatross"] == replies["classic"]


def test_both_backends_give_the_same_constrained_greedy_completion_and_bias(clients: dict[str, TestClient]) -> None:
    bodies = [
        {"prompt": "Data:", "response_format": json_schema_format(SCHEMAS["enum-and-array"]), **GREEDY, "max_tokens": 80},
        {"prompt": "Hello", **GREEDY, "max_tokens": 6, "logit_bias": {"33": 5.0, "11": -100, "1000": 100}},
    ]
    for body in bodies:
        texts = {name: client.post("/v1/completions", json=body).json()["choices"][0] for name, client in clients.items()}
        assert texts["albatross"] == texts["classic"], body


# ---------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module", params=[False, True], ids=["no-overlap", "overlap"])
def engine(request: pytest.FixtureRequest, tiny_checkpoint: Path) -> Iterator[AlbatrossRWKV]:
    backend = AlbatrossRWKV(str(tiny_checkpoint), worker_num=1, batch_size=8, device="cpu", overlap=request.param)
    yield backend
    backend.shutdown()


def grammar_of(schema: dict[str, Any], label: str = "response_format json_schema") -> OutputConstraint:
    return OutputConstraint(json_schema_grammar(schema), label)


SAMPLED = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, presence_penalty=0.3, frequency_penalty=0.5)


def free_request(n: int) -> GenerationRequest:
    return GenerationRequest([10 + n, 20, 30 + n], SamplingParams(max_tokens=24, temperature=1.0, top_p=0.8, seed=100 + n))


def constrained_request(n: int) -> GenerationRequest:
    schema = list(SCHEMAS.values())[n % len(SCHEMAS)]
    sampling = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, seed=200 + n, logit_bias=((35, 2.0),) if n % 2 else ())
    return GenerationRequest([40 + n, 50], sampling, constraint=grammar_of(schema))


def test_unconstrained_requests_are_token_for_token_the_same_next_to_masked_rows(engine: AlbatrossRWKV) -> None:
    free = [free_request(n) for n in range(4)]
    constrained = [constrained_request(n) for n in range(4)]
    alone = [token_ids(events) for events in collect(engine, free)]
    constrained_alone = [token_ids(events) for events in collect(engine, constrained)]
    mixed = collect(engine, [request for pair in zip(free, constrained) for request in pair])
    assert [token_ids(events) for events in mixed[0::2]] == alone
    assert [token_ids(events) for events in mixed[1::2]] == constrained_alone, "seeded constrained rows do not depend on their batch either"
    assert engine.status()["masked_samples_total"] > 0


def test_overlap_changes_no_output_of_a_mixed_batch(tiny_checkpoint: Path) -> None:
    """With overlap, step N+1 is issued before step N's tokens advance the matchers; its masked rows
    still sample under the masks of the right position."""
    requests = [request for n in range(3) for request in (free_request(n), constrained_request(n))]
    outputs = []
    for overlap in (False, True):
        backend = AlbatrossRWKV(str(tiny_checkpoint), worker_num=1, batch_size=8, device="cpu", overlap=overlap)
        try:
            outputs.append([token_ids(events) for events in collect(backend, requests)])
        finally:
            backend.shutdown()
    assert outputs[1] == outputs[0]


def test_logprobs_follow_each_row_when_masked_rows_sample_apart(engine: AlbatrossRWKV) -> None:
    """The masked rows' chosen logprobs are their own (the same as alone), and a free greedy row's
    chosen token is its most likely one, whichever call sampled it."""
    free = GenerationRequest([14, 15], SamplingParams(max_tokens=6, temperature=0.0, frequency_penalty=0.0, stop_token_ids=(), logprobs=2))
    masked = GenerationRequest([16, 17], SamplingParams(max_tokens=6, temperature=1.0, seed=9, logprobs=3), constraint=grammar_of(SCHEMAS["flat"]))

    def entries(events: list[GenerationEvent]) -> list[tuple[int, float, int]]:
        return [(entry.token_id, round(entry.logprob, 4), len(entry.top)) for event in events for entry in event.logprobs or []]

    (masked_alone,) = collect(engine, [masked])
    free_events, masked_events = collect(engine, [free, masked])
    assert entries(masked_events) == entries(masked_alone) and len(entries(masked_alone)) == 6
    assert [token for token, _, _ in entries(masked_alone)] == token_ids(masked_alone)
    for event in free_events:
        for entry, token in zip(event.logprobs or [], event.token_ids):
            assert entry.token_id == token == entry.top[0][0] and entry.logprob == pytest.approx(entry.top[0][2])


def test_a_grammar_that_is_complete_stops_and_max_tokens_cuts_with_length(engine: AlbatrossRWKV) -> None:
    yes_or_no = OutputConstraint('start: "yes" | "no, thanks"', "test")
    # The end of text is allowed only where the grammar can end: even a +100 bias cannot end early.
    forced_end = SamplingParams(max_tokens=30, temperature=1.0, seed=3, logit_bias=((0, 100.0),))
    (done,) = collect(engine, [GenerationRequest([5, 6], forced_end, constraint=yes_or_no)])
    assert "".join(e.text for e in done) in ("yes", "no, thanks") and done[-1].finish_reason == "stop"
    sentence = "The quick brown fox jumps over the lazy dog, twice."
    cut = GenerationRequest([5, 6], SamplingParams(max_tokens=3, temperature=0), constraint=OutputConstraint(f'start: "{sentence}"', "test"))
    (events,) = collect(engine, [cut])
    text = "".join(e.text for e in events)
    assert sentence.startswith(text) and len(text) < len(sentence)
    assert events[-1].finish_reason == "length" and events[-1].completion_tokens == 3


# ---------------------------------------------------------------------------- matchers never leak


@pytest.fixture
def matchers(monkeypatch: pytest.MonkeyPatch) -> list[TokenMatcher]:
    """Every matcher made while the test runs."""
    made: list[TokenMatcher] = []
    original = CompiledGrammar.matcher

    def recording(self: CompiledGrammar) -> TokenMatcher:
        matcher = original(self)
        made.append(matcher)
        return matcher

    monkeypatch.setattr(CompiledGrammar, "matcher", recording)
    return made


JSON_OBJECT = OutputConstraint(json_schema_grammar({"type": "object"}), "response_format json_object")
LONG = SamplingParams(max_tokens=400, temperature=1.0, seed=7)


def test_finished_and_aborted_requests_free_their_matchers(engine: AlbatrossRWKV, matchers: list[TokenMatcher]) -> None:
    collect(engine, [constrained_request(n) for n in range(3)])

    async def abort_after_one_event() -> None:
        stream = engine.async_generate(GenerationRequest([1, 2], LONG, constraint=JSON_OBJECT))
        async for _ in stream:
            break
        await stream.aclose()

    asyncio.run(abort_after_one_event())
    collect(engine, [free_request(0)])  # a step after the abort has been taken
    assert len(matchers) == 4 and all(m.freed for m in matchers)


def test_a_failing_matcher_fails_its_own_request_only(engine: AlbatrossRWKV, matchers: list[TokenMatcher], monkeypatch: pytest.MonkeyPatch) -> None:
    fill = grammar_masks.bitmask_fill
    calls = 0

    def failing_third_fill(rows: Any, out: Any) -> Callable[[], list[int]]:
        nonlocal calls
        calls += 1
        run, third = fill(rows, out), calls == 3 and bool(rows)
        return lambda: run() + [0] if third else run()

    monkeypatch.setattr(grammar_masks, "bitmask_fill", failing_third_fill)
    doomed = GenerationRequest([1, 2], LONG, constraint=JSON_OBJECT)

    async def both() -> list[Any]:
        async def one(request: GenerationRequest) -> list[GenerationEvent]:
            return [event async for event in engine.async_generate(request)]

        return list(await asyncio.gather(one(doomed), one(free_request(1)), return_exceptions=True))

    failed, free = asyncio.run(both())
    # The request's own grammar failed: a 400 for it (the route's reply), the other one untouched.
    assert isinstance(failed, BackendError) and failed.status_code == 400, failed
    assert "output constraint could not be followed" in failed.message
    assert free[-1].finish_reason in ("stop", "length")
    monkeypatch.setattr(grammar_masks, "bitmask_fill", fill)
    assert token_ids(free) == token_ids(collect(engine, [free_request(1)])[0])
    assert matchers and all(m.freed for m in matchers)


def test_a_failed_step_and_a_shutdown_free_their_matchers(tiny_checkpoint: Path, matchers: list[TokenMatcher]) -> None:
    backend = AlbatrossRWKV(str(tiny_checkpoint), worker_num=1, batch_size=4, device="cpu")
    try:
        device_step = backend.core.workers[0].device_step
        assert device_step is not None
        issue = device_step.issue
        failing = {"armed": True}

        def fail_once(plan: Any) -> Any:
            if failing["armed"] and plan.sample_count:
                failing["armed"] = False
                raise RuntimeError("injected step failure")
            return issue(plan)

        device_step.issue = fail_once  # type: ignore[method-assign]
        (failed,) = collect(backend, [GenerationRequest([1, 2], LONG, constraint=JSON_OBJECT)])
        assert failed[-1].finish_reason == "error" and "injected step failure" in (failed[-1].error or "")
        assert len(matchers) == 1 and matchers[0].freed

        async def shut_down_mid_stream() -> list[GenerationEvent | BaseException]:
            seen: list[GenerationEvent | BaseException] = []
            try:
                async for event in backend.async_generate(GenerationRequest([1, 2], LONG, constraint=JSON_OBJECT)):
                    seen.append(event)
                    if len(seen) == 2:
                        await asyncio.to_thread(backend.shutdown)
            except BackendError as error:
                seen.append(error)
            return seen

        seen = asyncio.run(shut_down_mid_stream())
        assert isinstance(seen[-1], BackendError) and seen[-1].status_code == 503
        assert len(matchers) == 2 and all(m.freed for m in matchers)
    finally:
        backend.shutdown()


def test_the_first_request_of_a_new_schema_compiles_it_once(tiny_checkpoint: Path) -> None:
    compiler = ConstraintCompiler(get_tokenizer())
    text = json_schema_grammar({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(20)}})
    assert compiler.cached_grammar(text) is None
    compiled = compiler.compile(text)
    assert compiler.cached_grammar(text) is compiled and compiler.compile(text) is compiled


# ---------------------------------------------------------------------------- on the GPU


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_on_the_gpu_masked_rows_validate_and_free_rows_are_untouched() -> None:
    """CUDA kernels, decode graphs and overlap: the masked rows' answers validate, and greedy free
    rows are token for token what they are alone (the weights of tests/test_engine_cuda.py, whose
    greedy margins stay far above fp16 rounding)."""
    from albatross import cuda_ops
    from albatross.model import RWKV7
    from albatross.random_checkpoint import CheckpointShape, random_state_dict

    cuda_ops.enable_cuda_kernels()
    model = RWKV7.from_state_dict(random_state_dict(CheckpointShape(n_layer=4, n_embd=256), seed=3, device="cuda"), "cuda", torch.float16, progress=False)
    backend = AlbatrossRWKV("gpu-structured", batch_size=16, model=model, device="cuda")
    try:
        assert backend.core.workers[0].overlap
        greedy = SamplingParams(max_tokens=24, temperature=0.0, presence_penalty=0.0, frequency_penalty=0.0)
        free = [GenerationRequest([10 + n, 20, 30 + n], greedy) for n in range(6)]
        schemas = list(SCHEMAS.values())
        constrained = [
            GenerationRequest([40 + n, 50], SamplingParams(max_tokens=200, temperature=1.0, top_p=0.9, seed=n), constraint=grammar_of(schemas[n % len(schemas)]))
            for n in range(9)
        ]
        alone = [token_ids(events) for events in collect(backend, free)]
        mixed = collect(backend, [*free, *constrained])
        assert [token_ids(events) for events in mixed[: len(free)]] == alone
        for n, events in enumerate(mixed[len(free) :]):
            assert events[-1].finish_reason == "stop", events[-1]
            jsonschema.validate(json.loads("".join(e.text for e in events)), schemas[n % len(schemas)])
        assert backend.status()["masked_samples_total"] > 0
    finally:
        backend.shutdown()
