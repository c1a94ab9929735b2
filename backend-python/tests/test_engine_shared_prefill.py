"""`n` samples of one prompt share its prefill: identical outputs to separate runs, with the prompt
fed once (plus each follower's last token). What happens to followers whose leader ends early is
specified in test_scheduler.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from albatross_engine.adapter import AlbatrossRWKV
from engine_helpers import WORKER_MODES, collect, token_ids
from runner.interface import GenerationRequest, SamplingParams

PROMPT = [(17 * i) % 65000 + 1 for i in range(40)]


@pytest.fixture(scope="module", params=WORKER_MODES)
def engine(request: pytest.FixtureRequest, tiny_checkpoint: Path) -> Iterator[AlbatrossRWKV]:
    backend = AlbatrossRWKV(str(tiny_checkpoint), worker_num=1, batch_size=8, prefill_chunk=16, device="cpu", worker_mode=request.param)
    yield backend
    backend.shutdown()


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=seed, stop_token_ids=())


def test_seeded_samples_of_one_prompt_equal_separate_runs_and_share_its_prefill(engine: AlbatrossRWKV) -> None:
    seeds = [11, 12, 13, 14]
    alone = [token_ids(collect(engine, [GenerationRequest(list(PROMPT), sampled(seed))])[0]) for seed in seeds]
    # The samples reach the worker one by one; those that arrive while the prompt's first request
    # is still short of its last token follow it, and a sample admitted after the leader's chunk
    # was issued prefills itself (all of them, or some: about one attempt in seven on a 2-core
    # machine). A long blocker keeps the worker busy so that they usually arrive together; the
    # attempts only bound that race. Every attempt's samples must equal the separate runs.
    blocker = GenerationRequest([(7 * i) % 65000 + 1 for i in range(600)], SamplingParams(max_tokens=1, stop_token_ids=()))
    everyone = (len(PROMPT) - 1) * (len(seeds) - 1)
    shared = []
    for _ in range(5):
        before = shared_tokens(engine)
        results = collect(engine, [blocker] + [GenerationRequest(list(PROMPT), sampled(seed)) for seed in seeds])
        together = [token_ids(events) for events in results[1:]]
        assert together == alone, "sharing the prefill must not change any sample"
        shared.append(shared_tokens(engine) - before)
        assert shared[-1] % (len(PROMPT) - 1) == 0, f"a follower takes the whole prompt but its last token: {shared}"
        if shared[-1] == everyone:
            break
    assert shared[-1] == everyone, f"followers took {shared} prompt tokens from their leader in the attempts, never {everyone}"


def shared_tokens(engine: AlbatrossRWKV) -> int:
    return int(engine.status()["shared_prompt_tokens_total"])
