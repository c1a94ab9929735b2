"""Batched forward: chunking, slot independence, input validation, and the WKV op."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from albatross import ops
from albatross.model import RWKV7
from albatross.state import SlotState, StatePool

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Path) -> RWKV7:
    return RWKV7.load(tiny_checkpoint, progress=False)


def _tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(65536) for _ in range(count)]


def _assert_close(expected: torch.Tensor, actual: torch.Tensor, what: str) -> None:
    diff = (expected.float() - actual.float()).abs().max().item()
    assert diff <= TOLERANCE, f"{what}: max abs difference {diff:.2e} > {TOLERANCE}"


def _assert_same_state(pool_a: StatePool, slot_a: int, pool_b: StatePool, slot_b: int, what: str) -> None:
    a, b = pool_a.read(slot_a), pool_b.read(slot_b)
    for name in ("att_shift", "ffn_shift", "wkv"):
        _assert_close(getattr(a, name), getattr(b, name), f"{what}: {name}")


@pytest.mark.parametrize("chunk", [1, 3, 7, 24])
def test_chunked_prefill_equals_token_by_token_decode(model: RWKV7, chunk: int) -> None:
    prompt = _tokens(seed=1, count=24)
    pool = StatePool(model, batch_size=2)
    stepwise = [model.forward(pool, [0], [[t]])[0] for t in prompt]
    chunked: list[torch.Tensor] = []
    for start in range(0, len(prompt), chunk):
        chunked.extend(model.forward(pool, [1], [prompt[start : start + chunk]], full_output=True)[0])
    for i, (expected, actual) in enumerate(zip(stepwise, chunked, strict=True)):
        _assert_close(expected, actual, f"chunk size {chunk}, token {i}")
    _assert_same_state(pool, 0, pool, 1, f"chunk size {chunk}, final state")


def test_last_token_logits_equal_the_last_row_of_full_output(model: RWKV7) -> None:
    prompt = _tokens(seed=2, count=9)
    pool = StatePool(model, batch_size=2)
    last = model.forward(pool, [0], [prompt])
    full = model.forward(pool, [1], [prompt], full_output=True)
    _assert_close(full[0][-1], last[0], "last row of full_output vs last-token logits")


def test_a_slot_does_not_depend_on_the_other_slots_in_the_call_or_their_order(model: RWKV7) -> None:
    rng = random.Random(3)
    batch_size = 6
    solo_pool = StatePool(model, batch_size=1)
    shared_pool = StatePool(model, batch_size=batch_size)
    target = 4  # the slot under test in the shared pool
    schedule = [_tokens(seed=10 + i, count=n) for i, n in enumerate([5, 1, 1, 3, 1, 1, 2, 1])]
    for step, chunk in enumerate(schedule):
        expected = model.forward(solo_pool, [0], [chunk])[0]
        # Random company: other slots in random order, each with a prefill chunk or a decode token.
        others = rng.sample([s for s in range(batch_size) if s != target], k=rng.randint(0, batch_size - 1))
        slots = others + [target]
        rng.shuffle(slots)
        tokens = [chunk if s == target else _tokens(seed=rng.randrange(10**6), count=rng.choice([1, 1, 4])) for s in slots]
        actual = model.forward(shared_pool, slots, tokens)
        _assert_close(expected, actual[slots.index(target)], f"step {step} with slots {slots}")
    _assert_same_state(solo_pool, 0, shared_pool, target, "state after the mixed schedule")


def test_a_batch_of_decode_slots_equals_each_slot_alone(model: RWKV7) -> None:
    pool = StatePool(model, batch_size=4)
    alone = StatePool(model, batch_size=4)
    prompts = [_tokens(seed=20 + s, count=3 + s) for s in range(4)]
    model.forward(pool, [0, 1, 2, 3], prompts)
    for s in range(4):
        model.forward(alone, [s], [prompts[s]])
    next_tokens = [[t] for t in _tokens(seed=30, count=4)]
    batched = model.forward(pool, [3, 1, 0, 2], [next_tokens[3], next_tokens[1], next_tokens[0], next_tokens[2]])
    for row, s in enumerate([3, 1, 0, 2]):
        _assert_close(model.forward(alone, [s], [next_tokens[s]])[0], batched[row], f"decode slot {s}")


def test_untouched_slots_keep_their_state(model: RWKV7) -> None:
    pool = StatePool(model, batch_size=3)
    model.forward(pool, [0, 1, 2], [_tokens(seed=40, count=4)] * 3)
    before = pool.read(1)
    model.forward(pool, [0, 2], [_tokens(seed=41, count=5), [7]])
    after = pool.read(1)
    for name in ("att_shift", "ffn_shift", "wkv"):
        assert torch.equal(getattr(before, name), getattr(after, name)), f"slot 1 {name} changed though not in the call"


@pytest.mark.parametrize(
    ("slots", "tokens", "message"),
    [
        ([0, 0], [[1], [2]], "distinct"),
        ([5], [[1]], "out of range"),
        ([-1], [[1]], "out of range"),
        ([0], [[]], "empty token list"),
        ([0], [[65536]], "token id 65536"),
        ([0], [[-3]], "token id -3"),
        ([0, 1], [[1]], "token lists"),
        ([], [], "at least one slot"),
    ],
)
def test_forward_refuses_invalid_inputs_with_a_clear_error(
    model: RWKV7, slots: list[int], tokens: list[list[int]], message: str
) -> None:
    pool = StatePool(model, batch_size=2)
    with pytest.raises(ValueError, match=message):
        model.forward(pool, slots, tokens)


def test_forward_refuses_a_pool_of_another_model(model: RWKV7, small_checkpoint: Path) -> None:
    other = RWKV7.load(small_checkpoint, progress=False)
    with pytest.raises(ValueError, match="different model"):
        model.forward(StatePool(other, batch_size=1), [0], [[1]])


# ------------------------------------------------------------------------------------------------
# the WKV op


def _naive_wkv7(state: torch.Tensor, r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The contract of docs/architecture.md written out for one slot, token by token, head by head."""
    S = state.clone().double()
    H, N, _ = S.shape
    y = torch.empty(r.shape[0], H * N, dtype=torch.float64)
    for t in range(r.shape[0]):
        for h in range(H):
            cols = slice(h * N, (h + 1) * N)
            decay = torch.exp(-torch.exp(w[t, cols].double()))
            aa, bb, kk, vv, rr = (x[t, cols].double() for x in (a, b, k, v, r))
            S[h] = S[h] * decay[None, :] + (S[h] @ aa[:, None]) @ bb[None, :] + vv[:, None] @ kk[None, :]
            y[t, cols] = S[h] @ rr
    return y, S


def test_wkv7_torch_matches_the_contract_for_mixed_prefill_and_decode_slots() -> None:
    torch.manual_seed(0)
    B, H, N = 5, 2, 64
    C = H * N
    lengths = {3: 4, 0: 1, 4: 2, 1: 1}  # slot -> rows, in call order
    total = sum(lengths.values())
    state = torch.randn(B, H, N, N) * 0.1
    original = state.clone()
    r, k, v = (torch.randn(total, C) * 0.5 for _ in range(3))
    w = -torch.rand(total, C) * 3 - 0.5
    kk = torch.nn.functional.normalize(torch.randn(total, H, N), dim=-1).view(total, C)
    a_rate = torch.rand(total, C)
    cu = torch.tensor([0, *torch.tensor(list(lengths.values())).cumsum(0).tolist()], dtype=torch.int32)
    slot_idx = torch.tensor(list(lengths), dtype=torch.int32)

    y = ops.wkv7_torch(state, slot_idx, cu, r, w, k, v, -kk, kk * a_rate)

    for s, (slot, _) in enumerate(lengths.items()):
        rows = slice(int(cu[s]), int(cu[s + 1]))
        expected_y, expected_state = _naive_wkv7(original[slot], r[rows], w[rows], k[rows], v[rows], -kk[rows], (kk * a_rate)[rows])
        _assert_close(expected_y, y[rows], f"y of slot {slot}")
        _assert_close(expected_state, state[slot], f"state of slot {slot}")
    assert torch.equal(state[2], original[2]), "slot 2 was not in the call but its state changed"


def test_wkv7_keeps_a_16_bit_state_in_its_dtype_and_returns_the_activation_dtype() -> None:
    torch.manual_seed(1)
    state = (torch.randn(2, 1, 64, 64) * 0.1).to(torch.bfloat16)
    r, k, v, a, b = (torch.randn(3, 64) * 0.3 for _ in range(5))
    w = -torch.rand(3, 64) - 0.5
    cu = torch.tensor([0, 3], dtype=torch.int32)
    y = ops.wkv7(state, torch.tensor([1], dtype=torch.int32), cu, r, w, k, v, a, b)
    assert state.dtype == torch.bfloat16 and y.dtype == torch.float32 and y.shape == (3, 64)


def test_flat_batch_marks_decode_steps_for_the_single_token_wkv_path() -> None:
    cpu = torch.device("cpu")
    assert ops.FlatBatch.build([3, 0, 5], [1, 1, 1], cpu).single_token
    assert not ops.FlatBatch.build([3, 0, 5], [1, 4, 1], cpu).single_token
    assert not ops.FlatBatch.build([2], [7], cpu).single_token


@pytest.mark.parametrize("cuts", [[[1, 16, 39], [], [8]], [[], [], [8]], [[5, 6], [], []]], ids=["around", "last", "first"])
def test_forward_saving_captures_the_state_each_prefix_leaves(model: RWKV7, cuts: list[list[int]]) -> None:
    """The prefix cache's checkpoints inside a chunk: the states `forward_saving` captures equal
    the slot states after feeding each prefix alone, and the call's logits and final states are
    `forward`'s, in the caller's slot order (the model moves the capturing slots last)."""
    prompts = [_tokens(seed=11, count=40), _tokens(seed=12, count=1), _tokens(seed=13, count=23)]
    pool = StatePool(model, batch_size=6)
    for slot in range(6):  # non-zero starting states: the captures continue each slot's history
        model.forward(pool, [slot], [_tokens(seed=20 + slot, count=3)])
    reference = StatePool(model, batch_size=6)
    for slot in range(6):
        reference.write(slot, pool.read(slot))
    logits, saved = model.forward_saving(pool, [4, 0, 2], prompts, cuts)
    expected = model.forward(reference, [4, 0, 2], prompts)
    assert isinstance(expected, torch.Tensor)
    _assert_close(expected, logits, "logits")
    for slot in (4, 0, 2):
        _assert_same_state(pool, slot, reference, slot, f"slot {slot} after the call")
    assert [len(states) for states in saved] == [len(c) for c in cuts]
    for slot, prompt, slot_cuts, states in zip((4, 0, 2), prompts, cuts, saved):
        for cut, state in zip(slot_cuts, states):
            alone = StatePool(model, batch_size=6)
            alone.write(slot, _start_of(model, slot))
            model.forward(alone, [slot], [prompt[:cut]])
            want = alone.read(slot)
            for name in ("att_shift", "ffn_shift", "wkv"):
                _assert_close(getattr(want, name), getattr(state, name), f"slot {slot} after {cut} tokens: {name}")


def _start_of(model: RWKV7, slot: int) -> SlotState:
    pool = StatePool(model, batch_size=6)
    model.forward(pool, [slot], [_tokens(seed=20 + slot, count=3)])
    return pool.read(slot)


def test_forward_saving_refuses_cuts_outside_a_prompt(model: RWKV7) -> None:
    pool = StatePool(model, batch_size=2)
    for cuts in ([[0]], [[5]], [[3, 2]]):
        with pytest.raises(ValueError, match="cuts"):
            model.forward_saving(pool, [0], [_tokens(seed=1, count=5)], cuts)
    with pytest.raises(ValueError, match="lists of cuts"):
        model.forward_saving(pool, [0], [_tokens(seed=1, count=5)], [[1], [2]])
    with pytest.raises(ValueError, match="lists of cuts"):  # even when none of them cuts
        model.forward_saving(pool, [0], [_tokens(seed=1, count=5)], [[], []])
