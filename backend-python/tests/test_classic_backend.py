"""The classic backend reproduces the official package's greedy continuation and honours limits,
stops, seeds, logprobs and aborts."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from albatross.sampler import top_logprobs
from runner.classic_backend import VALID_STRATEGIES, ClassicRWKV, create_backend, normalize_strategy, rwkv_model_module
from runner.interface import BackendError, GenerationEvent, GenerationRequest, SamplingParams, StateRef

GREEDY = SamplingParams(
    max_tokens=8, temperature=0.0, presence_penalty=0.0, frequency_penalty=0.0, penalty_decay=1.0, stop_token_ids=()
)
PROMPT = "User: Tell me a story.\n\nAssistant:"


@pytest.fixture(scope="module")
def backend(tiny_checkpoint: Path) -> ClassicRWKV:
    return create_backend(str(tiny_checkpoint), "cpu fp32", None)


@pytest.fixture(scope="module")
def package_model(tiny_checkpoint: Path, backend: ClassicRWKV) -> Any:
    """A second, independent instance of the official package's model on the same checkpoint."""
    return rwkv_model_module().RWKV(str(tiny_checkpoint.with_suffix("")), "cpu fp32")


@pytest.fixture(scope="module")
def greedy_run(backend: ClassicRWKV) -> list[GenerationEvent]:
    """Twenty greedy tokens of PROMPT without any stop: the baseline the stop tests cut."""
    return list(backend.generate(GenerationRequest(backend.encode(PROMPT), replace(GREEDY, max_tokens=20))))


def _ids(events: list[GenerationEvent]) -> list[int]:
    return [token_id for event in events for token_id in event.token_ids]


def _text(events: list[GenerationEvent]) -> str:
    return "".join(event.text for event in events)


def test_greedy_tokens_equal_the_packages_own_greedy_continuation(backend: ClassicRWKV, package_model: Any) -> None:
    prompt = backend.encode(PROMPT)
    events = list(backend.generate(GenerationRequest(prompt, GREEDY)))

    logits, state = package_model.forward(list(prompt), None)
    expected: list[int] = []
    for _ in range(GREEDY.max_tokens):
        expected.append(int(torch.argmax(logits)))
        logits, state = package_model.forward([expected[-1]], state)

    assert _ids(events) == expected
    assert [event.completion_tokens for event in events] == list(range(1, GREEDY.max_tokens + 1))
    assert events[-1].finish_reason == "length" and all(event.finish_reason is None for event in events[:-1])
    assert all(event.prompt_tokens == len(prompt) for event in events)
    assert _text(events) == backend.decode(expected)


def test_backend_describes_itself_by_the_checkpoint_stem(backend: ClassicRWKV, tiny_checkpoint: Path) -> None:
    assert backend.name == tiny_checkpoint.stem == "rwkv7-tiny"
    assert (backend.version, backend.tokenizer_len, backend.backend_name, backend.concurrent) == (7, 65536, "classic", False)
    assert backend.status()["strategy"] == "cpu fp32"
    assert backend.decode(backend.encode("héllo 世界")) == "héllo 世界"


def test_max_tokens_ends_with_length_and_zero_generates_nothing(backend: ClassicRWKV) -> None:
    prompt = backend.encode("Hi")
    events = list(backend.generate(GenerationRequest(prompt, replace(GREEDY, max_tokens=3))))
    assert len(_ids(events)) == 3 and events[-1].finish_reason == "length" and events[-1].completion_tokens == 3
    nothing = list(backend.generate(GenerationRequest(prompt, replace(GREEDY, max_tokens=0))))
    assert len(nothing) == 1 and nothing[0].finish_reason == "length"
    assert (nothing[0].completion_tokens, nothing[0].prompt_tokens, nothing[0].text) == (0, len(prompt), "")


def test_stop_string_cuts_the_text_and_counts_tokens_up_to_the_match(
    backend: ClassicRWKV, greedy_run: list[GenerationEvent]
) -> None:
    full_text = _text(greedy_run)
    token_texts = [backend.decode(_ids(greedy_run)[: n + 1]) for n in range(20)]
    assert len(full_text) >= 12, f"the baseline text is too short to cut: {full_text!r}"
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
    cut = full_text.index(stop)
    tokens_needed = next(n + 1 for n, text in enumerate(token_texts) if stop in text)

    events = list(backend.generate(GenerationRequest(backend.encode(PROMPT), replace(GREEDY, max_tokens=20, stop=(stop,)))))
    assert _text(events) == full_text[:cut], f"stop {stop!r} should cut the text at {cut}"
    assert events[-1].finish_reason == "stop"
    assert events[-1].completion_tokens == tokens_needed


def test_stop_token_id_ends_generation_and_is_counted(backend: ClassicRWKV, greedy_run: list[GenerationEvent]) -> None:
    baseline = _ids(greedy_run)
    stop_id = baseline[4]
    first = baseline.index(stop_id)
    events = list(backend.generate(GenerationRequest(backend.encode(PROMPT), replace(GREEDY, max_tokens=20, stop_token_ids=(stop_id,)))))
    assert _ids(events) == baseline[: first + 1]
    assert events[-1].finish_reason == "stop" and events[-1].completion_tokens == first + 1
    assert _text(events) == backend.decode(baseline[:first])


def test_same_seed_gives_the_same_sampled_tokens_sync_and_async(backend: ClassicRWKV) -> None:
    sampling = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=1234, stop_token_ids=())
    request = GenerationRequest(backend.encode(PROMPT), sampling)
    first = _ids(list(backend.generate(request)))

    async def collect() -> list[GenerationEvent]:
        return [event async for event in backend.async_generate(request)]

    assert _ids(asyncio.run(collect())) == first
    other_seed = _ids(list(backend.generate(GenerationRequest(request.prompt_tokens, replace(sampling, seed=99)))))
    assert other_seed != first, "a different seed should sample differently on a random model at temperature 1"


def test_logprobs_report_the_chosen_token_and_the_top_k(backend: ClassicRWKV, package_model: Any) -> None:
    prompt = backend.encode(PROMPT)
    events = list(backend.generate(GenerationRequest(prompt, replace(GREEDY, max_tokens=2, logprobs=3))))
    logits, _ = package_model.forward(list(prompt), None)
    expected = top_logprobs(logits[None], 3)
    first = events[0].logprobs
    assert first is not None and len(first) == 1
    entry = first[0]
    assert entry.token_id == events[0].token_ids[0] == int(expected.top_ids[0, 0])
    assert [top_id for top_id, _, _ in entry.top] == expected.top_ids[0].tolist()
    assert math.isclose(entry.logprob, float(expected.top_values[0, 0]), abs_tol=1e-4)
    assert entry.logprob == entry.top[0][2], "greedy picks the most likely token"
    assert all(event.logprobs is None for event in backend.generate(GenerationRequest(prompt, replace(GREEDY, max_tokens=2))))


def test_closing_the_async_iterator_aborts_the_generation(backend: ClassicRWKV, monkeypatch: pytest.MonkeyPatch) -> None:
    forward_calls = 0
    real_forward = backend._model.forward

    def counting_forward(tokens: list[int], state: Any) -> Any:
        nonlocal forward_calls
        forward_calls += 1
        return real_forward(tokens, state)

    monkeypatch.setattr(backend, "_model", _ForwardProxy(backend._model, counting_forward))

    async def read_two_then_close() -> list[GenerationEvent]:
        iterator = backend.async_generate(GenerationRequest(backend.encode(PROMPT), replace(GREEDY, max_tokens=10_000)))
        seen = [await iterator.__anext__(), await iterator.__anext__()]
        await iterator.aclose()
        await asyncio.to_thread(_wait_for_lock, backend._model_lock)
        return seen

    seen = asyncio.run(read_two_then_close())
    assert [event.completion_tokens for event in seen] == [1, 2]
    assert forward_calls < 10, f"the loop ran {forward_calls} forwards after the client left"


def test_an_abort_flag_ends_the_loop_with_finish_reason_abort(backend: ClassicRWKV) -> None:
    abort = threading.Event()
    events: list[GenerationEvent] = []
    for event in backend._generate(GenerationRequest(backend.encode("Hi"), replace(GREEDY, max_tokens=50)), abort):
        events.append(event)
        if len(events) == 3:
            abort.set()
    assert events[-1].finish_reason == "abort"
    assert events[-1].completion_tokens == 3 and len(_ids(events)) == 3


def test_requests_with_a_state_are_refused(backend: ClassicRWKV) -> None:
    request = GenerationRequest(backend.encode("Hi"), GREEDY, state=StateRef(save_key="session-1"))
    with pytest.raises(BackendError) as refused:
        list(backend.generate(request))
    assert refused.value.status_code == 400 and "albatross" in refused.value.message

    async def first_event() -> GenerationEvent:
        return await backend.async_generate(request).__anext__()

    with pytest.raises(BackendError, match="state sessions need the albatross backend"):
        asyncio.run(first_event())


def test_prompt_ids_outside_the_vocabulary_are_refused(backend: ClassicRWKV) -> None:
    with pytest.raises(BackendError, match="prompt token ids"):
        list(backend.generate(GenerationRequest([5, 70000], GREEDY)))


def test_strategies_are_validated_with_the_valid_ones_listed() -> None:
    assert normalize_strategy("  CPU   fp32 ") == "cpu fp32"
    with pytest.raises(ValueError) as invalid:
        normalize_strategy("cpu fp64")
    assert all(valid in str(invalid.value) for valid in VALID_STRATEGIES)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            normalize_strategy("cuda fp16")


def test_a_missing_checkpoint_is_reported(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        create_backend(str(tmp_path / "absent.pth"), "cpu fp32", None)


def test_cpu_bf16_loads_generates_and_leaves_an_fp32_model_intact(tiny_checkpoint: Path, backend: ClassicRWKV) -> None:
    prompt = backend.encode("Hi")
    fp32_before = _ids(list(backend.generate(GenerationRequest(prompt, replace(GREEDY, max_tokens=3)))))
    bf16 = create_backend(tiny_checkpoint, "cpu bf16", None)
    try:
        events = list(bf16.generate(GenerationRequest(prompt, replace(GREEDY, max_tokens=2))))
        assert len(_ids(events)) == 2 and events[-1].finish_reason == "length"
        fp32_after = _ids(list(backend.generate(GenerationRequest(prompt, replace(GREEDY, max_tokens=3)))))
        assert fp32_after == fp32_before, "loading a bf16 model changed the fp32 model's output"
    finally:
        bf16.shutdown()


def test_shutdown_refuses_later_requests(tiny_checkpoint: Path, backend: ClassicRWKV) -> None:
    other = create_backend(tiny_checkpoint, "cpu fp32", None)
    other.shutdown()
    with pytest.raises(BackendError) as refused:
        list(other.generate(GenerationRequest([5], GREEDY)))
    assert refused.value.status_code == 503


class _ForwardProxy:
    """The package model with `forward` replaced (ScriptModule attributes cannot be patched)."""

    def __init__(self, model: Any, forward: Any) -> None:
        self._model = model
        self.forward = forward

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def _wait_for_lock(lock: threading.Lock) -> None:
    with lock:
        pass



def test_importing_the_package_leaves_torchs_matmul_precision_alone() -> None:
    """`rwkv.model` turns TF32 on for the whole process when imported; through rwkv_model_module
    the flags stay as they were (a fresh interpreter: this one imported the package already)."""
    script = (
        "import torch\n"
        "from runner.classic_backend import rwkv_model_module\n"
        "flags = lambda: (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)\n"
        "before = flags()\n"
        "module = rwkv_model_module()\n"
        "assert hasattr(module, 'RWKV_x070'), 'not the RWKV-7 family'\n"
        "assert flags() == before == (False, True, False), (before, flags())\n"
        "import importlib; importlib.reload(module)\n"
        "assert flags() != before, 'the package no longer sets the flags: this guard can go'\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=Path(__file__).parent.parent, timeout=120)
