"""The chunked-parallel WKV-7 (albatross.wkv_chunked, its Triton kernels and the dispatch
policy) computes the sequential recurrence: exactly in float64, within the sequential kernel's
own rounding in fp32, and the Triton kernels (run by Triton's CPU interpreter) as their twin."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from albatross import ops, wkv_dispatch
from albatross.wkv_chunked import CHUNK, unit_lower_inverse, wkv7_chunked_torch
from interpreter_cases import interpreter_cases
from wkv_reference import flat_batch_args, wkv7_float64, wkv_inputs

HERE = Path(__file__).resolve().parent


def _slot_states(state: torch.Tensor, slot_idx: torch.Tensor) -> torch.Tensor:
    return state[slot_idx.long()].double()


@pytest.mark.parametrize(
    "lengths, heads, scale",
    [
        ([1], 2, None),
        ([CHUNK], 2, None),
        ([CHUNK + 1], 1, None),
        ([4097], 1, None),
        ([5, 1, 130, 0, 17, 64], 3, None),
        ([40, 3], 2, 3.0),  # decays far outside the model's range: some chunks take the exact fallback
    ],
    ids=["1 token", "one chunk", "chunk + 1", "4097 tokens", "mixed slots", "extreme decays"],
)
def test_chunked_form_is_the_recurrence_in_float64(lengths: list[int], heads: int, scale: float | None) -> None:
    gen = torch.Generator().manual_seed(sum(lengths) + heads)
    inputs = wkv_inputs(lengths, heads, torch.float64, gen, log_decay_scale=scale)
    pool = len(lengths) + 3
    slot_idx, cu = flat_batch_args(lengths, pool, gen)
    state = torch.randn(pool, heads, 64, 64, generator=gen, dtype=torch.float64) * 0.3
    y_ref, final_ref = wkv7_float64(state, slot_idx, cu, *inputs)
    chunked = state.clone()
    y = wkv7_chunked_torch(chunked, slot_idx, cu, *inputs, compute_dtype=torch.float64)
    assert (y - y_ref).abs().max().item() < 1e-12
    assert (_slot_states(chunked, slot_idx) - final_ref).abs().max().item() < 1e-12
    others = [s for s in range(pool) if s not in slot_idx.tolist()]
    assert torch.equal(chunked[others], state[others]), "slots outside the call changed"


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_chunked_fp32_final_state_error_is_within_twice_the_sequential_kernels(state_dtype: torch.dtype) -> None:
    """The issue's bar: against a float64 reference on the same inputs (fp16 activations, as
    served), the chunked form's final-state error is at most 2x the sequential recurrence's."""
    lengths, heads = [400, 130, 1], 2
    gen = torch.Generator().manual_seed(7)
    inputs = wkv_inputs(lengths, heads, torch.float16, gen)
    slot_idx, cu = flat_batch_args(lengths, 4, gen)
    state = (torch.randn(4, heads, 64, 64, generator=gen) * 0.3).to(state_dtype)
    y_ref, final_ref = wkv7_float64(state, slot_idx, cu, *inputs)
    sequential, chunked = state.clone(), state.clone()
    ops.wkv7_torch(sequential, slot_idx, cu, *inputs)
    wkv7_chunked_torch(chunked, slot_idx, cu, *inputs)
    seq_error = (_slot_states(sequential, slot_idx) - final_ref).abs().max().item()
    chunked_error = (_slot_states(chunked, slot_idx) - final_ref).abs().max().item()
    assert chunked_error <= 2 * seq_error, f"chunked {chunked_error:.2e} vs sequential {seq_error:.2e}"


def test_unit_lower_inverse_inverts_i_minus_m() -> None:
    gen = torch.Generator().manual_seed(3)
    M = torch.randn(5, CHUNK, CHUNK, generator=gen, dtype=torch.float64).tril(-1) * 0.5
    identity = torch.eye(CHUNK, dtype=torch.float64)
    assert torch.allclose((identity - M) @ unit_lower_inverse(M), identity.expand(5, -1, -1), atol=1e-10)


def test_inverse_stays_exact_when_consecutive_keys_align() -> None:
    """Repeated tokens give M_ab entries near -1 below the diagonal; forward substitution keeps
    the bidiagonal inverse exact where a product of powers of M would cancel thousands."""
    M = -torch.ones(CHUNK, CHUNK).tril(-1)
    T = unit_lower_inverse(M)
    expected = torch.eye(CHUNK) - torch.diag(torch.ones(CHUNK - 1), -1)
    assert torch.equal(T, expected)


def test_policy_takes_the_chunked_kernel_only_for_few_long_chunks() -> None:
    policy = wkv_dispatch.ChunkedPolicy(min_tokens=256, max_long_heads=1024)
    assert policy.prefers_chunked((4096,), heads=64)
    assert policy.prefers_chunked((4096, 1, 1, 1), heads=64)  # decode rows ride along
    assert not policy.prefers_chunked((255, 1), heads=64)
    assert not policy.prefers_chunked((512,) * 64, heads=64)  # 4096 chains fill the GPU sequentially
    assert policy.prefers_chunked((512,) * 16, heads=64)
    assert not wkv_dispatch.ChunkedPolicy(enabled=False).prefers_chunked((4096,), heads=64)
    with pytest.raises(ValueError):
        wkv_dispatch.ChunkedPolicy(min_tokens=1)


def test_dispatch_on_cpu_is_the_sequential_twin() -> None:
    gen = torch.Generator().manual_seed(11)
    lengths = [300, 1]
    inputs = wkv_inputs(lengths, 1, torch.float32, gen)
    state = torch.randn(3, 1, 64, 64, generator=gen) * 0.3
    batch = ops.FlatBatch.build([2, 0], lengths, torch.device("cpu"))
    expected_state = state.clone()
    expected = ops.wkv7_torch(expected_state, batch.slot_idx, batch.cu_seqlens, *inputs)
    got = wkv_dispatch.wkv7(state, batch, *inputs)
    assert torch.equal(got, expected) and torch.equal(state, expected_state)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_match_their_twin_in_the_interpreter() -> None:
    results = interpreter_cases(HERE / "wkv_chunked_interpreter.py")
    assert len(results) == 16, [result.get("name") for result in results]
    tolerance = {"fp32": 2e-6, "fp16": 2e-3, "bf16": 1.6e-2}  # a few fp32 ulps; one 16-bit rounding
    for result in results:
        assert result["finite"] and result["untouched_equal"], result
        assert result["y_diff"] <= tolerance[result["act_dtype"]] * max(1.0, result["y_scale"]), result
        assert result["state_diff"] <= tolerance[result["state_dtype"]] * max(1.0, result["state_scale"]), result


def test_the_default_policy_chunks_one_long_slot_only() -> None:
    """The H200 measurement behind the default: one slot of 256+ tokens wins, four of 1,024 lose."""
    policy = wkv_dispatch.DEFAULT_POLICY
    assert policy.prefers_chunked((4096,), heads=64)
    assert policy.prefers_chunked((1024, 1, 1), heads=64)  # decode rows ride along
    assert not policy.prefers_chunked((1024,) * 4, heads=64)
    assert not policy.prefers_chunked((200,), heads=64)


def test_the_memory_plans_scratch_bound_covers_what_the_kernel_allocates() -> None:
    """The Triton kernel keeps FACTORS fp32 rows of 64 a (row, head) and a decay row and span per
    (chunk, head); wkv_chunked.scratch_bytes (the memory plan's term) bounds that for any mix of
    slots, decode rows of one token included."""
    pytest.importorskip("triton")
    from albatross.wkv_chunked import FACTORS, HEAD, scratch_bytes
    from albatross.wkv_chunked_triton import chunk_offsets

    heads = 64
    for lengths in ([4096], [1] * 960, [4096] + [1] * 959, [17, 33, 0, 5], [16] * 8):
        chunks = chunk_offsets(lengths)[-1]
        rows = sum(lengths)
        allocated = 4 * (heads * FACTORS * rows * HEAD + chunks * heads * HEAD + chunks * heads)
        assert allocated <= scratch_bytes(rows, heads * HEAD), lengths
