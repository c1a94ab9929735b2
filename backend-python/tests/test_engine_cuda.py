"""The engine's GPU path (CUDA kernels, captured decode graphs, step overlap) computes what the
model core computes one slot at a time on the same GPU. Skipped without CUDA."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from albatross import cuda_ops
from albatross.model import RWKV7
from albatross.random_checkpoint import CheckpointShape, random_state_dict
from albatross_engine.adapter import AlbatrossRWKV
from albatross_engine.config import AlbatrossBackendConfig
from albatross_engine.model_specs import model_loader
from engine_helpers import WORKER_MODES, collect, reference_tokens, token_ids
from runner.interface import GenerationRequest, SamplingParams

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

# The margin-checked weights of tests/test_model_cuda.py: greedy top-2 margins stay far above fp16
# rounding, so batching (other matmul shapes) cannot flip a greedy choice.
SHAPE = CheckpointShape(n_layer=4, n_embd=256)
WEIGHT_SEED = 3
SPEC = f"random:{SHAPE.n_layer}x{SHAPE.n_embd}:{WEIGHT_SEED}"  # the same weights, built by a worker process's own loader


def build_model() -> RWKV7:
    cuda_ops.enable_cuda_kernels()
    return RWKV7.from_state_dict(random_state_dict(SHAPE, seed=WEIGHT_SEED, device="cuda"), "cuda", torch.float16, progress=False)


@pytest.fixture(
    scope="module",
    params=[(False, "fp32", "thread"), (True, None, "thread"), (True, None, "process")],
    ids=["eager fp32 state", "overlap+graphs default state", "worker process, overlap+graphs default state"],
)
def engine(request: pytest.FixtureRequest) -> Iterator[AlbatrossRWKV]:
    fast, state_dtype, mode = request.param
    if mode == "process":  # a worker process builds its own model: the same random weights, from the spec
        backend = AlbatrossRWKV(SPEC, batch_size=16, device="cuda", dtype="fp16", overlap=fast, cuda_graphs=fast,
                                state_dtype=state_dtype, worker_mode="process")  # fmt: skip
    else:
        backend = AlbatrossRWKV(
            "gpu-test", batch_size=16, model=build_model(), device="cuda", overlap=fast, cuda_graphs=fast, state_dtype=state_dtype
        )
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def reference_model(engine: AlbatrossRWKV) -> RWKV7:
    """The model the engine serves, built in this process the way its worker built it."""
    if engine.worker_mode == "process":
        cuda_ops.enable_cuda_kernels()
        return model_loader(SPEC, engine.config).build(torch.device("cuda:0"))
    return build_model()


def test_greedy_request_in_a_crowded_gpu_batch_equals_the_model_core_alone(engine: AlbatrossRWKV, reference_model: RWKV7) -> None:
    rng = random.Random(5)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, frequency_penalty=0.0, stop_token_ids=())
    prompt = torch.randint(0, 65536, (32,), generator=torch.Generator().manual_seed(112)).tolist()
    expected = reference_tokens(reference_model, prompt, greedy, seed=0, state_dtype=engine.config.effective_state_dtype("cuda"))
    crowd = [
        GenerationRequest([rng.randrange(1, 65530) for _ in range(rng.randint(1, 40))], SamplingParams(max_tokens=rng.randint(1, 30), temperature=1.0, top_p=0.9, seed=rng.randrange(2**32), stop_token_ids=()))
        for _ in range(12)
    ]
    results = collect(engine, crowd + [GenerationRequest(prompt, greedy)])
    assert token_ids(results[-1]) == expected, "the greedy continuation changed inside a GPU batch"
    assert all(events[-1].finish_reason == "length" for events in results), "every request runs to max_tokens"


def test_seeded_sampling_on_the_gpu_does_not_depend_on_the_batch(engine: AlbatrossRWKV) -> None:
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, top_k=40, seed=77, stop_token_ids=())
    target = GenerationRequest([11, 22, 33, 44, 55], params)
    alone = token_ids(collect(engine, [target])[0])
    rng = random.Random(9)
    crowd = [GenerationRequest([rng.randrange(1, 65530) for _ in range(8)], SamplingParams(max_tokens=20, seed=rng.randrange(2**32), stop_token_ids=())) for _ in range(10)]
    crowded = token_ids(collect(engine, crowd + [target])[-1])
    assert alone == crowded, f"seeded tokens differ alone {alone} and in a batch {crowded}"


@pytest.mark.parametrize("mode", WORKER_MODES)
@pytest.mark.parametrize("workers", [2, 4, 8])
def test_n_workers_on_n_gpus_share_the_requests_and_match_the_model_core(workers: int, mode: str) -> None:
    """`workers=N`: each GPU loads its own copy (random weights from the same seed), requests are
    spread over all of them, and a greedy request gives the model core's tokens whichever GPU
    serves it, in worker threads and in worker processes."""
    if torch.cuda.device_count() < workers:
        pytest.skip(f"needs {workers} GPUs, {torch.cuda.device_count()} visible")
    # fp32 weights and state: these loader-built weights have no checked greedy margins, and fp32
    # keeps batching's rounding far below them.
    config = AlbatrossBackendConfig(dtype="fp32", state_dtype="fp32")
    reference_model = model_loader(SPEC, config).build(torch.device("cuda:0"))  # the workers' own loader
    backend = AlbatrossRWKV(SPEC, worker_num=workers, batch_size=8, device="cuda", dtype="fp32", state_dtype="fp32", worker_mode=mode)
    try:
        assert [str(w.device) for w in backend.core.workers] == [f"cuda:{i}" for i in range(workers)]
        greedy = SamplingParams(max_tokens=12, temperature=0.0, frequency_penalty=0.0, stop_token_ids=())
        prompt = torch.randint(0, 65536, (24,), generator=torch.Generator().manual_seed(7)).tolist()
        expected = reference_tokens(reference_model, prompt, greedy, seed=0, state_dtype="fp32")
        results = collect(backend, [GenerationRequest(prompt, greedy) for _ in range(8 * workers)])
        assert all(token_ids(events) == expected for events in results), "a worker's greedy output differs"
        steps = [worker.metrics.snapshot().steps for worker in backend.core.workers]
        assert all(count > 0 for count in steps), f"a worker got no requests: steps {steps}"
    finally:
        backend.shutdown()
