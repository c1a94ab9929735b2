"""AlbatrossRWKV as the runner sees it: identity, defaults, errors, status, the factory, model specs
and placement over several workers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from albatross.model import RWKV7
from albatross.random_checkpoint import CheckpointShape, random_state_dict
from albatross_engine.adapter import AlbatrossRWKV, create_backend, parse_random_spec
from runner.interface import AbstractRWKV, BackendError, GenerationEvent, GenerationRequest, OutputConstraint, SamplingDefaults, SamplingParams
from runner.settings import ServerSettings


@pytest.fixture(scope="module")
def backend(tiny_checkpoint: Path) -> Iterator[AlbatrossRWKV]:
    engine = AlbatrossRWKV(str(tiny_checkpoint), worker_num=1, batch_size=3, device="cpu")
    yield engine
    engine.shutdown()


def test_it_presents_the_documented_identity_and_sampling_defaults(backend: AlbatrossRWKV) -> None:
    assert isinstance(backend, AbstractRWKV)
    assert backend.name == "rwkv7-tiny", "the name is the checkpoint file stem"
    assert (backend.version, backend.tokenizer_len, backend.backend_name) == (7, 65536, "albatross")
    assert backend.concurrent is True
    assert backend.defaults == SamplingDefaults(
        temperature=1.0, top_p=0.3, top_k=0, presence_penalty=0.0, frequency_penalty=1.0, penalty_decay=0.996
    )


def test_encode_and_decode_round_trip(backend: AlbatrossRWKV) -> None:
    text = "Hello, 世界 🌍"
    assert backend.decode(backend.encode(text)) == text


def test_run_rnn_is_refused_with_a_helpful_message(backend: AlbatrossRWKV) -> None:
    with pytest.raises(NotImplementedError, match="batch inference.*generate"):
        backend.run_rnn([1, 2])


def test_a_grammar_that_cannot_be_enforced_and_a_bias_outside_the_vocabulary_are_400s(backend: AlbatrossRWKV) -> None:
    broken = GenerationRequest([1, 2], SamplingParams(max_tokens=2), constraint=OutputConstraint("start: missing_rule", "tools"))
    with pytest.raises(BackendError, match="^tools: the grammar cannot be enforced") as refused:
        list(backend.generate(broken))
    assert refused.value.status_code == 400
    with pytest.raises(BackendError, match=r"logit_bias token ids must lie in \[0, 65536\); got \[70000\]") as refused:
        list(backend.generate(GenerationRequest([1, 2], SamplingParams(max_tokens=2, logit_bias=((70000, 1.0),)))))
    assert refused.value.status_code == 400
    assert len(list(backend.generate(GenerationRequest([1, 2], SamplingParams(max_tokens=2))))) >= 1, "the engine keeps serving"


def test_a_constrained_request_produces_its_grammar_and_stops_there(backend: AlbatrossRWKV) -> None:
    request = GenerationRequest([1, 2], SamplingParams(max_tokens=50), constraint=OutputConstraint('start: "yes" | "no"', "test"))
    events = list(backend.generate(request))
    assert "".join(e.text for e in events) in ("yes", "no")
    assert events[-1].finish_reason == "stop"


def test_status_shows_the_effective_config_and_live_metrics(backend: AlbatrossRWKV) -> None:
    list(backend.generate(GenerationRequest([1, 2], SamplingParams(max_tokens=2, temperature=0))))
    status = backend.status()
    for key in ("worker_num", "batch_size", "device", "dtype", "active_slots", "queue_depth", "step_time_ms",
                "decode_tokens_per_step", "prefill_tokens_per_step", "peak_device_memory_bytes"):
        assert key in status, f"status lacks {key}: {sorted(status)}"
    assert (status["worker_num"], status["batch_size"], status["device"], status["dtype"]) == (1, 3, "cpu", "fp32")
    assert status["steps"] >= 2 and status["active_slots"] == 0


def test_create_backend_parses_the_strategy(
    tiny_checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = ServerSettings(state_cache_path=tmp_path / "states.sqlite3")
    with caplog.at_level(logging.INFO, logger="albatross_engine.adapter"):
        engine = create_backend(str(tiny_checkpoint), "albatross workers=1 batch=5 prefill_chunk=64", settings)
    try:
        assert (engine.config.worker_num, engine.config.batch_size, engine.config.prefill_chunk) == (1, 5, 64)
        assert engine.settings is not None
        assert any("Albatross engine initialized: workers=1, batch_size=5" in r.getMessage() for r in caplog.records)
    finally:
        engine.shutdown()


def test_more_workers_than_visible_gpus_fails_naming_the_count(tiny_checkpoint: Path) -> None:
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(RuntimeError, match=rf"^Albatross engine initialization failed.*{visible} (is|are) visible"):
        AlbatrossRWKV(str(tiny_checkpoint), worker_num=visible + 1, device="cuda")


def test_random_model_specs_name_a_shape_and_a_seed() -> None:
    assert parse_random_spec("random:7.2b") == (CheckpointShape(n_layer=32, n_embd=4096), 0)
    assert parse_random_spec("random:2x128:5") == (CheckpointShape(n_layer=2, n_embd=128), 5)
    with pytest.raises(ValueError, match="unknown random model shape"):
        parse_random_spec("random:huge")


def test_a_random_spec_or_an_already_built_model_can_be_served() -> None:
    by_spec = AlbatrossRWKV("random:1x64:3", batch_size=2, device="cpu")
    model = RWKV7.from_state_dict(random_state_dict(CheckpointShape(1, 64), seed=3), "cpu", progress=False)
    prebuilt = AlbatrossRWKV("ignored", batch_size=2, model=model, device="cpu")
    try:
        request = GenerationRequest([5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
        a = [t for e in by_spec.generate(request) for t in e.token_ids]
        b = [t for e in prebuilt.generate(request) for t in e.token_ids]
        assert a == b and len(a) == 4, "the same random weights give the same tokens"
        assert by_spec.name == "random-1x64-3"
    finally:
        by_spec.shutdown()
        prebuilt.shutdown()


def test_tasks_go_to_the_least_loaded_worker(tiny_checkpoint: Path) -> None:
    engine = AlbatrossRWKV(str(tiny_checkpoint), worker_num=2, batch_size=2, device="cpu")
    try:
        async def run() -> list[list[GenerationEvent]]:
            async def one(i: int) -> list[GenerationEvent]:
                request = GenerationRequest([i + 1, i + 2], SamplingParams(max_tokens=6, temperature=0))
                return [e async for e in engine.async_generate(request)]

            return list(await asyncio.gather(*(one(i) for i in range(4))))

        results = asyncio.run(run())
        assert all(r[-1].finish_reason == "length" for r in results)
        finished = [w.metrics.snapshot().requests_finished.get("length", 0) for w in engine.core.workers]
        assert finished == [2, 2], f"4 requests over 2 idle workers should split 2/2, got {finished}"
    finally:
        engine.shutdown()
