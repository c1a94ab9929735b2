"""The memory plan on a real GPU (skipped without one), with the process capped to a consumer card's
memory by `torch.cuda.set_per_process_memory_fraction`: 7.2B int8 at batch 128 runs in 12 GB, 7.2B
fp16 there is refused with the plan's message (no out-of-memory error), 1.5B fp16 runs in 8 GB, and
the plan covers what the engine actually reserves.

Run it in a process of its own (bench/int8_gpu_session.sh does): the cap counts everything this
process's allocator already holds."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from albatross.random_checkpoint import NAMED_SHAPES, write_random_checkpoint
from albatross_engine.adapter import AlbatrossRWKV
from engine_helpers import collect
from runner.interface import GenerationRequest, SamplingParams

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

GIB = 1 << 30


@pytest.fixture()
def capped(request: pytest.FixtureRequest) -> Iterator[int]:
    """Cap this process to `request.param` GiB of the GPU, from an empty allocator. The cap holds in
    this process only, so the engines below run their worker in a thread (`worker_mode="thread"`);
    a worker process plans against what its own CUDA context sees, the whole card here."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    cap = int(request.param) * GIB
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(cap / total, 0)
    try:
        yield cap
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        gc.collect()
        torch.cuda.empty_cache()


def _run_requests(engine: AlbatrossRWKV, count: int, prompt: int, tokens: int) -> list[str | None]:
    """`count` requests at once; each one's finish reason."""
    generator = torch.Generator().manual_seed(count)
    sampling = SamplingParams(max_tokens=tokens, temperature=1.0, top_p=0.6)
    requests = [GenerationRequest(torch.randint(0, 65530, (prompt,), generator=generator).tolist(), sampling) for _ in range(count)]
    return [events[-1].finish_reason for events in collect(engine, requests)]


@pytest.mark.parametrize("capped", [12], indirect=True)
def test_7b_int8_at_batch_128_runs_to_completion_in_12_gb(capped: int) -> None:
    engine = AlbatrossRWKV("random:7.2b", worker_num=1, batch_size=128, device="cuda", weights="int8", worker_mode="thread")
    try:
        (plan,) = engine.status()["memory_plan"]  # type: ignore[misc]
        assert plan["batch_size"] == 128, plan
        assert _run_requests(engine, 128, prompt=64, tokens=16) == ["length"] * 128
        reserved = torch.cuda.max_memory_reserved()
        print(f"7.2B int8 batch 128 in a 12 GiB cap: plan {plan}, peak reserved {reserved / 1e9:.2f} GB")
        assert reserved <= capped
    finally:
        engine.shutdown()


@pytest.mark.parametrize("capped", [12], indirect=True)
def test_7b_fp16_in_12_gb_is_refused_with_what_would_fit(capped: int) -> None:
    with pytest.raises(RuntimeError) as refused:
        AlbatrossRWKV("random:7.2b", worker_num=1, batch_size=32, device="cuda", worker_mode="thread")
    message = str(refused.value)
    assert "MemoryPlanError: 7.2B fp16 needs 14.5 GB of weights; this GPU has" in message, message
    assert "use weights=int8 (7.8 GB) with batch up to" in message, message
    assert "out of memory" not in message.lower() and torch.cuda.max_memory_allocated() < GIB, "nothing was loaded"


@pytest.mark.parametrize("capped", [8], indirect=True)
def test_1_5b_fp16_runs_in_8_gb(capped: int) -> None:
    engine = AlbatrossRWKV("random:1.5b", worker_num=1, batch_size=32, device="cuda", worker_mode="thread")
    try:
        assert _run_requests(engine, 40, prompt=300, tokens=8) == ["length"] * 40
        assert torch.cuda.max_memory_reserved() <= capped
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def checkpoint_0_4b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A file, so that loading holds one tensor beside the model (random weights are generated
    as a whole dict first, which is no part of the plan)."""
    return write_random_checkpoint(tmp_path_factory.mktemp("plan") / "rwkv7-0.4b.pth", NAMED_SHAPES["0.4b"], seed=1, dtype="fp16")


@pytest.mark.parametrize("weights", ["fp16", "int8"])
def test_the_plan_covers_what_the_engine_reserves(weights: str, checkpoint_0_4b: Path) -> None:
    """A full prefill budget of long prompts, then decode at the full batch with graphs."""
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    engine = AlbatrossRWKV(str(checkpoint_0_4b), worker_num=1, batch_size=64, device="cuda", weights=weights, prefill_budget=8192, prefill_chunk=1024,
                           worker_mode="thread")  # fmt: skip  (this process's allocator is the one measured)
    try:
        (plan,) = engine.status()["memory_plan"]  # type: ignore[misc]
        loaded = torch.cuda.max_memory_reserved() - before
        assert _run_requests(engine, 64, prompt=1024, tokens=24) == ["length"] * 64
        used = torch.cuda.max_memory_reserved() - before
        print(f"0.4B {weights}: planned {plan['planned_bytes'] / 1e9:.2f} GB, reserved at peak {used / 1e9:.2f} GB "
              f"(after loading {loaded / 1e9:.2f} GB, allocated at peak {torch.cuda.max_memory_allocated() / 1e9:.2f} GB; {plan})")
        assert used <= plan["planned_bytes"], f"reserved {used} > planned {plan['planned_bytes']}"
    finally:
        engine.shutdown()
