"""The torch sampler's allowed-token masks and logit bias follow docs/architecture.md's definition,
checked against a slow per-row reference that shares none of its code."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from albatross import sampler
from albatross.sampler import AllowedTokens, LogitBias, PenaltyPool, SamplingBatch, sample, seed_to_seed32, unpack_bitmask
from runner.interface import SamplingParams
from sampler_oracles import draw_accepts

VOCAB = 4096
WORDS = VOCAB // 32
PLAIN = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, presence_penalty=0.0, frequency_penalty=0.0, penalty_decay=1.0)
MASK32 = 0xFFFFFFFF


def _uniform_reference(seed32: int, step: int) -> float:
    x = (seed32 + step * 0x9E3779B9) & MASK32
    for _ in range(2):
        x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK32
    return ((((x >> 16) ^ x) & MASK32) >> 8) * 2.0**-24


def _pack(allowed: set[int], vocab: int = VOCAB) -> np.ndarray:
    """A mask row from a set of ids, bit by bit (independent of the sampler's unpacking)."""
    words = [0] * (vocab // 32)
    for token_id in allowed:
        words[token_id // 32] |= 1 << (token_id % 32)
    return np.array([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=np.int32)


def _reference(logits: list[float], penalty: list[float], bias: dict[int, float], allowed: set[int] | None, settings: SamplingParams, u: float) -> int:
    """The definition for one row, with Python lists; fp32 only where the definition says fp32."""
    adjusted = [logit - pen + bias.get(i, 0.0) for i, (logit, pen) in enumerate(zip(logits, penalty))]
    candidates = sorted(allowed) if allowed is not None else list(range(len(adjusted)))
    if settings.temperature == 0:
        best = max(adjusted[i] for i in candidates)
        return min(i for i in candidates if adjusted[i] == best)
    row = torch.full((len(adjusted),), float("-inf"))
    row[candidates] = torch.tensor([adjusted[i] for i in candidates], dtype=torch.float32)
    probs = torch.softmax(row / settings.temperature, dim=0).tolist()
    ordered = sorted(probs, reverse=True)
    threshold = 0.0
    if settings.top_k > 0:
        threshold = ordered[min(settings.top_k, len(ordered)) - 1]
    if settings.top_p < 1.0:
        running = torch.cumsum(torch.tensor(ordered, dtype=torch.float32), dim=0).tolist()
        position = next((i for i, c in enumerate(running) if c >= settings.top_p), len(ordered) - 1)
        threshold = max(threshold, ordered[position])
    kept = [p if p >= threshold and p > 0 else 0.0 for p in probs]
    running = torch.cumsum(torch.tensor(kept, dtype=torch.float32), dim=0).tolist()
    target = float(torch.tensor(u, dtype=torch.float32) * torch.tensor(running[-1], dtype=torch.float32))
    return next(i for i, (c, k) in enumerate(zip(running, kept)) if c >= target and k > 0)


def _random_case(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[dict[int, float]], list[set[int] | None]]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=generator) * 3
    penalty = torch.rand(rows, VOCAB, generator=generator) * (torch.rand(rows, VOCAB, generator=generator) < 0.05)
    rng = np.random.default_rng(seed)
    biases: list[dict[int, float]] = []
    masks: list[set[int] | None] = []
    for r in range(rows):
        bias = {int(i): float(rng.uniform(-100, 100)) for i in rng.choice(VOCAB, size=int(rng.integers(0, 6)), replace=False)}
        biases.append(bias if r % 3 else {})
        if r % 4 == 3:
            masks.append(None)
        else:
            size = int(rng.choice([1, 2, 7, 300, 3000]))
            masks.append({int(i) for i in rng.choice(VOCAB, size=size, replace=False)} | set(list(bias)[:1]))
    return logits, penalty, biases, masks


def _allowed(masks: list[set[int] | None]) -> AllowedTokens:
    rows = [m for m in masks if m is not None]
    index, next_row = [], 0
    for mask in masks:
        index.append(-1 if mask is None else next_row)
        next_row += mask is not None
    words = torch.from_numpy(np.stack([_pack(m) for m in rows])) if rows else torch.zeros(0, WORDS, dtype=torch.int32)
    return AllowedTokens(index=torch.tensor(index, dtype=torch.int64), words=words)


@pytest.mark.parametrize(
    "settings",
    [
        replace(PLAIN, temperature=0.0),
        PLAIN,
        replace(PLAIN, temperature=0.7, top_k=5),
        replace(PLAIN, temperature=1.3, top_p=0.6),
        replace(PLAIN, temperature=0.9, top_k=40, top_p=0.9),
    ],
    ids=["greedy", "plain", "top_k", "top_p", "both"],
)
def test_masked_and_biased_rows_sample_what_the_slow_reference_samples(settings: SamplingParams) -> None:
    rows = 24
    logits, penalty, biases, masks = _random_case(rows, seed=11)
    params = [replace(settings, logit_bias=tuple(sorted(bias.items()))) for bias in biases]
    seeds = [seed_to_seed32(1000 + r) for r in range(rows)]
    steps = [r * 7 for r in range(rows)]
    pool = PenaltyPool(rows, VOCAB)
    pool.penalties.copy_(penalty)
    batch = SamplingBatch.from_params(params, seeds, steps, allowed=_allowed(masks))
    ids = sample(logits, torch.arange(rows), batch, pool, update_penalties=False, rejection=False).tolist()  # the reference is the exact draw
    for r in range(rows):
        expected = _reference(logits[r].tolist(), penalty[r].tolist(), biases[r], masks[r], settings, _uniform_reference(seeds[r], steps[r]))
        assert ids[r] == expected, f"row {r} (mask {None if masks[r] is None else len(masks[r])} ids, bias {len(biases[r])}): {ids[r]} != {expected}"


def test_a_sampled_id_is_always_an_allowed_id() -> None:
    rows = 512
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5)).expand(rows, -1)
    allowed = {3, 17, 900, 4095}
    batch = SamplingBatch.from_params([replace(PLAIN, top_k=2)] * rows, [seed_to_seed32(9)] * rows, list(range(rows)), allowed=_allowed([allowed] * rows))
    ids = set(sample(logits, torch.arange(rows), batch, PenaltyPool(rows, VOCAB)).tolist())
    assert ids <= allowed, f"sampled ids outside the mask: {sorted(ids - allowed)}"
    assert len(ids) == 2, "top_k 2 inside the mask keeps the two likeliest allowed ids"


def test_unconstrained_rows_do_not_notice_the_constrained_rows_of_their_batch() -> None:
    rows = 16
    logits, _, _, masks = _random_case(rows, seed=3)
    params = [replace(PLAIN, temperature=0.8, top_p=0.8)] * rows
    seeds, steps = [seed_to_seed32(r) for r in range(rows)], [5] * rows
    alone = sample(logits, torch.arange(rows), SamplingBatch.from_params(params, seeds, steps), PenaltyPool(rows, VOCAB))
    mixed = sample(logits, torch.arange(rows), SamplingBatch.from_params(params, seeds, steps, allowed=_allowed(masks)), PenaltyPool(rows, VOCAB))
    free = [r for r, m in enumerate(masks) if m is None]
    assert free, "the case needs unconstrained rows"
    assert mixed[free].tolist() == alone[free].tolist()


def test_logit_bias_of_plus_100_wins_greedy_and_minus_100_never_wins() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(8))
    worst = int(torch.argmin(logits[0]))
    best = int(torch.argmax(logits[1]))
    params = [replace(PLAIN, temperature=0.0, logit_bias=((worst, 100.0),)), replace(PLAIN, temperature=0.0, logit_bias=((best, -100.0),))]
    ids = sample(logits, torch.arange(2), SamplingBatch.from_params(params, [1, 2], [0, 0]), PenaltyPool(2, VOCAB)).tolist()
    assert ids[0] == worst
    assert ids[1] != best


def test_penalties_still_apply_inside_the_mask() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 10], logits[0, 20] = 5.0, 4.0
    pool = PenaltyPool(1, VOCAB)
    batch = SamplingBatch.from_params([replace(PLAIN, temperature=0.0, frequency_penalty=2.0)], [1], [0], allowed=_allowed([{10, 20, 30}]))
    first = int(sample(logits, torch.arange(1), batch, pool)[0])
    second = int(sample(logits, torch.arange(1), batch, pool)[0])
    assert (first, second) == (10, 20), "the penalised id 10 (5 - 2 < 4) gives way to id 20"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_mask_that_allows_nothing_gives_the_end_of_text_id(temperature: float) -> None:
    """The sampler cannot raise on the device; it gives id 0, which the row's grammar then refuses."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(4))
    logits[:, 0] = -50.0
    batch = SamplingBatch.from_params([replace(PLAIN, temperature=temperature)] * 2, [1, 2], [0, 0], allowed=_allowed([set(), None]))
    ids = sample(logits, torch.arange(2), batch, PenaltyPool(2, VOCAB)).tolist()
    assert ids[0] == 0
    assert ids[1] != 0, "the unconstrained row is not affected"


def test_unpacking_puts_id_t_at_bit_t_mod_32_of_word_t_div_32() -> None:
    ids = {0, 1, 31, 32, 63, 64, 2047, 4064, 4095}
    bits = unpack_bitmask(torch.from_numpy(_pack(ids)).reshape(1, -1), VOCAB)[0]
    assert set(torch.nonzero(bits).flatten().tolist()) == ids
    wider = unpack_bitmask(torch.from_numpy(_pack(ids)).reshape(1, -1), VOCAB + 50)[0]
    assert not bool(wider[VOCAB:].any()), "ids past the words are not allowed"


def test_no_bias_anywhere_builds_no_bias_and_shapes_are_checked() -> None:
    assert LogitBias.from_rows([(), ()]) is None
    assert SamplingBatch.from_params([PLAIN, PLAIN], [1, 2], [0, 0]).bias is None
    with pytest.raises(ValueError, match="allowed.index"):
        SamplingBatch.from_params([PLAIN, PLAIN], [1, 2], [0, 0], allowed=_allowed([None]))
    with pytest.raises(ValueError, match="logit_bias"):
        replace(PLAIN, logit_bias=((5, 101.0),))
    with pytest.raises(ValueError, match="distinct"):
        replace(PLAIN, logit_bias=((5, 1.0), (5, 2.0)))


# ---------------------------------------------------------------------------- the CUDA kernel

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
GPU_VOCAB = 65536  # the real vocabulary: the kernel's candidate search depends on the row length
GPU_SETTINGS = {
    "greedy": replace(PLAIN, temperature=0.0),
    "plain": PLAIN,
    "top_k": replace(PLAIN, temperature=0.9, top_k=40),
    "top_p": replace(PLAIN, temperature=1.1, top_p=0.9),
    "both": replace(PLAIN, temperature=0.7, top_k=2000, top_p=0.95),
}


def _gpu_case(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[dict[int, float]], list[set[int] | None]]:
    """Rows of the real vocabulary: masks of 1 to 40,000 ids (and none), sparse biases."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, GPU_VOCAB, generator=generator) * 3
    penalty = torch.rand(rows, GPU_VOCAB, generator=generator) * (torch.rand(rows, GPU_VOCAB, generator=generator) < 0.05)
    rng = np.random.default_rng(seed)
    biases: list[dict[int, float]] = []
    masks: list[set[int] | None] = []
    for r in range(rows):
        bias = {int(i): float(rng.uniform(-100, 100)) for i in rng.choice(GPU_VOCAB, size=int(rng.integers(0, 8)), replace=False)}
        biases.append(bias if r % 3 else {})
        size = [1, 3, 17, 500, 1023, 1500, 40000, 0][r % 8]
        masks.append(None if size == 0 else {int(i) for i in rng.choice(GPU_VOCAB, size=size, replace=False)})
    return logits, penalty, biases, masks


def _gpu_allowed(masks: list[set[int] | None]) -> AllowedTokens:
    rows = [m for m in masks if m is not None]
    index, next_row = [], 0
    for mask in masks:
        index.append(-1 if mask is None else next_row)
        next_row += mask is not None
    words = torch.from_numpy(np.stack([_pack(m, GPU_VOCAB) for m in rows]))
    return AllowedTokens(index=torch.tensor(index, dtype=torch.int64).cuda(), words=words.cuda())


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("name", list(GPU_SETTINGS))
@pytest.mark.parametrize("rows", [8, 96], ids=["8 rows", "96 rows"])
def test_the_cuda_kernel_applies_masks_and_biases_as_the_twin_does(name: str, rows: int) -> None:
    """Greedy rows equal the twin's exactly; a sampled row equals it or sits at a rounding boundary
    of the default draw (sampler_oracles.draw_accepts); every id lies inside its mask; penalties
    are updated alike."""
    from albatross import cuda_ops, ops

    cuda_ops.enable_cuda_kernels()
    assert "sample" in ops.registered_cuda_ops(), "the sampler kernel did not load"
    settings = GPU_SETTINGS[name]
    logits, penalty, biases, masks = _gpu_case(rows, seed=rows)
    params = [replace(settings, logit_bias=tuple(sorted(bias.items())), presence_penalty=0.4, frequency_penalty=0.2, penalty_decay=0.9) for bias in biases]
    seeds, steps = [seed_to_seed32(r) for r in range(rows)], [3 * r for r in range(rows)]
    allowed = _gpu_allowed(masks)
    twin_pool = PenaltyPool(rows, GPU_VOCAB)
    twin_pool.penalties.copy_(penalty)
    twin_batch = SamplingBatch.from_params(params, seeds, steps, allowed=AllowedTokens(allowed.index.cpu(), allowed.words.cpu()))
    expected = sample(logits, torch.arange(rows), twin_batch, twin_pool).tolist()
    pool = PenaltyPool(rows, GPU_VOCAB, device="cuda")
    pool.penalties.copy_(penalty)
    batch = SamplingBatch.from_params(params, seeds, steps, device="cuda", allowed=allowed)
    got = ops.sample(logits.cuda(), torch.arange(rows, device="cuda"), batch, pool).cpu().tolist()
    for r in range(rows):
        assert masks[r] is None or got[r] in masks[r], f"row {r}: id {got[r]} is outside its mask"
        if got[r] == expected[r]:
            continue
        assert settings.temperature > 0, f"greedy row {r}: {got[r]} != {expected[r]}"
        adjusted = logits[r] - penalty[r]
        for token_id, value in biases[r].items():
            adjusted[token_id] += value
        if masks[r] is not None:
            outside = torch.ones(GPU_VOCAB, dtype=torch.bool)
            outside[list(masks[r])] = False
            adjusted[outside] = float("-inf")
        row_settings = (settings.temperature, settings.top_k, settings.top_p, seeds[r], steps[r])
        assert draw_accepts(adjusted, *row_settings, got[r], sampler.REJECTION), f"row {r}: {got[r]} != {expected[r]}, not a rounding boundary"
    # Penalties follow each row's own sample: compare where both samplers drew the same id.
    same = [r for r in range(rows) if got[r] == expected[r]]
    assert len(same) >= rows * 3 // 4, f"only {len(same)} of {rows} rows agree with the twin"
    assert torch.allclose(pool.penalties.cpu()[same], twin_pool.penalties[same], rtol=1e-6, atol=1e-6)
    assert torch.equal(pool.seen.cpu()[same], twin_pool.seen[same])


@pytest.mark.cuda
@needs_gpu
def test_the_cuda_kernel_keeps_unconstrained_rows_as_they_are_alone_and_gives_0_for_an_empty_mask() -> None:
    from albatross import cuda_ops, ops

    cuda_ops.enable_cuda_kernels()
    rows = 32
    logits, _, biases, masks = _gpu_case(rows, seed=5)
    masks = [None if r % 2 else m for r, m in enumerate(masks)]
    masks[0] = set()  # allows nothing
    params = [replace(PLAIN, temperature=0.8, top_p=0.9)] * rows
    seeds, steps = [seed_to_seed32(100 + r) for r in range(rows)], [r for r in range(rows)]
    plain = SamplingBatch.from_params(params, seeds, steps, device="cuda")
    alone = ops.sample(logits.cuda(), torch.arange(rows, device="cuda"), plain, PenaltyPool(rows, GPU_VOCAB, device="cuda"), update_penalties=False)
    mixed_batch = SamplingBatch.from_params(params, seeds, steps, device="cuda", allowed=_gpu_allowed(masks))
    mixed = ops.sample(logits.cuda(), torch.arange(rows, device="cuda"), mixed_batch, PenaltyPool(rows, GPU_VOCAB, device="cuda"), update_penalties=False)
    free = [r for r in range(rows) if masks[r] is None]
    assert mixed[free].tolist() == alone[free].tolist(), "an unconstrained row changed next to masked rows"
    assert int(mixed[0]) == 0, "a mask that allows nothing gives the end-of-text id"


@pytest.mark.cuda
@needs_gpu
def test_the_cuda_kernel_refuses_half_given_masks_or_biases() -> None:
    from albatross import cuda_ops

    cuda_ops.enable_cuda_kernels()
    rows, vocab = 2, 128
    batch = SamplingBatch.from_params([PLAIN] * rows, [1, 2], [0, 0], device="cuda")
    pool = PenaltyPool(rows, vocab, device="cuda")
    args = (torch.zeros(rows, vocab, device="cuda"), torch.arange(rows, device="cuda"), batch.temperature, batch.top_p, batch.top_k,
            batch.presence, batch.frequency, batch.decay, batch.seed32, batch.step, pool.penalties, pool.seen, False)  # fmt: skip
    with pytest.raises(RuntimeError, match="mask_index and mask_words go together"):
        torch.ops.albatross.sample(*args, torch.zeros(rows, dtype=torch.int64, device="cuda"), None)
    with pytest.raises(RuntimeError, match="mask_index must be a contiguous int64 vector of length 2"):
        torch.ops.albatross.sample(*args, torch.zeros(3, dtype=torch.int64, device="cuda"), torch.zeros(1, 4, dtype=torch.int32, device="cuda"))


@pytest.mark.cuda
@needs_gpu
def test_the_masked_sampler_call_makes_no_host_sync() -> None:
    """The engine issues it while the forward runs: a host sync there would stall the pipeline."""
    from albatross import cuda_ops, ops

    cuda_ops.enable_cuda_kernels()
    rows = 16
    logits, _, biases, masks = _gpu_case(rows, seed=8)
    params = [replace(PLAIN, temperature=0.9, top_p=0.9, logit_bias=tuple(sorted(bias.items()))) for bias in biases]
    batch = SamplingBatch.from_params(params, [seed_to_seed32(r) for r in range(rows)], list(range(rows)), device="cuda", allowed=_gpu_allowed(masks))
    gpu_logits, slots, pool = logits.cuda(), torch.arange(rows, device="cuda"), PenaltyPool(rows, GPU_VOCAB, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ids = ops.sample(gpu_logits, slots, batch, pool)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(mask is None or token in mask for token, mask in zip(ids.tolist(), masks))
