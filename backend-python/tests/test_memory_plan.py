"""The memory plan (albatross_engine/memory_plan.py) on the CPU with simulated free memory: exact
weight and state sizes, what is lowered and in which order, the one refusal message, and the
engine that plans before it reads a weight."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import pytest
import torch

from albatross.checkpoint import validate_state_dict
from albatross.constraints import MASK_WORDS
from albatross.model import RWKV7
from albatross.random_checkpoint import NAMED_SHAPES, CheckpointShape, random_state_dict
from albatross.sampler import PenaltyPool
from albatross.state import StatePool
from albatross_engine import worker as worker_module
from albatross_engine.adapter import AlbatrossRWKV, shape_config
from albatross_engine.memory_plan import (
    MIN_PREFILL_BUDGET,
    MemoryPlanError,
    MemoryRequest,
    plan_memory,
    size_label,
    state_bytes,
    weight_bytes,
)
from engine_helpers import collect
from runner.interface import GenerationRequest, SamplingParams

GIB = 1 << 30
SEVEN_B = shape_config(NAMED_SHAPES["7.2b"])


def _request(**changes: object) -> MemoryRequest:
    base = MemoryRequest(SEVEN_B, "int8", 2, 2, batch_size=128, prefill_chunk=128, prefill_budget=16384, cuda_graphs=True, cache_bytes=2 * GIB)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", [CheckpointShape(n_layer=2, n_embd=128), CheckpointShape(n_layer=1, n_embd=64)], ids=["2x128", "1x64"])
@pytest.mark.parametrize("weights", ["fp16", "int8"])
def test_weight_bytes_are_exactly_what_the_model_keeps(shape: CheckpointShape, weights: str) -> None:
    state_dict = random_state_dict(shape, seed=1)
    config = validate_state_dict(state_dict)
    assert shape_config(shape) == config, "the random spec's config is known without generating it"
    for dtype in (torch.float32, torch.bfloat16):
        model = RWKV7.from_state_dict(random_state_dict(shape, seed=1), "cpu", dtype, progress=False, weights=weights)
        assert weight_bytes(config, weights, dtype.itemsize) == model.weight_bytes(), f"{weights} at {dtype}"


def test_state_bytes_are_the_pool_the_scratch_slot_the_penalty_rows_and_the_mask_rows() -> None:
    shape = CheckpointShape(n_layer=2, n_embd=128)
    model = RWKV7.from_state_dict(random_state_dict(shape, seed=1), "cpu", torch.float32, progress=False)
    pool, penalties = StatePool(model, 5, torch.float16), PenaltyPool(4, 65536)
    masks = torch.zeros(4, MASK_WORDS, dtype=torch.int32)  # DeviceStep's device rows of grammar masks
    request = MemoryRequest(model.config, "fp16", 4, 2, batch_size=4, prefill_chunk=64, prefill_budget=256, cuda_graphs=True)
    in_use = pool.nbytes + sum(t.numel() * t.element_size() for t in (penalties.penalties, penalties.seen, masks))
    assert state_bytes(request) == in_use


def test_the_7b_shape_needs_what_the_model_cards_say() -> None:
    assert size_label(SEVEN_B) == "7.2B"
    assert round(weight_bytes(SEVEN_B, "fp16", 2) / 1e9, 1) == 14.5  # with the stacked LoRAs' 33 MB of padding
    assert round(weight_bytes(SEVEN_B, "int8", 2) / 1e9, 1) == 7.8  # the embedding and LoRAs stay 16-bit


def test_a_request_that_fits_runs_as_asked() -> None:
    request = _request()
    plan = plan_memory(request, 40 * GIB)
    assert plan.request == request and plan.lowered == ()
    assert plan.planned_bytes <= 40 * GIB
    status = plan.as_status()
    for key in ("weights_bytes", "states_bytes", "activations_bytes", "graphs_bytes", "cache_bytes", "free_bytes", "batch_size"):
        assert key in status
    assert plan_memory(request, None).lowered == (), "the CPU (no free figure) is never lowered"


def test_what_does_not_fit_is_lowered_cache_first_then_prefill_budget_then_batch() -> None:
    roomy = plan_memory(_request(), 40 * GIB)
    without_cache = roomy.planned_bytes - roomy.cache_bytes - int(0.04 * roomy.cache_bytes)
    plan = plan_memory(_request(), without_cache + GIB // 2)
    assert [phrase.split()[0] for phrase in plan.lowered] == ["state"], plan.lowered
    assert 0 < plan.cache_bytes < 2 * GIB and plan.batch_size == 128

    plan = plan_memory(_request(), 12 * 10**9)  # a 12 GB card: no cache, a smaller prefill budget
    assert plan.cache_bytes == 0 and MIN_PREFILL_BUDGET <= plan.prefill_budget < 16384 and plan.batch_size == 128
    assert plan.lowered == ("state cache L1 2.1 GB -> 0.0 GB", f"prefill_budget 16384 -> {plan.prefill_budget}")
    assert plan.planned_bytes <= 12 * 10**9
    assert plan.prefill_chunk <= plan.prefill_budget

    plan = plan_memory(_request(batch_size=960), 12 * 10**9)
    assert plan.prefill_budget == MIN_PREFILL_BUDGET and 100 < plan.batch_size < 960
    assert plan.lowered[-1] == f"batch 960 -> {plan.batch_size}"
    one_more = plan_memory(dataclasses.replace(plan.request, batch_size=plan.batch_size + 1), None)
    assert one_more.planned_bytes > 12 * 10**9, "the lowered batch is the largest that fits"


def test_fp16_weights_that_do_not_fit_are_refused_with_what_would() -> None:
    with pytest.raises(MemoryPlanError) as refused:
        plan_memory(_request(weights="fp16", batch_size=32), int(11.6e9))
    message = str(refused.value)
    match = re.fullmatch(r"7\.2B fp16 needs 14\.5 GB of weights; this GPU has 11\.6 GB free: use weights=int8 \(7\.8 GB\) with batch up to (\d+)", message)
    assert match, message
    batch = int(match.group(1))
    assert plan_memory(_request(batch_size=batch, prefill_budget=MIN_PREFILL_BUDGET, cache_bytes=0), int(11.6e9)).lowered == ()
    one_more = plan_memory(_request(batch_size=batch + 1, prefill_budget=MIN_PREFILL_BUDGET, cache_bytes=0), int(11.6e9))
    assert one_more.lowered == (f"batch {batch + 1} -> {batch}",), "the suggested batch is the most that fits"


def test_a_model_too_large_even_as_int8_is_refused_saying_so() -> None:
    with pytest.raises(MemoryPlanError, match=r"^7\.2B fp16 needs 14\.5 GB of weights; this GPU has 6\.0 GB free: it does not fit even with weights=int8 \(7\.8 GB\)"):
        plan_memory(_request(weights="fp16"), 6 * 10**9)
    with pytest.raises(MemoryPlanError, match=r"^7\.2B int8 needs 7\.8 GB of weights and .* to run one request; this GPU has 7\.8 GB free: use a smaller model"):
        plan_memory(_request(), int(7.8e9))


def test_weights_already_on_the_device_are_not_counted_twice() -> None:
    resident = weight_bytes(SEVEN_B, "int8", 2)
    fresh = plan_memory(_request(cache_bytes=0), 40 * GIB)
    built = plan_memory(_request(cache_bytes=0, resident_weight_bytes=resident), 40 * GIB)
    assert fresh.planned_bytes - built.planned_bytes >= resident


# ---------------------------------------------------------------------------------------------
# The engine plans at load


def test_the_engine_refuses_a_model_that_cannot_fit_before_reading_a_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_module, "_free_bytes", lambda device: int(11.6e9))
    built: list[object] = []
    monkeypatch.setattr("albatross_engine.model_specs.random_state_dict", lambda *a, **k: built.append(a))
    with pytest.raises(RuntimeError) as refused:
        AlbatrossRWKV("random:7.2b", worker_num=1, batch_size=32, device="cpu", dtype="fp16")
    message = str(refused.value)
    assert "MemoryPlanError: 7.2B fp16 needs 14.5 GB of weights; this GPU has 11.6 GB free: use weights=int8 (7.8 GB) with batch up to" in message
    assert "Traceback" not in message and built == [], "no weight was generated"


def test_the_engine_lowers_the_batch_to_what_fits_and_serves_every_request(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    config = validate_state_dict(random_state_dict(CheckpointShape(n_layer=2, n_embd=128), seed=1))
    three = plan_memory(MemoryRequest(config, "fp16", 4, 4, batch_size=3, prefill_chunk=128, prefill_budget=MIN_PREFILL_BUDGET, cuda_graphs=False), None)
    monkeypatch.setattr(worker_module, "_free_bytes", lambda device: three.planned_bytes + 1000)
    with caplog.at_level(logging.WARNING, logger="albatross_engine.worker"):
        engine = AlbatrossRWKV(str(tiny_checkpoint), worker_num=1, batch_size=8, device="cpu", prefill_budget=16384)
    try:
        lowered = [f"prefill_budget 16384 -> {MIN_PREFILL_BUDGET}", "batch 8 -> 3"]
        assert [r.getMessage() for r in caplog.records if "memory plan" in r.getMessage()] == [
            f"albatross worker 0: memory plan for cpu ({(three.planned_bytes + 1000) / 1e9:.1f} GB free): lowered {'; '.join(lowered)}"
        ]
        plans = engine.status()["memory_plan"]
        assert isinstance(plans, list) and plans[0]["batch_size"] == 3 and plans[0]["lowered"] == lowered
        requests = [GenerationRequest([1, 2, i], SamplingParams(max_tokens=3, temperature=0)) for i in range(5)]
        finished = [events[-1].finish_reason for events in collect(engine, requests)]  # at once: 3 run, 2 wait
        assert finished == ["length"] * 5
    finally:
        engine.shutdown()


def test_status_shows_the_plan_on_the_cpu_without_a_free_figure(tiny_checkpoint: Path) -> None:
    engine = AlbatrossRWKV(str(tiny_checkpoint), worker_num=1, batch_size=2, device="cpu", weights="int8")
    try:
        (plan,) = engine.status()["memory_plan"]  # type: ignore[misc]
        assert plan["free_bytes"] is None and plan["weights"] == "int8" and plan["device"] == "cpu"
        assert plan["weights_bytes"] == engine.core.workers[0].model.weight_bytes()  # type: ignore[union-attr]
    finally:
        engine.shutdown()
