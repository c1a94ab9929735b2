"""The rejection draw (docs/kernels.md "Rejection draw"): its Philox uniforms, its walk order, the
distribution it samples (total variation against the exact kept distribution), its independence
from the row's place in the batch, its fallback to the exact draw; and the CUDA kernel against it."""

from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from albatross import sampler
from albatross.sampler import AllowedTokens, LogitBias, PenaltyPool, SamplingBatch, kept_mask, philox4x32, round_uniform, sample, seed_to_seed32, walk_order
from runner.interface import SamplingParams
from sampler_oracles import draw_accepts, kernel_order_rejection, rejection_replay

PLAIN = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, presence_penalty=0.0, frequency_penalty=0.0, penalty_decay=1.0)
SETTINGS = ("temperature", "top_p", "top_k", "presence", "frequency", "decay", "seed32", "step")  # SamplingBatch's per-row tensors
VOCAB = 4100  # 1,025 quads: two chunks of the walk order, the last quad partial


def _words(values: tuple[int, ...]) -> list[torch.Tensor]:
    return [torch.tensor([v], dtype=torch.int64) for v in values]


# ---------------------------------------------------------------------------- uniforms and order


@pytest.mark.parametrize(
    ("counter", "key", "expected"),
    [  # the known-answer vectors of the Random123 distribution (kat_vectors, philox4x32_10)
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0), (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ],
)
def test_philox4x32_10_gives_the_known_answers(counter: tuple[int, ...], key: tuple[int, ...], expected: tuple[int, ...]) -> None:
    assert [int(w) for w in philox4x32(_words(counter), _words(key))] == list(expected)


def test_round_uniforms_depend_on_seed_step_and_round_only() -> None:
    generator = torch.Generator().manual_seed(1)
    seeds = torch.randint(0, 2**32, (300,), generator=generator, dtype=torch.int64)
    steps = torch.cat([torch.randint(0, 5000, (150,), generator=generator), torch.randint(2**32, 2**40, (150,), generator=generator)])
    rounds = [round_uniform(seeds, steps, r) for r in range(4)]
    for values in rounds:
        assert values.dtype == torch.float32 and bool(((values >= 0) & (values < 1)).all())
    assert all(float((rounds[0] == other).float().mean()) < 0.01 for other in rounds[1:]), "rounds must draw apart"
    # one element at a time, in another order: the same values (no dependence on the batch)
    order = torch.randperm(300, generator=generator)
    assert torch.equal(round_uniform(seeds[order], steps[order], 2), rounds[2][order])
    one = round_uniform(seeds[7:8], steps[7:8], 3)
    assert torch.equal(one, rounds[3][7:8])
    high = steps[150:]
    assert not torch.equal(round_uniform(seeds[150:], high, 0), round_uniform(seeds[150:], high & 0xFFFFFFFF, 0)), "the step's high word must matter"
    # the uniform is word 0 of Philox on key (seed, step low) and counter (round, step high, 0, 0)
    seed, step = int(seeds[200]), int(steps[200])
    word = int(philox4x32(_words((2, step >> 32, 0, 0)), _words((seed, step & 0xFFFFFFFF)))[0])
    assert float(rounds[2][200]) == (word >> 8) * 2.0**-24


@pytest.mark.parametrize("vocab", [1, 4, 4096, 4100, 65536])
def test_walk_order_is_a_permutation_that_follows_the_threads_quads(vocab: int) -> None:
    order = walk_order(vocab)
    assert sorted(order.tolist()) == list(range(vocab))
    if vocab == 65536:
        # thread 0 owns quads 0, 1024, 2048, ...: ids 0-3, then 4096-4099, ...
        assert order[:8].tolist() == [0, 1, 2, 3, 4096, 4097, 4098, 4099]
        assert order[64:68].tolist() == [4, 5, 6, 7], "thread 1 follows thread 0's 16 quads"
    if vocab == 4100:
        assert order[:8].tolist() == [0, 1, 2, 3, 4096, 4097, 4098, 4099]


# ---------------------------------------------------------------------------- distribution


@dataclass(frozen=True)
class Case:
    logits: torch.Tensor  # [V]
    penalty: torch.Tensor  # [V]
    bias: tuple[tuple[int, float], ...]
    allowed: set[int] | None


def _case(shape: str) -> Case:
    # A stable seed: hash() of a str changes from one process to the next (PYTHONHASHSEED), which
    # made these statistical checks run on new logits each time and fail now and then.
    generator = torch.Generator().manual_seed(zlib.crc32(shape.encode()) % 1000)
    none = torch.zeros(VOCAB)
    if shape == "spread":
        return Case(torch.randn(VOCAB, generator=generator) * 3, none, (), None)
    if shape == "concentrated":  # nearly flat: many rounds before top_k is met
        return Case(5 + torch.randn(VOCAB, generator=generator) * 0.01, none, (), None)
    if shape == "ties":  # groups of about ten equal logits: top_k cuts inside a group
        return Case(torch.randint(0, 400, (VOCAB,), generator=generator).float() / 40, none, (), None)
    # penalties, an allowed-token mask of 300 ids and a few biases (two of them inside the mask)
    rng = np.random.default_rng(7)
    allowed = {int(i) for i in rng.choice(VOCAB, size=300, replace=False)}
    inside = sorted(allowed)[:2]
    penalty = torch.rand(VOCAB, generator=generator) * 2 * (torch.rand(VOCAB, generator=generator) < 0.3)
    return Case(torch.randn(VOCAB, generator=generator) * 2, penalty, ((inside[0], 3.0), (inside[1], -2.0), (5, 4.0)), allowed)


def _adjusted(case: Case) -> torch.Tensor:
    """Step 0 by hand (independent of the sampler's own)."""
    adjusted = case.logits - case.penalty
    for token_id, value in case.bias:
        adjusted[token_id] += value
    if case.allowed is not None:
        outside = torch.ones(VOCAB, dtype=torch.bool)
        outside[sorted(case.allowed)] = False
        adjusted[outside] = float("-inf")
    return adjusted


def _mask_words(allowed: set[int]) -> torch.Tensor:
    words = [0] * ((VOCAB + 31) // 32)
    for token_id in allowed:
        words[token_id // 32] |= 1 << (token_id % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def _draws(case: Case, settings: SamplingParams, draws: int, rejection: bool) -> torch.Tensor:
    """`draws` tokens of many requests: 40 seeds, each its steps 0, 1, ..., one row per token."""
    params = [replace(settings, logit_bias=case.bias)] * draws
    allowed = None
    if case.allowed is not None:
        allowed = AllowedTokens(index=torch.zeros(draws, dtype=torch.int64), words=_mask_words(case.allowed)[None])
    per_seed = -(-draws // 40)
    seeds = [seed_to_seed32(2026 + i // per_seed) for i in range(draws)]
    batch = SamplingBatch.from_params(params, seeds, [i % per_seed for i in range(draws)], allowed=allowed)
    pool = PenaltyPool(1, VOCAB)
    pool.penalties[0] = case.penalty
    logits = case.logits.expand(draws, -1)
    return sample(logits, torch.zeros(draws, dtype=torch.int64), batch, pool, update_penalties=False, rejection=rejection)


def _kept_distribution(case: Case, settings: SamplingParams) -> torch.Tensor:
    probs = torch.softmax(_adjusted(case) / settings.temperature, dim=-1)
    kept = kept_mask(probs[None], torch.tensor([settings.top_k]), torch.tensor([settings.top_p]))[0] & (probs > 0)
    target = torch.where(kept, probs, torch.zeros_like(probs)).double()
    return target / target.sum()


DISTRIBUTIONS = [  # rows without top_k take the rejection draw; with top_k, the exact draw (per row)
    ("spread", replace(PLAIN, top_k=50, top_p=0.6)),
    ("spread", replace(PLAIN, temperature=0.7, top_p=0.9)),
    ("spread", replace(PLAIN, temperature=1.3, top_k=12)),
    ("spread", replace(PLAIN, temperature=0.5)),
    ("concentrated", replace(PLAIN, top_k=30)),
    ("concentrated", replace(PLAIN, temperature=0.01, top_p=0.7)),
    ("ties", replace(PLAIN, top_k=25)),
    ("ties", replace(PLAIN, temperature=0.4, top_p=0.5)),
    ("constrained", replace(PLAIN, temperature=0.9, top_k=30, top_p=0.8)),
    ("constrained", replace(PLAIN, temperature=0.9, top_p=0.8)),
    ("constrained", replace(PLAIN, temperature=1.2)),
]


@pytest.mark.parametrize(("shape", "settings"), DISTRIBUTIONS, ids=[f"{s}-k{p.top_k}-p{p.top_p}-t{p.temperature}" for s, p in DISTRIBUTIONS])
def test_rejection_draws_follow_the_exact_kept_distribution(shape: str, settings: SamplingParams) -> None:
    """Total variation between 4,000 draws (40 seeds x 100 steps) and the exact top-k/top-p
    distribution stays within the sampling noise of 4,000 draws (E|n_i - N p_i| <= sqrt(N p_i)), as
    the exact draw's does; no dropped id is ever drawn."""
    draws = 4000
    case = _case(shape)
    target = _kept_distribution(case, settings)
    noise = 0.5 * float(torch.sqrt(target / draws).sum())
    for rejection in (True, False):
        ids = _draws(case, settings, draws, rejection)
        observed = torch.bincount(ids, minlength=VOCAB).double() / draws
        assert float(observed[target == 0].sum()) == 0.0, f"a dropped id was drawn (rejection={rejection})"
        distance = 0.5 * float((observed - target).abs().sum())
        assert distance < 1.3 * noise, f"rejection={rejection}: total variation {distance:.4f}, noise {noise:.4f}"
    if case.allowed is not None:
        assert set(ids.tolist()) <= case.allowed


def test_maxima_only_rows_draw_among_the_tied_maxima_and_greedy_stays_the_argmax() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    logits[0, [10, 2000, 4099]] = 9.0  # three tied maxima
    rows = 300
    for settings in (replace(PLAIN, top_k=1), replace(PLAIN, top_p=0.0), replace(PLAIN, temperature=0.0)):
        batch = SamplingBatch.from_params([settings] * rows, [seed_to_seed32(5)] * rows, list(range(rows)))
        ids = sample(logits.expand(rows, -1), torch.arange(rows), batch, PenaltyPool(rows, VOCAB), update_penalties=False, rejection=True)
        if settings.temperature == 0:
            assert set(ids.tolist()) == {10}, "greedy: the lowest id of the tied maxima"
        else:
            counts = torch.bincount(ids, minlength=VOCAB)
            assert set(ids.tolist()) == {10, 2000, 4099} and int(counts[[10, 2000, 4099]].min()) > 60
    logits[0, 2000] = 9.5  # one maximum: top_k 1 is the argmax
    batch = SamplingBatch.from_params([replace(PLAIN, top_k=1)] * 8, list(range(8)), [0] * 8)
    assert set(sample(logits.expand(8, -1), torch.arange(8), batch, PenaltyPool(8, VOCAB), rejection=True).tolist()) == {2000}


# ---------------------------------------------------------------------------- the contract


def _mixed_batch(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, PenaltyPool, SamplingBatch]:
    """Rows of every kind: greedy, free, top-k, top-p, both, maxima only; penalties with decay,
    masks on some rows, biases on others."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator) * 3
    pool = PenaltyPool(rows, vocab)
    pool.penalties.copy_(torch.rand(rows, vocab, generator=generator) * (torch.rand(rows, vocab, generator=generator) < 0.1))
    kinds = [(0.0, 1.0, 0), (1.0, 1.0, 0), (0.8, 1.0, 40), (1.2, 0.7, 0), (1.0, 0.6, 50), (1.0, 1.0, 1), (0.9, 0.0, 0), (1.5, 0.95, 1000)]
    params = []
    rng = np.random.default_rng(seed)
    for r in range(rows):
        temperature, top_p, top_k = kinds[r % len(kinds)]
        bias = tuple((int(i), float(rng.uniform(-5, 5))) for i in rng.choice(vocab, size=3, replace=False)) if r % 3 == 1 else ()
        params.append(replace(PLAIN, temperature=temperature, top_p=top_p, top_k=top_k, presence_penalty=0.3, frequency_penalty=0.1, penalty_decay=0.95, logit_bias=bias))
    words = torch.randint(-(2**31), 2**31, (rows, (vocab + 31) // 32), generator=generator, dtype=torch.int64).to(torch.int32)
    index = torch.tensor([r if r % 4 == 2 else -1 for r in range(rows)], dtype=torch.int64)
    seeds = [seed_to_seed32(1000 + r) for r in range(rows)]
    steps = [int(s) for s in torch.randint(0, 2**40, (rows,), generator=generator)]
    batch = SamplingBatch.from_params(params, seeds, steps, allowed=AllowedTokens(index, words))
    return logits, pool, batch


def _permuted(batch: SamplingBatch, order: torch.Tensor) -> SamplingBatch:
    fields = {name: getattr(batch, name)[order] for name in SETTINGS}
    assert batch.allowed is not None and batch.bias is not None
    allowed = AllowedTokens(batch.allowed.index[order], batch.allowed.words)
    offsets = batch.bias.offsets
    rows = [list(zip(batch.bias.ids[offsets[r] : offsets[r + 1]].tolist(), batch.bias.values[offsets[r] : offsets[r + 1]].tolist())) for r in order.tolist()]
    return replace(batch, **fields, allowed=allowed, bias=LogitBias.from_rows(rows))


def test_a_rows_draw_does_not_depend_on_its_place_in_the_batch() -> None:
    """Permuting the rows (and their slots) permutes the ids and the penalty updates, nothing else."""
    rows = 48
    logits, pool, batch = _mixed_batch(rows, VOCAB, seed=4)
    slots = torch.arange(rows)
    first_pool = PenaltyPool.wrap(pool.penalties.clone(), pool.seen.clone())
    ids = sample(logits, slots, batch, first_pool, rejection=True)
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(9))
    second_pool = PenaltyPool.wrap(pool.penalties.clone(), pool.seen.clone())
    permuted = sample(logits[order], slots[order], _permuted(batch, order), second_pool, rejection=True)
    assert torch.equal(permuted, ids[order])
    assert torch.equal(first_pool.penalties, second_pool.penalties) and torch.equal(first_pool.seen, second_pool.seen)
    alone = sample(logits[5:6], slots[5:6], _permuted(batch, torch.tensor([5])), PenaltyPool.wrap(pool.penalties.clone(), pool.seen.clone()), rejection=True)
    assert int(alone) == int(ids[5])


def test_rejection_keeps_step_0_and_greedy_rows_and_draws_kept_ids() -> None:
    rows = 48
    logits, pool, batch = _mixed_batch(rows, VOCAB, seed=6)
    slots = torch.arange(rows)
    exact = sample(logits, slots, batch, PenaltyPool.wrap(pool.penalties.clone(), pool.seen.clone()), update_penalties=False, rejection=False)
    ids = sample(logits, slots, batch, PenaltyPool.wrap(pool.penalties.clone(), pool.seen.clone()), update_penalties=False, rejection=True)
    greedy = batch.temperature <= 0
    assert torch.equal(ids[greedy], exact[greedy]), "greedy rows are the exact argmax"
    adjusted = logits - pool.penalties
    assert batch.bias is not None and batch.allowed is not None
    sampler.apply_logit_bias(adjusted, batch.bias)
    sampler.apply_allowed(adjusted, batch.allowed)
    temperature = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)
    kept = kept_mask(torch.softmax(adjusted / temperature[:, None], dim=-1), batch.top_k, batch.top_p)
    assert bool(kept[torch.arange(rows), ids].all()), "a sampled row drew a dropped id"
    assert bool(torch.isfinite(adjusted[torch.arange(rows), ids]).all()), "a row drew outside its mask"
    assert not torch.equal(ids[~greedy], exact[~greedy]), "the rejection draw uses its own uniforms"


def test_what_rejection_leaves_undecided_takes_the_exact_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = 32
    logits, pool, batch = _mixed_batch(rows, VOCAB, seed=8)
    slots = torch.arange(rows)
    exact = sample(logits, slots, batch, PenaltyPool.wrap(pool.penalties.clone(), pool.seen.clone()), update_penalties=False, rejection=False)
    monkeypatch.setattr(sampler, "REJECTION_ROUNDS", 0)  # no draw at all: every row falls back
    assert torch.equal(sample(logits, slots, batch, pool, update_penalties=False, rejection=True), exact)
    monkeypatch.setattr(sampler, "REJECTION_ROUNDS", 1)  # one draw: rows whose first draw is dropped fall back
    once = sample(logits, slots, batch, pool, update_penalties=False, rejection=True)
    monkeypatch.setattr(sampler, "REJECTION_ROUNDS", 32)
    full = sample(logits, slots, batch, pool, update_penalties=False, rejection=True)
    first_kept = once == full  # decided in one round: the same draw
    assert 0 < int(first_kept.sum()) < rows
    assert bool(((once == full) | (once == exact)).all()), "a row is either decided by its first draw or takes the exact one"


def test_a_flat_row_with_top_p_0_or_tight_top_k_terminates_with_a_kept_id() -> None:
    logits = torch.zeros(64, VOCAB) + torch.rand(1, VOCAB, generator=torch.Generator().manual_seed(2)) * 1e-6
    settings = [replace(PLAIN, top_k=2)] * 32 + [replace(PLAIN, top_p=1e-6)] * 32
    batch = SamplingBatch.from_params(settings, [seed_to_seed32(3)] * 64, list(range(64)))
    ids = sample(logits, torch.arange(64), batch, PenaltyPool(64, VOCAB), rejection=True)
    probs = torch.softmax(logits, dim=-1)
    assert bool(kept_mask(probs, batch.top_k, batch.top_p)[torch.arange(64), ids].all())


def test_rows_with_top_k_keep_the_exact_draw_and_the_others_take_the_rejection_draw() -> None:
    """The per-row rule: a row with top_k draws exactly what the exact draw gives; a row without
    it draws what rejection gives it in a batch of rows without top_k only."""
    rows = 32
    logits, pool, batch = _mixed_batch(rows, VOCAB, seed=12)
    slots = torch.arange(rows)
    chosen = sample(logits, slots, batch, pool, update_penalties=False, rejection=True)
    exact = sample(logits, slots, batch, pool, update_penalties=False, rejection=False)
    with_k = (batch.top_k > 0) & (batch.top_k < VOCAB)
    assert with_k.any() and (~with_k).any()
    assert torch.equal(chosen[with_k], exact[with_k])
    free = (~with_k).nonzero().flatten()
    alone = sample(logits[free], slots[free], _permuted(batch, free), pool, update_penalties=False, rejection=True)
    assert torch.equal(chosen[free], alone)
    assert not torch.equal(chosen[free], exact[free]), "the rows without top_k should take the rejection draw"


def test_the_switch_is_on_unless_the_environment_asks_for_the_exact_draw() -> None:
    assert sampler.rejection_from_environment(None) and sampler.rejection_from_environment("rejection")
    assert not sampler.rejection_from_environment("exact")
    with pytest.raises(ValueError, match="ALBATROSS_SAMPLER='Exact'"):
        sampler.rejection_from_environment("Exact")
    assert sampler.REJECTION == sampler.rejection_from_environment(os.environ.get("ALBATROSS_SAMPLER"))


def test_the_default_draw_is_the_module_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = 16
    logits, pool, batch = _mixed_batch(rows, VOCAB, seed=10)
    slots = torch.arange(rows)
    for switch in (False, True):
        monkeypatch.setattr(sampler, "REJECTION", switch)
        chosen = sample(logits, slots, batch, pool, update_penalties=False)
        assert torch.equal(chosen, sample(logits, slots, batch, pool, update_penalties=False, rejection=switch))


# ---------------------------------------------------------------------------- the GPU tests' oracle


def _h200_tie_row() -> tuple[torch.Tensor, SamplingBatch]:
    """Row 16 of test_sampler_kernel_matches_torch_twin[64-ties] (tests/test_cuda_kernels.py), rebuilt
    from that test's generator calls: tied logits and penalties, temperature 1.7, top_p 0.5. On the
    H200 the kernel drew 59501, the twin 65332."""
    generator = torch.Generator().manual_seed(64)
    rows, vocab = 64, 65536
    logits = torch.randint(0, 6, (rows, vocab), generator=generator).float()
    slots = torch.randperm(rows + 3, generator=generator)[:rows]
    picks = [torch.randint(0, n, (rows,), generator=generator) for n in (4, 4, 5)]  # temperature, top_p, top_k
    presence, frequency, decay = (torch.rand(rows, generator=generator) for _ in range(3))
    seeds = torch.randint(0, 2**32, (rows,), generator=generator, dtype=torch.int64)
    steps = torch.randint(0, 10_000, (rows,), generator=generator, dtype=torch.int64)
    penalties = torch.randint(0, 2, (rows + 3, vocab), generator=generator).float()
    row = 16
    temperature = torch.tensor([0.0, 0.3, 1.0, 1.7])[picks[0][row]]
    top_p = torch.tensor([1.0, 0.95, 0.5, 0.0])[picks[1][row]]
    top_k = torch.tensor([0, 1, 7, 50, 1000])[picks[2][row]]
    batch = SamplingBatch(temperature[None].float(), top_p[None].float(), top_k[None], presence[row : row + 1], frequency[row : row + 1],
                          0.9 + 0.1 * decay[row : row + 1], seeds[row : row + 1], steps[row : row + 1])  # fmt: skip
    return (logits[row] - penalties[slots[row]])[None], batch


def test_the_replay_of_the_h200_tie_row_holds_both_devices_draws_and_nothing_of_the_exact_draw() -> None:
    """Round 0's target lies within fp32 summation error of the edge between two neighbours in the
    walk order (61239, dropped by top_p, and 65332, a maximum): the twin takes 65332 and accepts
    it, the kernel's sums take 61239, raise the pivot and accept 59501 in the next round. The
    float32 emulation of the kernel's order reproduces the H200's id; the replay holds both draws,
    not the dropped neighbour, not the exact draw's id."""
    adjusted, batch = _h200_tie_row()
    assert float(batch.temperature) == pytest.approx(1.7) and float(batch.top_p) == 0.5 and int(batch.top_k) == 0
    twin, decided = sampler._rejection_draw(adjusted, batch.temperature, batch, torch.zeros(1, dtype=torch.bool))
    kernel, kernel_decided = kernel_order_rejection(adjusted, batch.temperature, batch.top_p, batch.seed32, batch.step)
    assert bool(decided) and bool(kernel_decided)
    assert (int(twin), int(kernel)) == (65332, 59501)
    settings = (float(batch.temperature), 0, 0.5, int(batch.seed32), int(batch.step))
    replay = rejection_replay(adjusted[0], *settings)
    assert {65332, 59501} <= replay.ids and len(replay.ids) <= 4 and not replay.falls_back
    assert rejection_replay(adjusted[0], *settings, slack=0.0).ids == {65332}, "without slack the replay is the twin"
    exact = int(sample(adjusted, torch.zeros(1, dtype=torch.int64), batch, PenaltyPool(1, adjusted.shape[1]), update_penalties=False, rejection=False))
    assert exact not in replay.ids
    assert not draw_accepts(adjusted[0], *settings, 61239, True)
    assert not draw_accepts(adjusted[0], *settings, exact, True)
    assert draw_accepts(adjusted[0], *settings, exact, False) and not draw_accepts(adjusted[0], *settings, 59501, False)


@pytest.mark.parametrize("shape", ["spread", "concentrated", "ties"])
def test_the_replay_holds_the_twins_and_the_kernel_orders_draws(shape: str) -> None:
    """On 96 rows without top_k: without slack the replay is the twin's draw, id for id (the same
    rule); with the fp32 bound it also holds the draw of the kernel's summation order, and a few ids
    at most."""
    generator = torch.Generator().manual_seed(17)
    rows, vocab = 96, 65536
    if shape == "spread":
        logits = torch.randn(rows, vocab, generator=generator) * 3
    elif shape == "concentrated":
        logits = 5 + torch.randn(rows, vocab, generator=generator) * 0.01
    else:
        logits = torch.randint(0, 6, (rows, vocab), generator=generator).float() - torch.randint(0, 2, (rows, vocab), generator=generator).float()
    pick = lambda values: torch.tensor(values)[torch.randint(0, len(values), (rows,), generator=generator)]  # noqa: E731
    batch = SamplingBatch(pick([0.3, 1.0, 1.7]), pick([0.0, 0.5, 0.9, 0.95, 1.0]), torch.zeros(rows, dtype=torch.int64), torch.zeros(rows),
                          torch.zeros(rows), torch.ones(rows), torch.randint(0, 2**32, (rows,), generator=generator),
                          torch.randint(0, 10_000, (rows,), generator=generator))  # fmt: skip
    twin, decided = sampler._rejection_draw(logits, batch.temperature, batch, torch.zeros(rows, dtype=torch.bool))
    kernel, kernel_decided = kernel_order_rejection(logits, batch.temperature, batch.top_p, batch.seed32, batch.step)
    assert bool(decided.all()) and bool(kernel_decided.all())
    for row in range(rows):
        settings = (float(batch.temperature[row]), 0, float(batch.top_p[row]), int(batch.seed32[row]), int(batch.step[row]))
        assert rejection_replay(logits[row], *settings, slack=0.0).ids == {int(twin[row])}, f"row {row}"
        replay = rejection_replay(logits[row], *settings)
        assert {int(twin[row]), int(kernel[row])} <= replay.ids and len(replay.ids) <= 16, f"row {row}: {sorted(replay.ids)}"


# ---------------------------------------------------------------------------- the CUDA kernel

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
GPU_VOCAB = 65536


def _to_cuda(batch: SamplingBatch) -> SamplingBatch:
    fields = {name: getattr(batch, name).cuda() for name in SETTINGS}
    allowed = None if batch.allowed is None else AllowedTokens(batch.allowed.index.cuda(), batch.allowed.words.cuda())
    bias = None if batch.bias is None else LogitBias(batch.bias.offsets.cuda(), batch.bias.ids.cuda(), batch.bias.values.cuda())
    return replace(batch, **fields, allowed=allowed, bias=bias)


def _adjusted_rows(logits: torch.Tensor, pool: PenaltyPool, batch: SamplingBatch) -> torch.Tensor:
    """Step 0 of every row on the CPU: the logits the draws start from."""
    adjusted = logits - pool.penalties
    if batch.bias is not None:
        sampler.apply_logit_bias(adjusted, batch.bias)
    if batch.allowed is not None:
        sampler.apply_allowed(adjusted, batch.allowed)
    return adjusted


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize(("rows", "shape"), [(1, "spread"), (7, "spread"), (64, "spread"), (64, "concentrated"), (64, "ties"), (960, "spread")])
def test_the_cuda_rejection_kernel_draws_the_twins_ids(rows: int, shape: str) -> None:
    """Kernel and twin on random logits of the real vocabulary: greedy rows equal, sampled rows equal
    but for rounding (at most 1 in 100, each one a branch of the float64 replay of its draw:
    sampler_oracles.draw_accepts), the penalty updates alike."""
    from albatross import cuda_ops, ops

    cuda_ops.enable_cuda_kernels()
    assert "sample" in ops.registered_cuda_ops(), "the sampler kernel did not load"
    logits, pool, batch = _mixed_batch(rows, GPU_VOCAB, seed=rows)
    if shape == "concentrated":
        logits = 5 + logits * 0.003
    elif shape == "ties":
        logits = torch.round(logits)
    twin_pool = PenaltyPool.wrap(pool.penalties.clone(), pool.seen.clone())
    expected = sample(logits, torch.arange(rows), batch, twin_pool, rejection=True)
    device_pool = PenaltyPool.wrap(pool.penalties.cuda(), pool.seen.cuda())
    actual = ops.sample(logits.cuda(), torch.arange(rows, device="cuda"), _to_cuda(batch), device_pool, rejection=True).cpu()
    greedy = batch.temperature <= 0
    assert torch.equal(actual[greedy], expected[greedy]), "greedy rows must equal the twin's argmax exactly"
    differing = (actual != expected).nonzero().flatten().tolist()
    assert len(differing) <= max(1, rows // 100), f"{len(differing)} of {rows} rows differ: {differing[:10]}"
    adjusted = _adjusted_rows(logits, pool, batch)
    for row in differing:
        settings = (float(batch.temperature[row]), int(batch.top_k[row]), float(batch.top_p[row]), int(batch.seed32[row]), int(batch.step[row]))
        assert draw_accepts(adjusted[row], *settings, int(actual[row]), True), f"row {row}: kernel drew {int(actual[row])}, twin {int(expected[row])}, not a rounding boundary"
    same = (actual == expected).nonzero().flatten()
    assert torch.allclose(device_pool.penalties.cpu()[same], twin_pool.penalties[same], rtol=1e-6, atol=1e-6), "penalty update differs"
    assert torch.equal(device_pool.seen.cpu()[same], twin_pool.seen[same]), "seen mask update differs"


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 12, 1.0), (1.3, 0, 0.8), (1.0, 50, 0.6)])
def test_the_cuda_rejection_kernel_follows_the_kept_distribution(temperature: float, top_k: int, top_p: float) -> None:
    from albatross import cuda_ops, ops

    cuda_ops.enable_cuda_kernels()
    vocab, draws = 30, 40_000
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(5)) * 1.5
    settings = replace(PLAIN, temperature=temperature, top_k=top_k, top_p=top_p)
    batch = _to_cuda(SamplingBatch.from_params([settings] * draws, [seed_to_seed32(99)] * draws, list(range(draws))))
    pool = PenaltyPool(1, vocab, device="cuda")
    ids = ops.sample(row.expand(draws, vocab).contiguous().cuda(), torch.zeros(draws, dtype=torch.int64, device="cuda"), batch, pool, update_penalties=False, rejection=True)
    probs = torch.softmax(row / temperature, dim=-1)
    kept = kept_mask(probs[None], torch.tensor([top_k]), torch.tensor([top_p]))[0]
    expected = torch.where(kept, probs, torch.zeros_like(probs)).double()
    expected = expected / expected.sum() * draws
    counts = torch.bincount(ids.cpu(), minlength=vocab).double()
    assert counts[~kept].sum() == 0, f"dropped ids were drawn: {counts[~kept].nonzero().flatten().tolist()}"
    chi2 = (((counts - expected) ** 2) / expected)[kept].sum().item()
    df = int(kept.sum()) - 1
    if df >= 1:
        critical = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3  # p = 0.001
        assert chi2 <= critical, f"chi-square {chi2:.1f} over {df} degrees of freedom"


@pytest.mark.cuda
@needs_gpu
def test_the_cuda_rejection_draw_makes_no_host_sync_and_replays_from_a_cuda_graph() -> None:
    from albatross import cuda_ops, ops

    cuda_ops.enable_cuda_kernels()
    rows = 64
    logits, pool, batch = _mixed_batch(rows, GPU_VOCAB, seed=12)
    logits, device_batch, slots = logits.cuda(), _to_cuda(batch), torch.arange(rows, device="cuda")
    eager_pool = PenaltyPool.wrap(pool.penalties.cuda(), pool.seen.cuda())
    graph_pool = PenaltyPool.wrap(pool.penalties.cuda(), pool.seen.cuda())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = ops.sample(logits, slots, device_batch, eager_pool, rejection=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    warm = PenaltyPool.wrap(graph_pool.penalties.clone(), graph_pool.seen.clone())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.sample(logits, slots, device_batch, warm, rejection=True)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.sample(logits, slots, device_batch, graph_pool, rejection=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    assert torch.equal(graph_pool.penalties, eager_pool.penalties) and torch.equal(graph_pool.seen, eager_pool.seen)
