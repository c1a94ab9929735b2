"""Batching never changes a request's output: greedy and seeded results are the same alone, inside
a batch of other requests, in any arrival order, with and without step overlap, and equal to the
model core driven one slot at a time."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from albatross.model import RWKV7
from albatross_engine.adapter import AlbatrossRWKV
from engine_helpers import WORKER_MODES, collect, reference_tokens, token_ids
from runner.interface import GenerationRequest, SamplingParams, StateRef

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3, stop_token_ids=())


@pytest.fixture(scope="module", params=WORKER_MODES)
def engine(request: pytest.FixtureRequest, tiny_checkpoint: Path) -> Iterator[AlbatrossRWKV]:
    backend = AlbatrossRWKV(
        str(tiny_checkpoint), worker_num=1, batch_size=8, prefill_chunk=5, prefill_budget=24, device="cpu", worker_mode=request.param
    )
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def overlapped_engine(tiny_checkpoint: Path) -> Iterator[AlbatrossRWKV]:
    backend = AlbatrossRWKV(str(tiny_checkpoint), worker_num=1, batch_size=8, prefill_chunk=5, overlap=True, device="cpu")
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def reference_model(tiny_checkpoint: Path) -> RWKV7:
    return RWKV7.load(tiny_checkpoint, "cpu", progress=False)


def random_request(rng: random.Random) -> GenerationRequest:
    params = SamplingParams(
        max_tokens=rng.randint(1, 6),
        temperature=rng.choice([0.0, 0.7, 1.0, 1.3]),
        top_p=rng.choice([0.3, 0.9, 1.0]),
        top_k=rng.choice([0, 5, 50]),
        presence_penalty=rng.uniform(0, 1),
        frequency_penalty=rng.uniform(0, 1),
        penalty_decay=rng.choice([0.9, 0.996]),
        stop_token_ids=(),
        seed=rng.randrange(2**64),
    )
    prompt = [rng.randrange(1, 65530) for _ in range(rng.randint(1, 14))]
    return GenerationRequest(prompt_tokens=prompt, sampling=params)


def test_greedy_output_is_the_same_alone_in_a_batch_in_any_order_and_equals_the_model_core(
    engine: AlbatrossRWKV, reference_model: RWKV7
) -> None:
    rng = random.Random(7)
    target = GenerationRequest(prompt_tokens=[rng.randrange(1, 65530) for _ in range(11)], sampling=GREEDY)
    expected = reference_tokens(reference_model, target.prompt_tokens, GREEDY)
    alone = token_ids(collect(engine, [target])[0])
    assert alone == expected, f"alone: engine {alone} != model core {expected}"
    others = [random_request(rng) for _ in range(16)]
    for order in range(2):
        batch = others[:]
        random.Random(order).shuffle(batch)
        position = order * 7 % (len(batch) + 1)
        batch.insert(position, target)
        results = collect(engine, batch)
        got = token_ids(results[position])
        assert got == expected, f"arrival order {order} (position {position}): {got} != {expected}"


def test_the_same_seed_gives_the_same_text_whatever_the_batch(engine: AlbatrossRWKV, reference_model: RWKV7) -> None:
    rng = random.Random(11)
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, stop_token_ids=())
    target = GenerationRequest(prompt_tokens=[rng.randrange(1, 65530) for _ in range(6)], sampling=params)
    expected = reference_tokens(reference_model, target.prompt_tokens, params, seed=1234)
    alone = collect(engine, [target])[0]
    crowded = collect(engine, [random_request(rng) for _ in range(9)] + [target])[-1]
    assert token_ids(alone) == expected, "a seeded request follows the sampler's definition"
    assert token_ids(crowded) == expected, "a seeded request samples the same tokens inside a batch"
    assert "".join(e.text for e in alone) == "".join(e.text for e in crowded)


def test_different_seeds_give_different_text(engine: AlbatrossRWKV) -> None:
    prompt = [101, 2002, 30003, 404]
    requests = [
        GenerationRequest(prompt_tokens=prompt, sampling=SamplingParams(max_tokens=10, temperature=1.5, top_p=1.0, seed=s))
        for s in (1, 2, 3)
    ]
    texts = ["".join(e.text for e in events) for events in collect(engine, requests)]
    assert len(set(texts)) == 3, f"three seeds should give three texts, got {texts}"


def test_step_overlap_does_not_change_any_output(engine: AlbatrossRWKV, overlapped_engine: AlbatrossRWKV) -> None:
    assert overlapped_engine.core.workers[0].overlap and not engine.core.workers[0].overlap
    rng = random.Random(3)
    requests = [random_request(rng) for _ in range(12)]
    requests.append(GenerationRequest(prompt_tokens=[5, 6, 7], sampling=SamplingParams(max_tokens=6, stop=("e",), seed=9)))
    plain = collect(engine, requests)
    overlapped = collect(overlapped_engine, requests)
    for index, (a, b) in enumerate(zip(plain, overlapped)):
        summary_a = (token_ids(a), "".join(e.text for e in a), a[-1].finish_reason, a[-1].completion_tokens)
        summary_b = (token_ids(b), "".join(e.text for e in b), b[-1].finish_reason, b[-1].completion_tokens)
        assert summary_a == summary_b, f"request {index}: without overlap {summary_a}, with overlap {summary_b}"


def test_the_prefill_order_does_not_change_any_output(engine: AlbatrossRWKV, tiny_checkpoint: Path) -> None:
    """Shortest first (the default) and arrival order feed the same prompts in other rows and
    steps; every request's tokens stay the same."""
    arrival = AlbatrossRWKV(
        str(tiny_checkpoint), worker_num=1, batch_size=8, prefill_chunk=5, prefill_budget=24, device="cpu",
        worker_mode="thread", prefill_order="arrival",
    )  # fmt: skip
    try:
        assert (engine.status()["prefill_order"], arrival.status()["prefill_order"]) == ("shortest", "arrival")
        rng = random.Random(5)
        requests = [random_request(rng) for _ in range(14)]
        for a, b in zip(collect(engine, requests), collect(arrival, requests), strict=True):
            assert token_ids(a) == token_ids(b)
    finally:
        arrival.shutdown()


def test_usage_counts_are_exact_and_the_last_event_carries_the_finish_reason(engine: AlbatrossRWKV) -> None:
    request = GenerationRequest(prompt_tokens=[11, 12, 13, 14, 15, 16, 17], sampling=GREEDY)
    events = collect(engine, [request])[0]
    assert [e.finish_reason for e in events[:-1]] == [None] * (len(events) - 1)
    last = events[-1]
    assert last.finish_reason == "length" and last.completion_tokens == GREEDY.max_tokens
    # A caller that falls behind gets several tokens in one event: count what each event carries.
    delivered = [len(e.token_ids) for e in events]
    assert [e.completion_tokens for e in events] == [sum(delivered[: i + 1]) for i in range(len(events))]
    assert all(e.prompt_tokens == 7 for e in events), "prompt usage is the prompt's length"


def test_a_stop_token_ends_the_request_without_emitting_it(engine: AlbatrossRWKV, reference_model: RWKV7) -> None:
    prompt = [42, 43, 44]
    free_run = reference_tokens(reference_model, prompt, GREEDY)
    stop_token = free_run[3]
    first = free_run.index(stop_token)
    params = SamplingParams(max_tokens=12, temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3, stop_token_ids=(stop_token,))
    events = collect(engine, [GenerationRequest(prompt_tokens=prompt, sampling=params)])[0]
    assert events[-1].finish_reason == "stop"
    assert token_ids(events) == free_run[:first], "tokens before the stop token, without it"
    assert events[-1].completion_tokens == first + 1, "the stop token counts as generated"


def test_with_overlap_the_previous_steps_results_go_out_before_this_steps_saves_are_queued(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU the prompt-end saves of step N+1 (several copies each) can block in a full launch
    queue; queued before step N's results were processed, they held N's tokens back. Every save
    now comes after every issued step but the newest has been processed and its events sent."""
    from albatross_engine.device_step import DeviceStep
    from albatross_engine.results import ResultProcessor
    from albatross_engine.saved_states import SavedStates
    from albatross_engine.state_cache import StateCache
    from albatross_engine.tasks import EventOutbox

    order: list[str] = []
    steps = ((DeviceStep, "issue", "issue"), (ResultProcessor, "process", "process"), (EventOutbox, "flush", "flush"), (SavedStates, "save_prefix", "save"))
    for cls, name, tag in steps:
        original = getattr(cls, name)

        def recorded(self, *args, _original=original, _tag=tag, **kwargs):  # type: ignore[no-untyped-def]
            result = _original(self, *args, **kwargs)
            order.append(_tag)
            return result

        monkeypatch.setattr(cls, name, recorded)
    # A budget of 10 prompt tokens a step ends the prompts in different steps, each behind a step in flight.
    backend = AlbatrossRWKV(str(tiny_checkpoint), 1, 8, prefill_chunk=5, prefill_budget=10, overlap=True, device="cpu",
                            state_store_factory=lambda fingerprint, device: StateCache(tmp_path / "s.sqlite3", fingerprint, device=device))  # fmt: skip
    try:
        rng = random.Random(3)
        requests = [GenerationRequest([rng.randrange(1, 65530) for _ in range(rng.randint(12, 30))], SamplingParams(max_tokens=4, temperature=0.0, stop=()), state=StateRef(use_prefix_cache=True))
                    for _ in range(8)]  # fmt: skip
        collect(backend, requests)
    finally:
        backend.shutdown()
    saves = [i for i, tag in enumerate(order) if tag == "save"]
    assert len(saves) >= 8, order  # every prompt's end was saved
    assert any(order[:at].count("issue") >= 2 for at in saves), f"no save came behind a step in flight: {order}"
    for at in saves:
        issued, processed = order[:at].count("issue"), order[:at].count("process")
        assert processed >= issued - 1, f"a save queued while {issued - processed} issued steps were unprocessed: {order[: at + 1]}"
        last_process = max((i for i in range(at) if order[i] == "process"), default=-1)
        assert last_process < 0 or "flush" in order[last_process:at], f"a save queued before the processed step's events were sent: {order[: at + 1]}"
