"""StatePool and SlotState: layout, reset, copy, read/write, bytes, and the memory check."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from albatross.model import RWKV7
from albatross.state import SlotState, StatePool, slot_bytes

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Path) -> RWKV7:
    return RWKV7.load(tiny_checkpoint, progress=False)


def _tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(65536) for _ in range(count)]


def _random_slot_state(model: RWKV7, seed: int, wkv_dtype: torch.dtype = torch.float32) -> SlotState:
    generator = torch.Generator().manual_seed(seed)
    c = model.config
    return SlotState(
        att_shift=torch.randn(c.n_layer, c.n_embd, generator=generator),
        ffn_shift=torch.randn(c.n_layer, c.n_embd, generator=generator),
        wkv=torch.randn(c.n_layer, c.n_head, c.head_size, c.head_size, generator=generator).to(wkv_dtype),
    )


def _assert_states_equal(expected: SlotState, actual: SlotState, what: str) -> None:
    for name in ("att_shift", "ffn_shift", "wkv"):
        a, b = getattr(expected, name), getattr(actual, name)
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {name} is {b.dtype} {list(b.shape)}, expected {a.dtype} {list(a.shape)}"
        assert torch.equal(a, b), f"{what}: {name} differs by {(a.float() - b.float()).abs().max():.2e}"


def test_pool_tensors_have_the_documented_layout_and_start_zeroed(model: RWKV7) -> None:
    c = model.config
    pool = StatePool(model, batch_size=3)
    assert pool.att_shift.shape == (c.n_layer, 3, c.n_embd) and pool.att_shift.dtype == model.dtype
    assert pool.ffn_shift.shape == (c.n_layer, 3, c.n_embd) and pool.ffn_shift.dtype == model.dtype
    assert pool.wkv.shape == (c.n_layer, 3, c.n_head, c.head_size, c.head_size) and pool.wkv.dtype == torch.float32
    assert all(not t.any() for t in (pool.att_shift, pool.ffn_shift, pool.wkv)), "a new pool is not zeroed"


def test_bytes_per_slot_is_the_exact_size_of_one_slot(model: RWKV7) -> None:
    c = model.config
    for state_dtype, wkv_item in ((torch.float32, 4), (torch.float16, 2), (torch.bfloat16, 2)):
        pool = StatePool(model, batch_size=2, state_dtype=state_dtype)
        expected = 2 * c.n_layer * c.n_embd * 4 + c.n_layer * c.n_head * 64 * 64 * wkv_item
        assert pool.bytes_per_slot == expected == slot_bytes(c, model.dtype, state_dtype)
        assert pool.read(0).nbytes == expected, "a read slot's nbytes differs from bytes_per_slot"
        assert pool.wkv.dtype == state_dtype


def test_a_reset_slot_behaves_like_a_fresh_one(model: RWKV7) -> None:
    pool = StatePool(model, batch_size=2)
    model.forward(pool, [0, 1], [_tokens(seed=1, count=6), _tokens(seed=2, count=3)])
    pool.reset([0])
    assert not pool.read(0).wkv.any(), "reset left a non-zero WKV state"
    prompt = _tokens(seed=3, count=5)
    fresh = StatePool(model, batch_size=1)
    expected = model.forward(fresh, [0], [prompt])[0]
    actual = model.forward(pool, [0], [prompt])[0]
    assert torch.allclose(expected, actual, atol=TOLERANCE, rtol=0), "a reset slot gives other logits than a fresh one"
    assert pool.read(1).wkv.any(), "reset of slot 0 also cleared slot 1"


def test_a_copied_slot_continues_exactly_like_the_original(model: RWKV7) -> None:
    pool = StatePool(model, batch_size=4)
    model.forward(pool, [1], [_tokens(seed=4, count=7)])
    pool.copy(1, [0, 3])
    for slot in (0, 3):
        _assert_states_equal(pool.read(1), pool.read(slot), f"copy 1 -> {slot}")
    continuation = _tokens(seed=5, count=4)
    out = model.forward(pool, [1, 0, 3], [continuation] * 3)
    assert torch.allclose(out[0], out[1], atol=TOLERANCE, rtol=0) and torch.allclose(out[0], out[2], atol=TOLERANCE, rtol=0), (
        "copies diverged from the original after the same tokens"
    )
    assert not pool.read(2).wkv.any(), "copy touched a slot it was not given"


def test_read_then_write_round_trips_a_state_exactly(model: RWKV7) -> None:
    pool = StatePool(model, batch_size=3)
    state = _random_slot_state(model, seed=6)
    pool.write(2, state)
    read = pool.read(2)
    assert read.device == torch.device("cpu")
    _assert_states_equal(state, read, "write then read")
    read.wkv.add_(1.0)  # a read state is a copy: changing it leaves the pool alone
    _assert_states_equal(state, pool.read(2), "pool after editing the read copy")
    assert not pool.read(1).wkv.any(), "write touched another slot"


def test_written_state_continues_like_the_slot_it_was_read_from(model: RWKV7) -> None:
    source = StatePool(model, batch_size=1)
    target = StatePool(model, batch_size=2)
    model.forward(source, [0], [_tokens(seed=7, count=5)])
    target.write(1, source.read(0).to("cpu"))
    next_tokens = [_tokens(seed=8, count=2)]
    assert torch.allclose(model.forward(source, [0], next_tokens), model.forward(target, [1], next_tokens), atol=TOLERANCE, rtol=0)


def test_write_refuses_a_state_of_another_shape(model: RWKV7) -> None:
    pool = StatePool(model, batch_size=1)
    good = _random_slot_state(model, seed=9)
    bad = SlotState(good.att_shift, good.ffn_shift, good.wkv[:, :1].clone())
    with pytest.raises(ValueError, match="wkv has shape"):
        pool.write(0, bad)


def test_slot_state_refuses_inconsistent_tensors() -> None:
    with pytest.raises(ValueError, match="shift vectors"):
        SlotState(torch.randn(2, 128), torch.randn(3, 128), torch.randn(2, 2, 64, 64))
    with pytest.raises(ValueError, match="wkv must be"):
        SlotState(torch.randn(2, 128), torch.randn(2, 128), torch.randn(2, 64, 64))


@pytest.mark.parametrize("wkv_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_bytes_round_trip_keeps_dtypes_shapes_and_values(model: RWKV7, wkv_dtype: torch.dtype) -> None:
    state = _random_slot_state(model, seed=10, wkv_dtype=wkv_dtype)
    data = state.to_bytes()
    assert len(data) < state.nbytes + 256, f"serialized state is {len(data)} bytes for {state.nbytes} of tensors"
    _assert_states_equal(state, SlotState.from_bytes(data), "bytes round trip")


def test_from_bytes_refuses_corrupt_data(model: RWKV7) -> None:
    data = _random_slot_state(model, seed=11).to_bytes()
    with pytest.raises(ValueError, match="bad magic"):
        SlotState.from_bytes(b"JUNK" + data[4:])
    with pytest.raises(ValueError, match="truncated"):
        SlotState.from_bytes(data[:-10])
    with pytest.raises(ValueError, match="trailing"):
        SlotState.from_bytes(data + b"\0")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda pool: pool.reset([2]), "slot 2 out of range"),
        (lambda pool: pool.copy(0, [5]), "slot 5 out of range"),
        (lambda pool: pool.copy(-1, [0]), "slot -1 out of range"),
        (lambda pool: pool.read(2), "slot 2 out of range"),
    ],
)
def test_pool_methods_refuse_slots_out_of_range(model: RWKV7, call: object, message: str) -> None:
    pool = StatePool(model, batch_size=2)
    with pytest.raises(ValueError, match=message):
        call(pool)  # type: ignore[operator]


def test_pool_refuses_a_batch_that_does_not_fit_in_free_device_memory(model: RWKV7, monkeypatch: pytest.MonkeyPatch) -> None:
    # Exercise the CUDA pre-check on the CPU: a model that claims to live on a GPU with 10 slots of free memory.
    per_slot = slot_bytes(model.config, model.dtype)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * per_slot + 5, 80 * 2**30))
    fake = type("FakeModel", (), {"config": model.config, "dtype": model.dtype, "device": torch.device("cuda", 0)})()
    with pytest.raises(MemoryError, match="at most 10 slots fit"):
        StatePool(fake, batch_size=11)  # type: ignore[arg-type]


def test_pool_refuses_a_bad_batch_size_or_state_dtype(model: RWKV7) -> None:
    with pytest.raises(ValueError, match="batch_size"):
        StatePool(model, batch_size=0)
    with pytest.raises(ValueError, match="state_dtype"):
        StatePool(model, batch_size=1, state_dtype=torch.int32)


@pytest.mark.parametrize("state_dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_wkv_state_stays_close_to_the_fp32_state(model: RWKV7, state_dtype: torch.dtype) -> None:
    prompt, continuation = _tokens(seed=12, count=12), [[t] for t in _tokens(seed=13, count=4)]
    full = StatePool(model, batch_size=1)
    half = StatePool(model, batch_size=1, state_dtype=state_dtype)
    model.forward(full, [0], [prompt])
    model.forward(half, [0], [prompt])
    for step, token in enumerate(continuation):
        expected, actual = model.forward(full, [0], [token])[0], model.forward(half, [0], [token])[0]
        diff = (expected - actual).abs().max().item()
        assert diff <= 0.02 * expected.abs().max().item(), f"{state_dtype} state: step {step} logits differ by {diff:.3f}"
    assert half.wkv.dtype == state_dtype
