"""Failures stay contained: a bad task ends alone, a failed step fails only its tasks, a dead
engine answers 503 at once, a failed load is reported at start-up, and shutdown leaves no thread."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import albatross_engine.worker as worker_module
from albatross.detokenizer import TextStream
from albatross_engine.adapter import AlbatrossRWKV
from albatross_engine.config import AlbatrossBackendConfig
from albatross_engine.core import EngineCore
from albatross_engine.worker import Worker
from albatross.tokenizer import get_tokenizer
from runner.interface import BackendError, GenerationEvent, GenerationRequest, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=())


@pytest.fixture()
def engine(tiny_checkpoint: Path) -> Iterator[AlbatrossRWKV]:
    backend = AlbatrossRWKV(str(tiny_checkpoint), worker_num=1, batch_size=4, device="cpu")
    yield backend
    backend.shutdown()


async def _collect(backend: AlbatrossRWKV, request: GenerationRequest) -> list[GenerationEvent] | BaseException:
    try:
        return [event async for event in backend.async_generate(request)]
    except BackendError as error:
        return error


def run_all(backend: AlbatrossRWKV, requests: list[GenerationRequest]) -> list[list[GenerationEvent] | BaseException]:
    async def run() -> list[list[GenerationEvent] | BaseException]:
        return list(await asyncio.gather(*(_collect(backend, r) for r in requests)))

    return asyncio.run(run())


def engine_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("albatross-")]


def test_a_bad_token_id_ends_only_its_own_request_with_an_error_event(engine: AlbatrossRWKV) -> None:
    good = GenerationRequest([1, 2, 3], GREEDY)
    results = run_all(engine, [good, GenerationRequest([1, 70000], GREEDY), good])
    bad = results[1]
    assert isinstance(bad, list) and bad[-1].finish_reason == "error", f"got {bad}"
    assert "70000" in (bad[-1].error or "") or "token" in (bad[-1].error or ""), bad[-1].error
    for events in (results[0], results[2]):
        assert isinstance(events, list) and events[-1].finish_reason == "length" and events[-1].completion_tokens == 6


class BuggyTextStream(TextStream):
    """A stop matcher with a bug that fires for requests whose stop list contains "boom"."""

    def __init__(self, tokenizer: object, stops: tuple[str, ...] = ()) -> None:
        super().__init__(tokenizer, stops)  # type: ignore[arg-type]
        self.buggy = "boom" in stops

    def push_token(self, token_id: int) -> tuple[str, bool]:
        if self.buggy:
            raise RuntimeError("stop matcher bug")
        return super().push_token(token_id)


def test_an_exception_in_one_tasks_text_processing_ends_only_that_task(
    engine: AlbatrossRWKV, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker_module, "TextStream", BuggyTextStream)
    expected = run_all(engine, [GenerationRequest([5, 6, 7], GREEDY)])[0]
    buggy = GenerationRequest([5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0, stop=("boom",)))
    results = run_all(engine, [GenerationRequest([5, 6, 7], GREEDY), buggy, GenerationRequest([5, 6, 7], GREEDY)])
    failed = results[1]
    assert isinstance(failed, list) and failed[-1].finish_reason == "error"
    assert "stop matcher bug" in (failed[-1].error or "")
    for events in (results[0], results[2]):
        assert isinstance(events, list) and isinstance(expected, list)
        assert [e.token_ids for e in events] == [e.token_ids for e in expected], "a neighbour's output changed"


def test_a_failed_step_fails_its_tasks_and_the_worker_recovers(engine: AlbatrossRWKV) -> None:
    worker = engine.core.workers[0]
    model = worker.model
    assert model is not None
    real_forward = model.forward_ids  # a step with prompt chunks
    poison = 4242

    def forward(pool: object, slots: list[int], lengths: list[int], token_ids: torch.Tensor, cuts: object = None) -> object:
        if poison in token_ids.tolist():
            raise RuntimeError("kernel failure")
        return real_forward(pool, slots, lengths, token_ids, cuts)  # type: ignore[arg-type]

    model.forward_ids = forward  # type: ignore[method-assign]
    try:
        failed = run_all(engine, [GenerationRequest([1, poison], GREEDY)])[0]
        assert isinstance(failed, list) and failed[-1].finish_reason == "error"
        assert "kernel failure" in (failed[-1].error or "")
        healthy = run_all(engine, [GenerationRequest([1, 2], GREEDY)])[0]
        assert isinstance(healthy, list) and healthy[-1].finish_reason == "length", "the worker recovered"
    finally:
        del model.forward_ids  # type: ignore[method-assign]


def test_when_the_engine_dies_waiting_and_later_requests_get_503_at_once(engine: AlbatrossRWKV) -> None:
    worker = engine.core.workers[0]
    assert worker.model is not None and worker.device_step is not None

    def lost(*args: object, **kwargs: object) -> None:
        raise RuntimeError("device lost")

    worker.model.forward_ids = lost  # type: ignore[method-assign]
    worker.device_step.reset_slots = lost  # type: ignore[method-assign]  # slot resets fail too: the worker dies
    results = run_all(engine, [GenerationRequest([1, 2, 3], GREEDY) for _ in range(8)])  # 4 slots: 4 wait
    for result in results:
        if isinstance(result, BackendError):
            assert result.status_code == 503
        else:  # the step's own tasks may end with the step's error first
            assert result[-1].finish_reason == "error", result
    assert sum(isinstance(r, BackendError) for r in results) >= 4, "the waiting requests got 503"
    later = run_all(engine, [GenerationRequest([1, 2, 3], GREEDY)])[0]
    assert isinstance(later, BackendError) and later.status_code == 503, f"a later request got {later}"
    assert "not running" in later.message or "died" in later.message


def test_switching_models_twice_leaves_no_engine_thread(tiny_checkpoint: Path) -> None:
    for _ in range(2):
        backend = AlbatrossRWKV(str(tiny_checkpoint), worker_num=1, batch_size=2, device="cpu")
        assert engine_threads() == ["albatross-worker-0"], "one thread per worker, none besides"
        backend.shutdown()
    assert engine_threads() == [], f"threads left behind: {engine_threads()}"


def test_a_running_engine_freezes_startup_objects_and_shutdown_restores_the_collector(tiny_checkpoint: Path) -> None:
    from albatross_engine import gc_policy

    if gc_policy._running:
        pytest.skip("another engine of this process is still running")
    """What the policy promises is that what the engine froze is thawed and collectable again, and
    the thresholds are back. Not that the process-wide freeze count is 0: other code may freeze
    objects of its own (on the H200 image 375 objects were frozen after the engine's shutdown), and
    the policy must not count on knowing about it."""
    before = gc.get_threshold()
    frozen_before = gc.get_freeze_count()
    backend = AlbatrossRWKV(str(tiny_checkpoint), worker_num=1, batch_size=2, device="cpu")
    model = weakref.ref(backend.core.workers[0].model)
    frozen_running = gc.get_freeze_count()
    assert gc.get_threshold()[0] >= gc_policy.GEN0_THRESHOLD and frozen_running > frozen_before
    backend.shutdown()
    frozen_after = gc.get_freeze_count()
    assert gc.get_threshold() == before
    assert frozen_after < frozen_running // 10, (
        f"freeze count {frozen_before} before the engine, {frozen_running} while it ran, {frozen_after} after its shutdown"
    )
    del backend
    gc.collect()
    assert model() is None, "the shut-down engine's model is still alive (still frozen?)"


def test_a_missing_checkpoint_fails_initialization_with_the_documented_prefix(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="^Albatross engine initialization failed"):
        AlbatrossRWKV(str(tmp_path / "absent.pth"))
    assert engine_threads() == []


def test_a_worker_that_dies_while_loading_weights_fails_initialization(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.pth"
    corrupt.write_bytes(b"not a checkpoint")
    with pytest.raises(RuntimeError, match=r"^Albatross engine initialization failed: worker \d"):
        AlbatrossRWKV(str(corrupt), worker_num=2, device="cpu")
    assert engine_threads() == []


def test_a_load_that_never_finishes_fails_initialization_after_the_timeout() -> None:
    release = threading.Event()

    def stuck_loader(device: torch.device) -> object:
        release.wait()
        raise RuntimeError("released")

    worker = Worker(0, torch.device("cpu"), stuck_loader, AlbatrossBackendConfig(batch_size=1), get_tokenizer())  # type: ignore[arg-type]
    core = EngineCore([worker])
    try:
        with pytest.raises(RuntimeError, match="^Albatross engine initialization failed: .*did not load within"):
            core.start(timeout=0.2)
    finally:
        release.set()
        core.shutdown()
    assert engine_threads() == []


def test_requests_after_shutdown_get_503(tiny_checkpoint: Path) -> None:
    backend = AlbatrossRWKV(str(tiny_checkpoint), worker_num=1, batch_size=1, device="cpu")
    backend.shutdown()
    result = run_all(backend, [GenerationRequest([1], GREEDY)])[0]
    assert isinstance(result, BackendError) and result.status_code == 503
