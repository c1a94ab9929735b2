"""The pure-torch sampler computes the definition in docs/architecture.md, row by row independent."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from albatross import sampler
from albatross.sampler import (
    MASK32,
    PenaltyPool,
    SamplingBatch,
    kept_mask,
    sample,
    seed_to_seed32,
    top_logprobs,
    uniform,
)
from runner.interface import SamplingParams

VOCAB = 65536
PLAIN = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, presence_penalty=0.0, frequency_penalty=0.0, penalty_decay=1.0)


def _hash32_reference(x: int) -> int:
    for _ in range(2):
        x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK32
    return ((x >> 16) ^ x) & MASK32


def _uniform_reference(seed32: int, step: int) -> float:
    return (_hash32_reference((seed32 + step * 0x9E3779B9) & MASK32) >> 8) * 2.0**-24


def _batch(params: list[SamplingParams], seed32s: list[int] | None = None, steps: list[int] | None = None) -> SamplingBatch:
    rows = len(params)
    return SamplingBatch.from_params(params, seed32s or [seed_to_seed32(7)] * rows, steps or [0] * rows)


def _logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=generator) * scale


def _slots(rows: int) -> torch.Tensor:
    return torch.arange(rows, dtype=torch.int64)


@pytest.fixture(params=["exact", "rejection"])
def draw(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The contract tests below hold for both draws (the default one is sampler.REJECTION)."""
    monkeypatch.setattr(sampler, "REJECTION", request.param == "rejection")
    return str(request.param)


# randomness


def test_uniform_equals_the_unsigned_32_bit_definition_including_huge_steps() -> None:
    generator = torch.Generator().manual_seed(3)
    seeds = torch.randint(0, 2**32, (200,), generator=generator, dtype=torch.int64)
    steps = torch.cat([torch.randint(0, 10_000, (100,), generator=generator), torch.randint(2**31, 2**40, (100,), generator=generator)])
    got = uniform(seeds, steps)
    expected = torch.tensor([_uniform_reference(int(s), int(t)) for s, t in zip(seeds, steps)], dtype=torch.float32)
    assert got.dtype == torch.float32
    assert torch.equal(got, expected), f"first difference at {int((got != expected).nonzero()[0])}"
    assert bool(((got >= 0) & (got < 1)).all())


def test_seed_to_seed32_hashes_both_halves_of_a_64_bit_seed() -> None:
    seed = 0x1234_5678_9ABC_DEF0
    assert seed_to_seed32(seed) == _hash32_reference(0x9ABC_DEF0 ^ _hash32_reference(0x1234_5678))
    assert seed_to_seed32(seed) != seed_to_seed32(seed ^ (1 << 40)), "the high half must matter"
    for value in [0, 1, -1, 2**64 - 1, 2**70 + 5]:
        assert 0 <= seed_to_seed32(value) <= MASK32


# greedy


def test_greedy_is_the_argmax_of_penalised_logits() -> None:
    logits = _logits(6)
    pool = PenaltyPool(6, VOCAB)
    pool.penalties.copy_(torch.rand(6, VOCAB, generator=torch.Generator().manual_seed(1)) * 4)
    batch = _batch([replace(PLAIN, temperature=0.0)] * 6)
    ids = sample(logits, _slots(6), batch, pool, update_penalties=False)
    assert torch.equal(ids, torch.argmax(logits - pool.penalties, dim=-1))


def test_greedy_takes_the_lowest_id_on_ties(draw: str) -> None:
    logits = torch.full((2, VOCAB), -1.0)
    logits[0, [9, 4000, 3]] = 5.0
    logits[1, [65535, 70]] = 2.0
    ids = sample(logits, _slots(2), _batch([replace(PLAIN, temperature=0.0)] * 2), PenaltyPool(2, VOCAB))
    assert ids.tolist() == [3, 70]


# seeds and independence


def test_same_seed_and_step_reproduce_the_same_tokens(draw: str) -> None:
    """The draw is a function of (seed, step) alone: rebuilt batches, other rows around it and other
    slots give the same token; another step or seed a different one."""
    logits = _logits(1, seed=5).expand(8, -1).clone()  # one distribution, eight times
    seeds, steps = [11, 11, 22, 11, 11, 33, 11, 11], [3, 3, 3, 4, 3, 3, 3, 5]
    ids = sample(logits, _slots(8), _batch([PLAIN] * 8, seed32s=seeds, steps=steps), PenaltyPool(8, VOCAB), update_penalties=False)
    alone = sample(logits[:1], _slots(1), _batch([PLAIN], seed32s=[11], steps=[3]), PenaltyPool(1, VOCAB), update_penalties=False)
    same = [i for i in range(8) if (seeds[i], steps[i]) == (11, 3)]
    assert {ids[i].item() for i in same} == {alone.item()}, "(seed 11, step 3) drew different tokens"
    others = {(seeds[i], steps[i]): ids[i].item() for i in range(8) if i not in same}
    assert all(token != alone.item() for token in others.values()), f"another seed or step drew the same token: {others}"


def test_a_rows_token_does_not_depend_on_the_other_rows(draw: str) -> None:
    logits = _logits(5, seed=6, scale=1.0)
    settings = [
        replace(PLAIN, top_p=0.8),
        replace(PLAIN, temperature=0.0),
        replace(PLAIN, top_k=40, temperature=1.3),
        replace(PLAIN, top_p=0.5, top_k=100),
        PLAIN,
    ]
    seeds, steps = [101, 202, 303, 404, 505], [0, 9, 4, 17, 3]
    together = sample(logits, _slots(5), _batch(settings, seeds, steps), PenaltyPool(5, VOCAB))
    for row in range(5):
        order = [row, *[other for other in range(5) if other != row]][::-1]  # the row last, others shuffled
        alone = sample(
            logits[order],
            _slots(5),
            _batch([settings[i] for i in order], [seeds[i] for i in order], [steps[i] for i in order]),
            PenaltyPool(5, VOCAB),
        )
        assert int(alone[-1]) == int(together[row]), f"row {row} changed with its neighbours"


def test_different_steps_draw_different_tokens_for_a_flat_distribution(draw: str) -> None:
    logits = torch.zeros(64, 1000) + torch.rand(1, 1000, generator=torch.Generator().manual_seed(2)) * 1e-3
    batch = _batch([PLAIN] * 64, seed32s=[seed_to_seed32(1)] * 64, steps=list(range(64)))
    ids = sample(logits, _slots(64), batch, PenaltyPool(64, 1000))
    assert len(set(ids.tolist())) > 50, "64 steps of one seed over 1000 near-equal ids should rarely repeat"


# top_k and top_p


def _kept_reference(probs_row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Slow, one row: thresholds read off the sorted probabilities in a Python loop."""
    ordered = sorted(probs_row.tolist(), reverse=True)
    threshold = 0.0
    if top_k > 0:
        threshold = ordered[min(top_k, len(ordered)) - 1]
    if top_p < 1.0:
        cumulative = torch.cumsum(torch.tensor(ordered, dtype=torch.float32), dim=0).tolist()
        position = next((i for i, c in enumerate(cumulative) if c >= top_p), len(ordered) - 1)
        threshold = max(threshold, ordered[position])
    return probs_row >= threshold


def test_top_k_and_top_p_masks_match_a_slow_per_row_reference() -> None:
    cases = [(0, 1.0), (1, 1.0), (5, 1.0), (200, 1.0), (0, 0.0), (0, 0.3), (0, 0.9), (10, 0.5), (3, 0.99), (5000, 0.7)]
    logits = _logits(len(cases), vocab=4096, seed=9, scale=2.0)
    probs = torch.softmax(logits, dim=-1)
    top_k = torch.tensor([k for k, _ in cases])
    top_p = torch.tensor([p for _, p in cases], dtype=torch.float32)
    mask = kept_mask(probs, top_k, top_p)
    for row, (k, p) in enumerate(cases):
        expected = _kept_reference(probs[row], k, p)
        assert torch.equal(mask[row], expected), f"top_k={k} top_p={p}: kept {int(mask[row].sum())}, expected {int(expected.sum())}"
    assert int(mask[1].sum()) == 1 and int(mask[2].sum()) == 5
    assert int(mask[4].sum()) == 1, "top_p 0 keeps only the most likely id"


def test_sampled_ids_are_always_kept_ids(draw: str) -> None:
    rows = 256
    logits = _logits(1, vocab=2000, seed=4).expand(rows, -1)
    settings = [replace(PLAIN, top_k=7, top_p=0.6, temperature=0.7)] * rows
    ids = sample(logits, _slots(rows), _batch(settings, [seed_to_seed32(8)] * rows, list(range(rows))), PenaltyPool(rows, 2000))
    kept = kept_mask(torch.softmax(logits[:1] / 0.7, dim=-1), torch.tensor([7]), torch.tensor([0.6]))[0]
    assert bool(kept[ids].all()), f"sampled dropped ids {sorted(set(ids[~kept[ids]].tolist()))}"


def _chi_square_critical(degrees_of_freedom: int, z: float = 3.29) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z=3.29: p about 0.0005)."""
    h = 2.0 / (9.0 * degrees_of_freedom)
    return degrees_of_freedom * (1.0 - h + z * math.sqrt(h)) ** 3


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.8, 6, 1.0), (1.2, 0, 0.7), (1.0, 9, 0.85)],
)
def test_sampling_frequencies_follow_the_renormalised_kept_distribution(temperature: float, top_k: int, top_p: float, draw: str) -> None:
    vocab, draws = 12, 6000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(13))
    settings = [replace(PLAIN, temperature=temperature, top_k=top_k, top_p=top_p)] * draws
    batch = _batch(settings, [seed_to_seed32(2024)] * draws, list(range(draws)))
    ids = sample(logits.expand(draws, -1), _slots(draws), batch, PenaltyPool(draws, vocab))

    probs = torch.softmax(logits / temperature, dim=-1)
    kept = kept_mask(probs, torch.tensor([top_k]), torch.tensor([top_p]))[0]
    expected = torch.where(kept, probs[0], torch.zeros(vocab))
    expected = expected / expected.sum() * draws
    observed = torch.bincount(ids, minlength=vocab).to(torch.float64)
    assert float(observed[~kept].sum()) == 0.0, "a dropped id was sampled"
    statistic = float((((observed - expected) ** 2)[kept] / expected[kept]).sum())
    degrees = int(kept.sum()) - 1
    assert degrees >= 1
    assert statistic < _chi_square_critical(degrees), f"chi-square {statistic:.1f} over {degrees} dof: {observed.tolist()} vs {expected.tolist()}"


# penalties


def test_penalty_update_decays_then_adds_frequency_and_presence_only_the_first_time() -> None:
    vocab = 50
    logits = torch.full((1, vocab), -10.0)
    logits[0, 7] = 10.0  # greedy picks 7 every time
    params = replace(PLAIN, temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25, penalty_decay=0.9)
    pool = PenaltyPool(3, vocab)
    slot = torch.tensor([2])
    pool.penalties[2, 1] = 2.0  # an older penalty that only decays

    assert sample(logits, slot, _batch([params]), pool).tolist() == [7]
    assert pool.penalties[2, 7].item() == pytest.approx(0.75)
    assert pool.penalties[2, 1].item() == pytest.approx(1.8)
    assert sample(logits, slot, _batch([params]), pool).tolist() == [7]
    assert pool.penalties[2, 7].item() == pytest.approx(0.75 * 0.9 + 0.25), "presence is added only on first use"
    assert pool.penalties[2, 1].item() == pytest.approx(1.8 * 0.9)
    assert pool.seen[2].nonzero().flatten().tolist() == [7]
    assert float(pool.penalties[:2].abs().sum()) == 0.0, "other slots must be untouched"


def test_penalties_steer_greedy_away_from_a_repeated_token() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 4], logits[0, 6] = 1.0, 0.9
    params = replace(PLAIN, temperature=0.0, presence_penalty=0.2, frequency_penalty=0.0, penalty_decay=1.0)
    pool = PenaltyPool(1, 10)
    ids = [int(sample(logits, _slots(1), _batch([params]), pool)) for _ in range(2)]
    assert ids == [4, 6]


def test_without_update_the_penalty_pool_is_unchanged() -> None:
    pool = PenaltyPool(2, 100)
    pool.penalties.copy_(torch.rand(2, 100))
    before = pool.penalties.clone()
    sample(_logits(2, vocab=100), _slots(2), _batch([replace(PLAIN, frequency_penalty=1.0)] * 2), pool, update_penalties=False)
    assert torch.equal(pool.penalties, before) and not bool(pool.seen.any())


def test_reset_clears_only_the_given_slots() -> None:
    pool = PenaltyPool(3, 20)
    pool.penalties.fill_(1.0)
    pool.seen.fill_(True)
    pool.reset([0, 2])
    assert pool.penalties.sum(dim=-1).tolist() == [0.0, 20.0, 0.0]
    assert pool.seen.sum(dim=-1).tolist() == [0, 20, 0]


# batch building and logprobs


def test_sampling_batch_from_runner_params_holds_device_tensors_per_row() -> None:
    params = [SamplingParams(temperature=0.5, top_p=0.9, top_k=3, presence_penalty=0.1, frequency_penalty=0.2, penalty_decay=0.95), PLAIN]
    batch = SamplingBatch.from_params(params, [2**32 + 5, 6], [10, 0])
    assert batch.rows == 2
    assert batch.temperature.dtype == torch.float32 and batch.top_k.dtype == torch.int64 and batch.seed32.dtype == torch.int64
    assert batch.top_k.tolist() == [3, 0] and batch.seed32.tolist() == [5, 6] and batch.step.tolist() == [10, 0]
    assert batch.decay.tolist() == pytest.approx([0.95, 1.0])


def test_sampling_batch_rejects_mismatched_rows() -> None:
    with pytest.raises(ValueError, match="one each per row"):
        SamplingBatch.from_params([PLAIN, PLAIN], [1], [0, 0])


def test_sample_rejects_logits_whose_rows_do_not_match_the_batch() -> None:
    with pytest.raises(ValueError, match="disagree"):
        sample(_logits(3, vocab=10), _slots(2), _batch([PLAIN] * 2), PenaltyPool(3, 10))


def test_top_logprobs_are_the_log_softmax_of_the_logits_in_descending_order() -> None:
    logits = _logits(3, vocab=500, seed=17)
    chosen = torch.tensor([5, 17, 499])
    result = top_logprobs(logits, 4, chosen)
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert result.top_ids.shape == (3, 4)
    assert torch.equal(result.top_ids[:, 0], torch.argmax(logits, dim=-1))
    assert bool((result.top_values[:, :-1] >= result.top_values[:, 1:]).all())
    assert torch.allclose(result.top_values.double(), reference.gather(-1, result.top_ids), atol=1e-5)
    assert result.chosen is not None
    assert torch.allclose(result.chosen.double(), reference[torch.arange(3), chosen], atol=1e-5)
    assert top_logprobs(logits, 0).top_ids.shape == (3, 0)
