"""The CUDA kernels compute what their torch twins compute (run on a GPU; skipped without one)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from albatross import cuda_ops, ops, sampler
from sampler_oracles import draw_accepts
from wkv_reference import wkv_inputs

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

N = 64


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    results = cuda_ops.enable_cuda_kernels()
    assert all(r.how in ("prebuilt", "jit") for r in results.values()), {k: r.describe() for k, r in results.items()}
    # ops.* on CUDA tensors must reach the kernels, not the twins they are compared with.
    missing = {"wkv7", "sample"} - set(ops.registered_cuda_ops())
    assert not missing, f"no CUDA kernel registered for {sorted(missing)}"


def _wkv_inputs(lengths: list[int], heads: int, dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    """r, w, k, v, a, b with a trained model's ranges on the GPU (wkv_reference.wkv_inputs)."""
    return wkv_inputs(lengths, heads, dtype, gen, device="cuda")


def _poison_next_allocation(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    # The caching allocator hands this block to the next allocation of the same size: an output
    # row the kernel forgets to write then shows up as NaN instead of a plausible stale value.
    value = float("nan") if dtype.is_floating_point else -1
    poison = torch.full(shape, value, dtype=dtype, device="cuda")
    del poison


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


CASES = [
    # (lengths per slot, heads): decode batches, prefill chunks, and mixtures of both
    ([1], 2),
    ([1] * 7, 2),
    ([1] * 64, 2),
    ([1] * 960, 2),
    ([37], 2),
    ([5, 1, 1, 130, 1, 17, 1], 3),
    ([1] * 33 + [64, 3] + [1] * 30, 2),
    ([128] * 5 + [1] * 9 + [300, 2], 4),  # a serving step's shape: prompt chunks of 128, decode rows, one long chunk
]


# The general kernel's launch shapes (rows_per_thread, direct_rows, scaled_rows): wkv_dispatch.LAYOUT picks one.
LAUNCH_SHAPES = [(1, False, False), (2, False, False), (2, True, False), (2, False, True), (2, True, True)]
LAUNCH_IDS = ["row", "rows2", "rows2-direct", "rows2-scaled", "rows2-direct-scaled"]


@pytest.mark.parametrize("lengths, heads", CASES, ids=lambda c: str(len(c)) if isinstance(c, list) else str(c))
@pytest.mark.parametrize(
    "act_dtype, state_dtype, tolerance",
    [
        (torch.float32, torch.float32, 1e-5),
        (torch.float16, torch.float32, 2e-3),
        (torch.bfloat16, torch.float32, 1e-2),
        (torch.float16, torch.float16, 2e-3),
        (torch.bfloat16, torch.bfloat16, 1e-2),
    ],
    ids=["fp32", "fp16-act", "bf16-act", "fp16-state", "bf16-state"],
)
@pytest.mark.parametrize("rows_per_thread, direct_rows, scaled_rows", LAUNCH_SHAPES, ids=LAUNCH_IDS)
def test_wkv7_kernel_matches_torch_twin(
    lengths: list[int], heads: int, act_dtype: torch.dtype, state_dtype: torch.dtype, tolerance: float, rows_per_thread: int,
    direct_rows: bool, scaled_rows: bool,
) -> None:
    gen = torch.Generator(device="cuda").manual_seed(len(lengths) * 1000 + sum(lengths))
    pool_size = len(lengths) + 5
    state = (torch.randn(pool_size, heads, N, N, generator=gen, device="cuda") * 0.1).to(state_dtype)
    perm = torch.randperm(pool_size, generator=gen, device="cuda")[: len(lengths)]
    slot_idx = perm.to(torch.int32)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    inputs = _wkv_inputs(lengths, heads, act_dtype, gen)

    expected_state = state.clone()
    expected = ops.wkv7_torch(expected_state, slot_idx, cu, *inputs)
    actual_state = state.clone()
    _poison_next_allocation((sum(lengths), heads * N), act_dtype)
    actual = ops.wkv7(actual_state, slot_idx, cu, *inputs, rows_per_thread=rows_per_thread, direct_rows=direct_rows,
                      scaled_rows=scaled_rows)
    torch.cuda.synchronize()

    assert not actual.isnan().any(), "some output rows were never written"
    y_error = _relative_error(actual, expected)
    s_error = _relative_error(actual_state, expected_state)
    assert y_error <= tolerance, f"y differs from the twin by {y_error:.2e} (tolerance {tolerance:.0e})"
    assert s_error <= tolerance, f"state differs from the twin by {s_error:.2e} (tolerance {tolerance:.0e})"
    untouched = torch.ones(pool_size, dtype=torch.bool, device="cuda")
    untouched[perm] = False
    assert torch.equal(actual_state[untouched], state[untouched]), "slots outside slot_idx were modified"


DECODE_DTYPES = [
    (torch.float32, torch.float32),
    (torch.float16, torch.float32),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.bfloat16),
]


@pytest.mark.parametrize("slots", [1, 7, 333, 960])
@pytest.mark.parametrize("act_dtype, state_dtype", DECODE_DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_wkv7_decode_kernel_is_bit_identical_to_the_general_kernel(
    slots: int, act_dtype: torch.dtype, state_dtype: torch.dtype
) -> None:
    """`single_token=True` runs the decode kernel: same outputs and states, to the bit, as the
    general kernel on the same one-token rows (so a request does not depend on whether its step
    also carried prompt chunks), and close to the torch twin."""
    gen = torch.Generator(device="cuda").manual_seed(slots)
    heads = 3
    pool = slots + 4
    state = (torch.randn(pool, heads, N, N, generator=gen, device="cuda") * 0.3).to(state_dtype)
    slot_idx = torch.randperm(pool, generator=gen, device="cuda")[:slots].to(torch.int32)
    cu = torch.arange(slots + 1, dtype=torch.int32, device="cuda")
    inputs = _wkv_inputs([1] * slots, heads, act_dtype, gen)
    general_state, decode_state, twin_state = state.clone(), state.clone(), state.clone()
    general = ops.wkv7(general_state, slot_idx, cu, *inputs)
    _poison_next_allocation((slots, heads * N), act_dtype)
    decode = ops.wkv7(decode_state, slot_idx, cu, *inputs, single_token=True)
    twin = ops.wkv7_torch(twin_state, slot_idx, cu, *inputs)
    torch.cuda.synchronize()
    assert not decode.isnan().any(), "some output rows were never written"
    assert torch.equal(decode, general)
    assert torch.equal(decode_state, general_state)  # and slots outside slot_idx untouched, as the general kernel leaves them
    tolerance = 1e-5 if act_dtype == state_dtype == torch.float32 else 1e-2
    assert _relative_error(decode, twin) <= tolerance
    assert _relative_error(decode_state, twin_state) <= tolerance


@pytest.mark.parametrize("lengths, heads", CASES, ids=lambda c: str(len(c)) if isinstance(c, list) else str(c))
@pytest.mark.parametrize("act_dtype, state_dtype", DECODE_DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_two_rows_a_thread_give_the_bits_of_one(lengths: list[int], heads: int, act_dtype: torch.dtype, state_dtype: torch.dtype) -> None:
    """The general kernel's launch shape (`rows_per_thread`, `direct_rows`) changes nothing, to the
    bit: each row's arithmetic is the same in the same order, whether its state went through the
    shared-memory tile or straight to registers. (`scaled_rows` changes the rounding: its own tests
    are below.)"""
    gen = torch.Generator(device="cuda").manual_seed(sum(lengths) + heads)
    pool = len(lengths) + 3
    state = (torch.randn(pool, heads, N, N, generator=gen, device="cuda") * 0.3).to(state_dtype)
    slot_idx = torch.randperm(pool, generator=gen, device="cuda")[: len(lengths)].to(torch.int32)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    inputs = _wkv_inputs(lengths, heads, act_dtype, gen)
    one, two = state.clone(), state.clone()
    y_one = ops.wkv7(one, slot_idx, cu, *inputs, rows_per_thread=1)
    _poison_next_allocation((sum(lengths), heads * N), act_dtype)
    y_two = ops.wkv7(two, slot_idx, cu, *inputs, rows_per_thread=2)
    direct = state.clone()
    _poison_next_allocation((sum(lengths), heads * N), act_dtype)
    y_direct = ops.wkv7(direct, slot_idx, cu, *inputs, rows_per_thread=2, direct_rows=True)
    torch.cuda.synchronize()
    assert torch.equal(y_two, y_one) and torch.equal(y_direct, y_one)
    assert torch.equal(two, one) and torch.equal(direct, one)


def test_the_dispatch_takes_two_rows_a_thread_where_its_layout_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """Enough long slots to fill the GPU three chains an SM deep: the dispatch asks the kernel for
    two rows a thread (straight to registers at twenty-four chains an SM); with a decode row in
    the call it asks for one. Outputs as the twin's."""
    from albatross import wkv_dispatch

    seen: list[tuple[object, ...]] = []
    kernel = ops.wkv7

    def recording(*args: object) -> torch.Tensor:
        seen.append(args[-3:])
        return kernel(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(ops, "wkv7", recording)
    heads = 8
    layout, sms = wkv_dispatch.LAYOUT, wkv_dispatch.multiprocessors(torch.cuda.current_device())
    slots = -(-layout.chains_per_sm * sms // heads)
    many = -(-layout.direct_chains_per_sm * sms // heads)
    gen = torch.Generator(device="cuda").manual_seed(2)
    long = layout.min_tokens
    scaled = layout.scaled_rows
    for lengths, want in (([long] * slots, (2, False, scaled)), ([long] * (slots - 1) + [1], (1, False, False)),
                          ([long] * many, (2, True, scaled))):
        inputs = _wkv_inputs(lengths, heads, torch.float16, gen)
        state = (torch.randn(len(lengths), heads, N, N, generator=gen, device="cuda") * 0.3).half()
        batch = ops.FlatBatch.build(list(range(len(lengths))), lengths, torch.device("cuda"))
        twin_state = state.clone()
        y = wkv_dispatch.wkv7(state, batch, *inputs)
        twin = ops.wkv7_torch(twin_state, batch.slot_idx, batch.cu_seqlens, *inputs)
        assert seen[-1] == want
        assert _relative_error(y, twin) <= 2e-3 and _relative_error(state, twin_state) <= 2e-3


@pytest.mark.parametrize("rows_per_thread, direct_rows, scaled_rows", LAUNCH_SHAPES, ids=LAUNCH_IDS)
@pytest.mark.parametrize("act_dtype, state_dtype", DECODE_DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_one_token_slots_of_a_mixed_call_equal_the_decode_kernel(
    act_dtype: torch.dtype, state_dtype: torch.dtype, rows_per_thread: int, direct_rows: bool, scaled_rows: bool
) -> None:
    """A decode row that rides in a step with prompt chunks gets, to the bit, what a decode-only
    step gives it: its output and state may not depend on the other slots of the call."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    heads, lengths = 3, [1, 40, 1, 1, 129, 1, 2, 1]
    pool = len(lengths) + 2
    state = (torch.randn(pool, heads, N, N, generator=gen, device="cuda") * 0.3).to(state_dtype)
    slot_idx = torch.randperm(pool, generator=gen, device="cuda")[: len(lengths)].to(torch.int32)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    inputs = _wkv_inputs(lengths, heads, act_dtype, gen)
    mixed_state = state.clone()
    mixed = ops.wkv7(mixed_state, slot_idx, cu, *inputs, rows_per_thread=rows_per_thread, direct_rows=direct_rows, scaled_rows=scaled_rows)
    ones = [s for s, n in enumerate(lengths) if n == 1]
    rows = cu[:-1][ones].long()
    decode_state = state.clone()
    decode_slots = slot_idx[ones].contiguous()
    decode_cu = torch.arange(len(ones) + 1, dtype=torch.int32, device="cuda")
    decode = ops.wkv7(decode_state, decode_slots, decode_cu, *[x[rows] for x in inputs], single_token=True)
    torch.cuda.synchronize()
    assert torch.equal(mixed[rows], decode)
    assert torch.equal(mixed_state[decode_slots.long()], decode_state[decode_slots.long()])


def test_wkv7_decode_kernel_accepts_strided_rows() -> None:
    gen = torch.Generator(device="cuda").manual_seed(9)
    inputs = _wkv_inputs([1] * 5, 2, torch.float16, gen)
    views = [torch.cat([x, torch.randn_like(x)], dim=1)[:, : x.shape[1]] for x in inputs]
    slots = torch.tensor([4, 0, 2, 1, 3], dtype=torch.int32, device="cuda")
    cu = torch.arange(6, dtype=torch.int32, device="cuda")
    state = (torch.randn(5, 2, N, N, generator=gen, device="cuda") * 0.1).half()
    a, b = state.clone(), state.clone()
    assert torch.equal(ops.wkv7(a, slots, cu, *views, single_token=True),
                       ops.wkv7(b, slots, cu, *inputs, single_token=True))


def test_wkv7_chunked_prefill_equals_one_call() -> None:
    gen = torch.Generator(device="cuda").manual_seed(7)
    inputs = _wkv_inputs([50], 2, torch.float32, gen)
    state = torch.randn(2, 2, N, N, generator=gen, device="cuda") * 0.1
    one = state.clone()
    y_one = ops.wkv7(one, torch.tensor([1], dtype=torch.int32, device="cuda"),
                     torch.tensor([0, 50], dtype=torch.int32, device="cuda"), *inputs)
    chunked = state.clone()
    parts = []
    for lo, hi in [(0, 1), (1, 20), (20, 21), (21, 50)]:
        parts.append(ops.wkv7(chunked, torch.tensor([1], dtype=torch.int32, device="cuda"),
                              torch.tensor([0, hi - lo], dtype=torch.int32, device="cuda"),
                              *[x[lo:hi] for x in inputs]))
    assert _relative_error(torch.cat(parts), y_one) <= 1e-6
    assert _relative_error(chunked, one) <= 1e-6


def test_wkv7_accepts_strided_row_views() -> None:
    gen = torch.Generator(device="cuda").manual_seed(8)
    inputs = _wkv_inputs([3, 1, 4], 2, torch.float16, gen)
    wide = [torch.cat([x, torch.randn_like(x)], dim=1) for x in inputs]  # row stride 2C
    views = [x[:, : inputs[0].shape[1]] for x in wide]
    slots = torch.tensor([0, 2, 1], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32, device="cuda")
    state = torch.randn(3, 2, N, N, generator=gen, device="cuda") * 0.1
    a, b = state.clone(), state.clone()
    assert torch.equal(ops.wkv7(a, slots, cu, *views), ops.wkv7(b, slots, cu, *inputs))


# ------------------------------------------------------------------------------------------------
# sampler


def _batch(rows: int, gen: torch.Generator, temperature: list[float], top_p: list[float], top_k: list[int]) -> sampler.SamplingBatch:
    pick = lambda values: [values[i] for i in torch.randint(0, len(values), (rows,), generator=gen).tolist()]  # noqa: E731
    return sampler.SamplingBatch(
        temperature=torch.tensor(pick(temperature), dtype=torch.float32, device="cuda"),
        top_p=torch.tensor(pick(top_p), dtype=torch.float32, device="cuda"),
        top_k=torch.tensor(pick(top_k), dtype=torch.int64, device="cuda"),
        presence=torch.rand(rows, generator=gen).cuda(),
        frequency=torch.rand(rows, generator=gen).cuda(),
        decay=0.9 + 0.1 * torch.rand(rows, generator=gen).cuda(),
        seed32=torch.randint(0, 2**32, (rows,), generator=gen, dtype=torch.int64).cuda(),
        step=torch.randint(0, 10_000, (rows,), generator=gen, dtype=torch.int64).cuda(),
    )


def _penalty_pool(slots: int, vocab: int, gen: torch.Generator, shape: str = "spread") -> sampler.PenaltyPool:
    """Random penalties that keep the logits' shape: whole numbers for tied logits, tiny ones for
    concentrated logits."""
    pool = sampler.PenaltyPool(slots, vocab, device="cuda")
    if shape == "ties":
        penalties = torch.randint(0, 2, (slots, vocab), generator=gen).float()
    else:
        penalties = torch.rand(slots, vocab, generator=gen) * (0.002 if shape == "concentrated" else 2)
    pool.penalties.copy_(penalties.cuda())
    pool.seen.copy_(torch.rand(slots, vocab, generator=gen).cuda() < 0.01)
    return pool


def _clone_pool(pool: sampler.PenaltyPool) -> sampler.PenaltyPool:
    copy = sampler.PenaltyPool(*pool.penalties.shape, device="cuda")
    copy.penalties.copy_(pool.penalties)
    copy.seen.copy_(pool.seen)
    return copy


LOGIT_SHAPES = {
    "spread": lambda rows, vocab, gen: torch.randn(rows, vocab, generator=gen) * 3,
    # one histogram bin holds thousands of logits: the fast path refines within the bin
    "concentrated": lambda rows, vocab, gen: 5 + torch.randn(rows, vocab, generator=gen) * 0.01,
    # exact ties everywhere: kept sets end on ties, candidates end inside a tie
    "ties": lambda rows, vocab, gen: torch.randint(0, 6, (rows, vocab), generator=gen).float(),
}


@pytest.mark.parametrize("rejection", [False, True], ids=["exact", "rejection"])
@pytest.mark.parametrize("rows, shape", [(1, "spread"), (7, "spread"), (64, "spread"), (333, "spread"),
                                         (64, "concentrated"), (64, "ties")])  # fmt: skip
def test_sampler_kernel_matches_torch_twin(rows: int, shape: str, rejection: bool) -> None:
    """Greedy rows equal; a sampled row equals the twin's or, at most 1 in 100, differs where fp32
    sums decide a boundary either way (sampler_oracles.draw_accepts: the exact draw's interval, or
    a float64 replay of the rejection draw for the rows it serves); penalties updated alike."""
    gen = torch.Generator().manual_seed(rows)
    vocab = 65536
    logits = LOGIT_SHAPES[shape](rows, vocab, gen).cuda()
    slots_count = rows + 3
    slots = torch.randperm(slots_count, generator=gen)[:rows].cuda()
    batch = _batch(rows, gen, [0.0, 0.3, 1.0, 1.7], [1.0, 0.95, 0.5, 0.0], [0, 1, 7, 50, 1000])
    pool = _penalty_pool(slots_count, vocab, gen, shape)
    before = _clone_pool(pool)
    twin_pool = _clone_pool(pool)

    expected = sampler.sample(logits, slots, batch, twin_pool, rejection=rejection)
    _poison_next_allocation((rows,), torch.int64)
    actual = ops.sample(logits, slots, batch, pool, rejection=rejection)
    torch.cuda.synchronize()

    assert bool((actual >= 0).all()), "some rows got no sample written"
    greedy = batch.temperature <= 0
    assert torch.equal(actual[greedy], expected[greedy]), "greedy rows must equal the twin's argmax exactly"
    differing = (actual != expected).nonzero().flatten().tolist()
    assert len(differing) <= max(1, rows // 100), f"{len(differing)} of {rows} rows differ: {differing[:10]}"
    for row in differing:
        adjusted = (logits[row] - before.penalties[slots[row]]).cpu()
        settings = (float(batch.temperature[row]), int(batch.top_k[row]), float(batch.top_p[row]), int(batch.seed32[row]), int(batch.step[row]))
        assert draw_accepts(adjusted, *settings, int(actual[row]), rejection), (
            f"row {row}: kernel chose {int(actual[row])}, twin {int(expected[row])}, not a rounding boundary"
        )
    same = (actual == expected).nonzero().flatten()
    assert torch.allclose(pool.penalties[slots[same]], twin_pool.penalties[slots[same]], rtol=1e-6, atol=1e-6), "penalty update differs"
    assert torch.equal(pool.seen[slots[same]], twin_pool.seen[slots[same]]), "seen mask update differs"


def test_greedy_picks_the_lowest_id_among_tied_maxima() -> None:
    vocab = 4096
    logits = torch.randn(3, vocab, device="cuda")
    top = logits.max().item() + 1.0
    for row, ids in enumerate([[17, 900, 4000], [5, 6], [4095, 3000]]):
        logits[row, ids] = top
    batch = sampler.SamplingBatch(
        temperature=torch.zeros(3, device="cuda"), top_p=torch.ones(3, device="cuda"),
        top_k=torch.zeros(3, dtype=torch.int64, device="cuda"), presence=torch.zeros(3, device="cuda"),
        frequency=torch.zeros(3, device="cuda"), decay=torch.ones(3, device="cuda"),
        seed32=torch.zeros(3, dtype=torch.int64, device="cuda"), step=torch.zeros(3, dtype=torch.int64, device="cuda"),
    )  # fmt: skip
    pool = sampler.PenaltyPool(3, vocab, device="cuda")
    ids = ops.sample(logits, torch.arange(3, device="cuda"), batch, pool, update_penalties=False)
    assert ids.tolist() == [17, 5, 3000]


def test_seeded_rows_reproduce_whatever_else_is_in_the_batch() -> None:
    gen = torch.Generator().manual_seed(3)
    vocab = 65536
    logits = torch.randn(16, vocab, generator=gen).cuda()
    batch = _batch(16, gen, [0.8, 1.2], [0.9, 1.0], [0, 40])
    pool = sampler.PenaltyPool(16, vocab, device="cuda")
    slots = torch.arange(16, device="cuda")
    first = ops.sample(logits, slots, batch, pool, update_penalties=False)
    again = ops.sample(logits, slots, batch, pool, update_penalties=False)
    assert torch.equal(first, again), "the same inputs must give the same ids"
    pick = torch.tensor([11, 2, 7], device="cuda")
    sub = sampler.SamplingBatch(*(getattr(batch, f)[pick] for f in ("temperature", "top_p", "top_k", "presence", "frequency", "decay", "seed32", "step")))
    alone = ops.sample(logits[pick], slots[pick], sub, pool, update_penalties=False)
    assert torch.equal(alone, first[pick]), "a row's sample must not depend on the other rows"


def _chi_square_critical(df: int, alpha_z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + alpha_z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 12, 1.0), (1.3, 0, 0.8)])
def test_sampler_frequencies_follow_the_kept_distribution(temperature: float, top_k: int, top_p: float) -> None:
    gen = torch.Generator().manual_seed(5)
    vocab, draws = 30, 40_000
    row = torch.randn(vocab, generator=gen) * 1.5
    logits = row.expand(draws, vocab).contiguous().cuda()
    batch = sampler.SamplingBatch(
        temperature=torch.full((draws,), temperature, device="cuda"), top_p=torch.full((draws,), top_p, device="cuda"),
        top_k=torch.full((draws,), top_k, dtype=torch.int64, device="cuda"), presence=torch.zeros(draws, device="cuda"),
        frequency=torch.zeros(draws, device="cuda"), decay=torch.ones(draws, device="cuda"),
        seed32=torch.full((draws,), sampler.seed_to_seed32(99), dtype=torch.int64, device="cuda"),
        step=torch.arange(draws, dtype=torch.int64, device="cuda"),
    )  # fmt: skip
    pool = sampler.PenaltyPool(1, vocab, device="cuda")
    ids = ops.sample(logits, torch.zeros(draws, dtype=torch.int64, device="cuda"), batch, pool, update_penalties=False)
    probs = torch.softmax(row / temperature, dim=-1)
    kept = sampler.kept_mask(probs[None], torch.tensor([top_k]), torch.tensor([top_p]))[0]
    expected = torch.where(kept, probs, torch.zeros_like(probs)).double()
    expected = expected / expected.sum() * draws
    counts = torch.bincount(ids.cpu(), minlength=vocab).double()
    assert counts[~kept].sum() == 0, f"dropped ids were sampled: {counts[~kept].nonzero().flatten().tolist()}"
    chi2 = (((counts - expected) ** 2) / expected)[kept].sum().item()
    df = int(kept.sum()) - 1
    assert chi2 <= _chi_square_critical(df), f"chi-square {chi2:.1f} over {df} degrees of freedom (p < 0.001)"


def test_decode_step_with_sampling_replays_from_a_cuda_graph() -> None:
    gen = torch.Generator(device="cuda").manual_seed(11)
    rows, heads, vocab = 24, 2, 65536
    inputs = _wkv_inputs([1] * rows, heads, torch.float16, gen)
    state = torch.randn(rows + 1, heads, N, N, generator=gen, device="cuda") * 0.1
    slots = torch.arange(rows, device="cuda")
    slot_i32, cu = slots.to(torch.int32), torch.arange(rows + 1, dtype=torch.int32, device="cuda")
    logits = torch.randn(rows, vocab, generator=gen, device="cuda") * 3
    batch = _batch(rows, torch.Generator().manual_seed(1), [0.0, 1.0], [0.9], [0, 30])
    pool = sampler.PenaltyPool(rows, vocab, device="cuda")

    def step(st: torch.Tensor, pen: sampler.PenaltyPool) -> tuple[torch.Tensor, torch.Tensor]:
        y = ops.wkv7(st, slot_i32, cu, *inputs)
        return y, ops.sample(logits + y[:, :1].float(), slots, batch, pen)

    eager_state, eager_pool = state.clone(), _clone_pool(pool)
    eager_y, eager_ids = step(eager_state, eager_pool)

    graph_state, graph_pool = state.clone(), _clone_pool(pool)
    warm_state, warm_pool = state.clone(), _clone_pool(pool)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(warm_state, warm_pool)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_y, graph_ids = step(graph_state, graph_pool)
    graph_state.copy_(state)  # capture does not run the kernels; start replay from the same state
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_y, eager_y) and torch.equal(graph_state, eager_state), "WKV replay differs from eager"
    assert torch.equal(graph_ids, eager_ids), "sampler replay differs from eager"
    assert torch.equal(graph_pool.penalties, eager_pool.penalties), "penalty update in replay differs from eager"


def _every_op_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """fp16 inputs for one call of each declared op: 3 slots of 1, 2 and 1 rows in a pool of 6."""
    C, rows, vocab = 2 * N, 4, 1000
    named = {name: (torch.randn(rows, C, generator=gen, device="cuda") * 0.5).half()
             for name in ("x", "delta", "k", "v", "w_lora", "a_lora", "v_lora", "v_first", "g")}  # fmt: skip
    named.update({name: torch.randn(C, generator=gen, device="cuda").half() for name in ("weight", "bias", "w0", "a0", "v0", "k_k", "k_a")})
    named["mixes"] = (torch.randn(6, C, generator=gen, device="cuda") * 0.5).half()
    named["shift"] = torch.randn(6, C, generator=gen, device="cuda").half()
    named["state"] = (torch.randn(6, 2, N, N, generator=gen, device="cuda") * 0.1).half()
    named["slot_idx"] = torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda")
    named["matrix"] = (torch.randn(C, 272, generator=gen, device="cuda") * 0.1).half()  # the few-row products: gemv, int8_gemv
    named["q"] = torch.randint(-127, 128, (C, 272), generator=gen, device="cuda", dtype=torch.int32).to(torch.int8)
    named["scale"] = torch.rand(272, generator=gen, device="cuda") * 0.01
    named["counters"] = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    named["cu_seqlens"] = torch.tensor([0, 1, 3, 4], dtype=torch.int32, device="cuda")
    named["decode_cu"] = torch.arange(4, dtype=torch.int32, device="cuda")
    named["logits"] = torch.randn(3, vocab, generator=gen, device="cuda") * 3
    named["penalties"] = torch.rand(6, vocab, generator=gen, device="cuda")
    named["seen"] = torch.rand(6, vocab, generator=gen, device="cuda") > 0.9
    return named


def _run_every_op(t: dict[str, torch.Tensor], batch: sampler.SamplingBatch, called: set[str]) -> list[torch.Tensor]:
    """One call of each declared op on `t` (updated in place as the ops do); returns the outputs."""
    out = [ops.add_layer_norm(t["x"], t["delta"], t["weight"], t["bias"])]
    out.append(ops.shift_mix(t["x"], t["shift"], t["slot_idx"], t["cu_seqlens"], t["mixes"]))
    out.append(ops.norm_mix_decode(t["x"][:3], t["delta"][:3], t["weight"], t["bias"], t["shift"], t["slot_idx"], t["mixes"]))
    out += list(ops.norm_mix_rows(t["x"], t["delta"], t["weight"], t["bias"], t["shift"], t["slot_idx"], t["cu_seqlens"], t["mixes"]))
    w, a, b = ops.wkv_prep(
        t["k"], t["v"], t["w_lora"], t["a_lora"], t["v_lora"], t["v_first"], t["w0"], t["a0"], t["v0"], t["k_k"], t["k_a"]
    )
    y = ops.wkv7(t["state"], t["slot_idx"], t["cu_seqlens"], t["x"], w, t["k"], t["v"], a, b)
    rows = [t["x"][:3], w[:3], t["k"][:3], t["v"][:3], a[:3], b[:3]]
    decode = ops.wkv7(t["state"], t["slot_idx"], t["decode_cu"], *rows, single_token=True)
    out += [w, a, b, y, decode, ops.gn_bonus_gate(y, t["x"], t["k"], t["v"], t["g"], t["k_k"], t["weight"], t["bias"])]
    three = [t[name][:3] for name in ("x", "k", "v", "g", "w_lora", "a_lora", "v_lora", "v_first")]
    out.append(ops.wkv_decode_step(t["state"], t["slot_idx"], *three, t["w0"], t["a0"], t["v0"], t["k_k"], t["k_a"], t["k_k"], t["weight"], t["bias"]))
    out.append(ops.relu_square(t["delta"]))
    pool = sampler.PenaltyPool.wrap(t["penalties"], t["seen"])
    out.append(ops.sample(t["logits"] + y[:3, :1].float(), t["slot_idx"].long(), batch, pool))
    out.append(ops.gemv(t["x"][:3], t["matrix"], t["counters"]))
    out.append(ops.int8_gemv(t["x"][:3], t["q"], t["scale"], t["counters"]))
    called.update({"add_layer_norm", "shift_mix", "norm_mix_decode", "norm_mix_rows", "wkv_prep", "wkv7", "gn_bonus_gate", "wkv_decode_step", "relu_square", "sample", "gemv", "int8_gemv"})
    return out


def test_every_op_runs_its_kernel_without_host_syncs_and_replays_from_a_cuda_graph() -> None:
    gen = torch.Generator(device="cuda").manual_seed(5)
    inputs = _every_op_inputs(gen)
    batch = _batch(3, torch.Generator().manual_seed(2), [0.0, 0.8], [0.9, 1.0], [0, 20])
    called: set[str] = set()
    eager = {name: t.clone() for name, t in inputs.items()}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside an op raises
    try:
        eager_out = _run_every_op(eager, batch, called)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert called == set(ops.declared_ops()), f"ops this test does not run: {sorted(set(ops.declared_ops()) - called)}"
    assert set(ops.declared_ops()) <= set(ops.registered_cuda_ops()), "every op must run its CUDA kernel here"

    static = {name: t.clone() for name, t in inputs.items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _run_every_op({name: t.clone() for name, t in inputs.items()}, batch, set())  # warm-up
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = _run_every_op(static, batch, set())
    for name, t in static.items():
        t.copy_(inputs[name])  # start the replay from the inputs eager started from
    graph.replay()
    torch.cuda.synchronize()
    for index, (got, want) in enumerate(zip(graph_out, eager_out)):
        assert torch.equal(got, want), f"output {index} of the replay differs from eager"
    for name in ("x", "shift", "k", "v", "state", "penalties", "seen"):
        assert torch.equal(static[name], eager[name]), f"{name}, updated in place, differs between replay and eager"


# ------------------------------------------------------------------------------------------------
# argument checks


_BAD_CALLS = {
    "wkv7 single_token row count": "ops.wkv7(state, slots[:4], cu[:5], *rows, single_token=True)",
    "wkv7 input shape": "ops.wkv7(state, slots, cu, rows[0][:, :64], *rows[1:])",
    "wkv7 slot_idx on the host": "ops.wkv7(state, slots.cpu(), cu, *rows)",
    "wkv7 rows_per_thread": "ops.wkv7(state, slots, cu, *rows, rows_per_thread=4)",
    "wkv7 direct rows at one row a thread": "ops.wkv7(state, slots, cu, *rows, direct_rows=True)",
    "wkv7 scaled rows at one row a thread": "ops.wkv7(state, slots, cu, *rows, scaled_rows=True)",
    "layer norm weight dtype": "torch.ops.albatross.add_layer_norm(rows[0].float(), None, rows[0][0], rows[0][0], 1e-5)",
    "layer norm shape": "torch.ops.albatross.add_layer_norm(rows[0], None, rows[0][0, :64], rows[0][0, :64], 1e-5)",
    "sampler logits dtype": "torch.ops.albatross.sample(rows[0], slots.long(), *per_row(5), penalties, seen, True)",
    "sampler row count": "torch.ops.albatross.sample(rows[0].float(), slots.long()[:4], *per_row(5), penalties, seen, True)",
}
_BAD_CALL_SCRIPT = """
import sys, torch
from albatross import cuda_ops, ops
cuda_ops.enable_cuda_kernels()
assert set(ops.declared_ops()) <= set(ops.registered_cuda_ops()), "the kernels, not the twins, must check these arguments"
rows = [torch.randn(5, 128, device="cuda", dtype=torch.half) for _ in range(6)]
state = torch.zeros(5, 2, 64, 64, device="cuda", dtype=torch.half)
slots = torch.arange(5, dtype=torch.int32, device="cuda")
cu = torch.arange(6, dtype=torch.int32, device="cuda")
penalties = torch.zeros(5, 128, device="cuda")
seen = torch.zeros(5, 128, dtype=torch.bool, device="cuda")
def per_row(n):
    f, i = torch.zeros(n, device="cuda"), torch.zeros(n, dtype=torch.long, device="cuda")
    return f, f, i, f, f, f, i, i  # temperature, top_p, top_k, presence, frequency, decay, seed32, step
try:
    CALL
except RuntimeError as error:
    print("RAISED:", str(error).splitlines()[0])
    sys.exit(0)
print("NO ERROR")
sys.exit(1)
"""


@pytest.mark.parametrize("case", sorted(_BAD_CALLS))
def test_bad_kernel_arguments_raise_instead_of_crashing(case: str) -> None:
    """Each call in a child process: a check that crashes takes only the child down."""
    script = _BAD_CALL_SCRIPT.replace("CALL", _BAD_CALLS[case])
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                           cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert child.returncode == 0 and "RAISED:" in child.stdout, (
        f"rc {child.returncode}: {child.stdout[-300:]} {child.stderr[-600:]}"
    )
