"""What crosses a worker process's pipe: events and errors come back as they went (the caller cannot
tell a worker process from a worker thread), and a task rebuilt from its spec is the same task."""

from __future__ import annotations

import pickle
from dataclasses import fields

import pytest
import torch

from albatross.constraints import ConstraintCompiler, json_schema_grammar
from albatross.state import SlotState
from albatross.tokenizer import get_tokenizer
from albatross_engine import process_boundary as wire
from albatross_engine.initial_state import EngineInitialState, slot_state_from_wkv
from albatross_engine.tasks import EngineTask, RemoteChannel, SyncChannel
from runner.interface import BackendError, GenerationEvent, SamplingParams, TokenLogprob


def crossed(item: GenerationEvent | BackendError, prompt_tokens: int) -> GenerationEvent | BaseException:
    packed = pickle.loads(pickle.dumps(wire.pack_item(7, item)))
    assert packed[0] == 7, "a packed item names its task"
    return wire.unpack_item(packed, prompt_tokens)


def test_an_event_with_logprobs_crosses_unchanged() -> None:
    event = GenerationEvent(
        text="héllo", token_ids=[5, 6], finish_reason=None, prompt_tokens=12, completion_tokens=2, cached_prompt_tokens=256,
        logprobs=[TokenLogprob(5, "h", -0.5, [(5, "h", -0.5), (9, "x", -1.5)]), TokenLogprob(6, "éllo", -0.25, [])],
    )  # fmt: skip
    assert crossed(event, prompt_tokens=12) == event


def test_a_final_error_event_crosses_unchanged_and_is_final() -> None:
    event = GenerationEvent(finish_reason="error", prompt_tokens=3, completion_tokens=1, error="ValueError: bad id")
    back = crossed(event, prompt_tokens=3)
    assert back == event and wire.is_final(back)
    assert not wire.is_final(GenerationEvent(text="a", token_ids=[1]))


def test_a_backend_error_keeps_its_status_and_message() -> None:
    back = crossed(BackendError(404, "state 'x' not found"), prompt_tokens=1)
    assert isinstance(back, BackendError) and (back.status_code, back.message) == (404, "state 'x' not found")
    assert wire.is_final(back)


def test_a_task_rebuilt_from_its_spec_keeps_every_field_fixed_at_submit() -> None:
    sampling = SamplingParams(max_tokens=9, temperature=0.7, stop=("\n\n",), seed=5, logprobs=2)
    task = EngineTask([1, 2, 3], sampling, seed=5, channel=SyncChannel(), request_id="r1", save_key="s", use_prefix_cache=False,
                      penalized_prompt_ids=[2, 3])  # fmt: skip
    spec = pickle.loads(pickle.dumps(wire.task_spec(task)))
    copy = wire.task_from_spec(spec, RemoteChannel(task.task_id), wire.TaskContext(get_tokenizer()))
    fixed = ("task_id", "prompt_tokens", "sampling", "seed", "request_id", "load_key", "save_key", "use_prefix_cache",
             "initial_state", "penalized_prompt_ids")  # fmt: skip
    assert {name: getattr(copy, name) for name in fixed} == {name: getattr(task, name) for name in fixed}
    assert isinstance(copy.channel, RemoteChannel) and copy.channel.task_id == task.task_id


def test_a_state_files_initial_state_crosses_by_its_id_not_with_every_task() -> None:
    wkv = torch.randn(2, 2, 64, 64)
    initial = EngineInitialState("tuned", slot_state_from_wkv(wkv, 128))
    task = EngineTask([1], SamplingParams(max_tokens=1), seed=0, channel=SyncChannel(), initial_state=initial)
    spec = wire.task_spec(task)
    assert spec.values["initial_state"] == "tuned" and len(pickle.dumps(spec)) < 2000, "no tensor rides along with the task"
    context = wire.TaskContext(get_tokenizer())
    context.initial_states["tuned"] = EngineInitialState("tuned", SlotState.from_bytes(initial.state.to_bytes()))
    copy = wire.task_from_spec(pickle.loads(pickle.dumps(spec)), RemoteChannel(task.task_id), context)
    assert copy.initial_state is context.initial_states["tuned"] and torch.equal(copy.initial_state.state.wkv, wkv)


def test_a_worker_process_compiles_a_grammar_from_its_text_once_and_its_matchers_enforce_it() -> None:
    """The compiled grammar (llguidance objects) does not pickle; its text does, and the worker
    process's own compiler makes the same grammar of it, once per text."""
    text = json_schema_grammar({"type": "boolean"})
    compiled = ConstraintCompiler(get_tokenizer()).compile(text)
    with pytest.raises(TypeError):
        pickle.dumps(compiled)
    context = wire.TaskContext(get_tokenizer())
    first, again = context.grammar(text), context.grammar(text)
    assert first is again and first.text == text
    matcher = first.matcher()
    tokenizer = get_tokenizer()
    for token in tokenizer.encode("true"):
        assert matcher.advance(token)
    assert matcher.can_end()
    refused = first.matcher()
    assert not refused.advance(tokenizer.encode("7")[0])


@pytest.mark.skipif("grammar" not in {f.name for f in fields(EngineTask)}, reason="EngineTask carries no grammar yet (the engine's constraints)")
def test_a_tasks_grammar_crosses_as_its_text_and_is_rebuilt_in_the_worker_process() -> None:
    text = json_schema_grammar({"type": "boolean"})
    compiled = ConstraintCompiler(get_tokenizer()).compile(text)
    task = EngineTask([1], SamplingParams(max_tokens=4), seed=0, channel=SyncChannel(), grammar=compiled)  # type: ignore[call-arg]
    spec = pickle.loads(pickle.dumps(wire.task_spec(task)))
    assert spec.values["grammar"] == text
    copy = wire.task_from_spec(spec, RemoteChannel(task.task_id), wire.TaskContext(get_tokenizer()))
    assert copy.grammar is not compiled and copy.grammar.text == text  # type: ignore[attr-defined]


def test_plain_deltas_handed_on_unbuilt_merge_into_the_event_their_events_would_merge_into() -> None:
    from albatross_engine.tasks import merge_events

    events = [
        GenerationEvent(text="Hel", token_ids=[1], prompt_tokens=4, completion_tokens=1, cached_prompt_tokens=2),
        GenerationEvent(text="lo", token_ids=[2, 3], prompt_tokens=4, completion_tokens=3, cached_prompt_tokens=2),
        GenerationEvent(text="!", token_ids=[4], finish_reason="length", prompt_tokens=4, completion_tokens=4, cached_prompt_tokens=2),
    ]
    packed = [wire.pack_item(9, event) for event in events]
    assert [wire.is_plain_delta(p) for p in packed] == [True, True, False], "a final event is never handed on unbuilt"
    assert [wire.is_final(p) for p in packed] == [False, False, True]
    expected = merge_events(events[0], events[1:])
    assert wire.merge_items(packed[0], [packed[1], events[2]], prompt_tokens=4) == expected
    assert wire.merge_items(packed[0], [packed[1]], prompt_tokens=4) == merge_events(events[0], events[1:2])
    assert wire.merge_items(packed[0], [], prompt_tokens=4) == events[0]


def test_the_grammar_compiler_is_built_once_and_can_be_warmed_ahead() -> None:
    context = wire.TaskContext(get_tokenizer())
    context.warm_in_background().join(timeout=60)
    compiler = context.compiler()
    assert context.compiler() is compiler
    grammar = context.grammar('start: "a"\n')
    assert grammar is compiler.compile('start: "a"\n')  # one compiler, one cache
