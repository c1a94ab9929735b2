"""The worker feeds the scheduler each step's measured time (the spacing of consecutive steps' ids
on the host), with and without step overlap; the adaptive budget learns only from steps that
carried both prompt chunks and decode rows, and not at all when it is off."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from albatross_engine.adapter import AlbatrossRWKV
from albatross_engine.scheduler import Scheduler, StepPlan
from engine_helpers import WORKER_MODES, collect, token_ids
from runner.interface import GenerationRequest, SamplingParams


def _requests() -> list[GenerationRequest]:
    """A short prompt that decodes for a while, next to long prompts fed in small chunks."""
    decode = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=())
    short = SamplingParams(max_tokens=2, temperature=0.0, stop_token_ids=())
    return [
        GenerationRequest([5, 6, 7], decode, request_id="decoding"),
        *(GenerationRequest(list(range(10, 10 + 40 + 7 * i)), short, request_id=f"long-{i}") for i in range(3)),
    ]


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("target_ms", [500.0, 0.0], ids=["adaptive", "off"])
def test_steps_times_reach_the_scheduler(tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, overlap: bool, target_ms: float) -> None:
    seen: list[tuple[StepPlan, float]] = []
    observe = Scheduler.observe_step

    def recording(self: Scheduler, plan: StepPlan, seconds: float) -> None:
        seen.append((plan, seconds))
        observe(self, plan, seconds)

    monkeypatch.setattr(Scheduler, "observe_step", recording)
    backend = AlbatrossRWKV(str(tiny_checkpoint), 1, 4, device="cpu", prefill_chunk=4, prefill_budget=8, overlap=overlap, itl_target_ms=target_ms)
    try:
        started = time.perf_counter()
        results = collect(backend, _requests())
        wall = time.perf_counter() - started
        budget = backend.core.workers[0]._scheduler.budget  # the worker's own scheduler
    finally:
        backend.shutdown()
    assert [len(token_ids(events)) for events in results] == [24, 2, 2, 2]
    assert seen, "the worker reported step times"
    assert all(seconds > 0 for _, seconds in seen)
    assert sum(seconds for _, seconds in seen) <= wall, "consecutive intervals between steps' ids cannot overlap"
    mixed = [plan for plan, _ in seen if plan.prefill_tokens and plan.decode_tokens]
    assert mixed, "the long prompts were fed next to the decoding stream"
    assert budget.model.steps == (len(mixed) if target_ms else 0)
    assert backend.status()["itl_target_ms"] == target_ms


@pytest.mark.parametrize("worker_mode", WORKER_MODES)
@pytest.mark.parametrize("target_ms", [500.0, 0.0], ids=["adaptive", "off"])
def test_each_workers_budget_fit_is_read_through_the_core(tiny_checkpoint: Path, worker_mode: str, target_ms: float) -> None:
    """The fit lives in the worker's own scheduler, in a worker process too: the core asks for it."""
    backend = AlbatrossRWKV(str(tiny_checkpoint), 1, 4, device="cpu", prefill_chunk=4, prefill_budget=8, overlap=False,
                            itl_target_ms=target_ms, worker_mode=worker_mode)  # fmt: skip
    try:
        results = collect(backend, _requests())
        fits = backend.core.prefill_budget_fits()
    finally:
        backend.shutdown()
    assert [len(token_ids(events)) for events in results] == [24, 2, 2, 2]
    assert len(fits) == 1
    assert fits[0]["itl_target_ms"] == (target_ms or None)
    fit_steps = fits[0]["fit_steps"]
    assert isinstance(fit_steps, int) and (fit_steps > 0 if target_ms else fit_steps == 0)
