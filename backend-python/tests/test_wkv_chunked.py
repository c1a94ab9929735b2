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
    assert policy.chunked_run((4096,), heads=64) == (0, 1)
    assert policy.chunked_run((1, 1, 1, 4096), heads=64) == (3, 4)  # the engine's step: decode rows, then a prompt
    assert policy.chunked_run((4096, 1, 1, 1), heads=64) == (0, 1)
    assert policy.chunked_run((1, 300, 4096, 7), heads=64) == (1, 3)
    assert policy.chunked_run((4096, 1, 300), heads=64) is None  # long slots apart: all sequential
    assert not policy.prefers_chunked((255, 1), heads=64)
    assert not policy.prefers_chunked((512,) * 64, heads=64)  # 4096 chains fill the GPU sequentially
    assert policy.prefers_chunked((512,) * 16, heads=64)
    assert not wkv_dispatch.ChunkedPolicy(enabled=False).prefers_chunked((4096,), heads=64)
    with pytest.raises(ValueError):
        wkv_dispatch.ChunkedPolicy(min_tokens=1)


@pytest.mark.parametrize("lengths", [[1, 1, 1, 300], [300, 1, 2], [1, 40, 300, 290, 1], [300]])
def test_a_split_call_runs_each_part_on_its_own_rows_and_slots(lengths: list[int]) -> None:
    """The split's bookkeeping: with the sequential twin standing in for both kernels, running
    the parts one after another gives the unsplit call's output and states exactly (each slot's
    recurrence is its own), and the chunked part gets exactly the long slots."""
    gen = torch.Generator().manual_seed(len(lengths))
    inputs = wkv_inputs(lengths, 2, torch.float32, gen)
    state = torch.randn(8, 2, 64, 64, generator=gen) * 0.3
    slots = [5, 0, 7, 2, 3][: len(lengths)]
    batch = ops.FlatBatch.build(slots, lengths, torch.device("cpu"))
    run = wkv_dispatch.ChunkedPolicy(min_tokens=256, max_long_heads=1024).chunked_run(batch.lengths, 2)
    assert run is not None
    parts = wkv_dispatch.split_parts(batch, run, None)
    assert [p.lengths for p in parts if p.chunked] == [tuple(n for n in lengths if n >= 256)]
    assert sum((p.lengths for p in parts), ()) == tuple(lengths)
    chunked_calls: list[list[int]] = []

    def chunked(state: torch.Tensor, slot_idx: torch.Tensor, cu_seqlens: torch.Tensor, *rest: object, offsets: object) -> torch.Tensor:
        *rows, part_lengths = rest
        chunked_calls.append(slot_idx.tolist())
        assert cu_seqlens.tolist()[-1] == sum(part_lengths) == rows[0].shape[0]  # type: ignore[arg-type, union-attr]
        return ops.wkv7_torch(state, slot_idx, cu_seqlens, *rows)  # type: ignore[arg-type]

    expected_state = state.clone()
    expected = ops.wkv7_torch(expected_state, batch.slot_idx, batch.cu_seqlens, *inputs)
    got = wkv_dispatch.run_parts(state, parts, tuple(inputs), chunked, ops.wkv7)
    assert torch.equal(got, expected) and torch.equal(state, expected_state)
    assert chunked_calls == [[s for s, n in zip(slots, lengths) if n >= 256]]


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
    assert len(results) == 20, [result.get("name") for result in results]
    tolerance = {"fp32": 2e-6, "fp16": 2e-3, "bf16": 1.6e-2}  # a few fp32 ulps; one 16-bit rounding
    for result in results:
        assert result["finite"] and result["untouched_equal"], result
        assert result["y_diff"] <= tolerance[result["act_dtype"]] * max(1.0, result["y_scale"]), result
        assert result["state_diff"] <= tolerance[result["state_dtype"]] * max(1.0, result["state_scale"]), result


def test_cuts_capture_each_state_a_prefix_alone_would_leave() -> None:
    """Checkpoints inside a call (the prefix cache's boundaries inside a long chunk): the slot walks
    its rows in pieces, and each capture equals the state after running that prefix by itself."""
    gen = torch.Generator().manual_seed(5)
    lengths = [1, 37, 1, 20]
    cuts = ((), (5, 16, 36), (), (19,))
    inputs = wkv_inputs(lengths, 2, torch.float32, gen)
    state = torch.randn(6, 2, 64, 64, generator=gen) * 0.3
    slots = [4, 1, 0, 3]
    batch = ops.FlatBatch.build(slots, lengths, torch.device("cpu"))
    captures = torch.full((4, 2, 64, 64), float("nan"))
    got_state, whole_state = state.clone(), state.clone()
    got = wkv_dispatch.wkv7(got_state, batch, *inputs, cuts=cuts, captures=captures)
    whole = ops.wkv7_torch(whole_state, batch.slot_idx, batch.cu_seqlens, *inputs)
    assert torch.equal(got, whole) and torch.equal(got_state, whole_state)
    starts = [0, 1, 38, 39]
    for index, (call_slot, cut) in enumerate([(1, 5), (1, 16), (1, 36), (3, 19)]):
        alone = state.clone()
        first = starts[call_slot]
        prefix = [x[first : first + cut] for x in inputs]
        one = ops.FlatBatch.build([slots[call_slot]], [cut], torch.device("cpu"))
        ops.wkv7_torch(alone, one.slot_idx, one.cu_seqlens, *prefix)
        assert torch.equal(captures[index], alone[slots[call_slot]]), (call_slot, cut)
    parts = wkv_dispatch.split_parts(batch, None, None, cuts)
    # The slots between the capturing ones run as they lie; the pieces go in stages, one launch
    # for the j-th piece of every capturing slot (gathered rows), capturing after it.
    assert [(p.spans, p.capture, p.gather is not None) for p in parts] == [
        (((0, 1),), (), False),
        (((38, 39),), (), False),
        (((1, 6), (39, 58)), (0, 3), True),
        (((6, 17), (58, 59)), (1,), True),
        (((17, 37),), (2,), False),
        (((37, 38),), (), False),
    ]
    with pytest.raises(ValueError, match="must increase"):
        wkv_dispatch.split_parts(batch, None, None, ((), (16, 5), (), ()))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_staged_pieces_of_many_capturing_slots_match_the_whole_call(seed: int) -> None:
    """A burst step's shape: many slots, some capturing at boundaries inside their rows (one to
    three cuts), in random order. The pieces run in stages (one launch for the j-th piece of every
    capturing slot), yet the output and final states are the whole call's exactly, each capture
    is the state of its prefix alone, and the launches are the runs of other slots plus the most
    pieces any slot has."""
    gen = torch.Generator().manual_seed(100 + seed)
    count = 14
    lengths = torch.randint(1, 60, (count,), generator=gen).tolist()
    cuts: list[tuple[int, ...]] = []
    for n in lengths:
        wanted = int(torch.randint(0, 4, (1,), generator=gen)) if n > 4 and torch.rand(1, generator=gen).item() < 0.5 else 0
        cuts.append(tuple(sorted(torch.randperm(n - 1, generator=gen)[:wanted].add(1).tolist())))
    assert any(cuts) and not all(cuts)
    inputs = wkv_inputs(lengths, 2, torch.float32, gen)
    pool = count + 4
    slots = torch.randperm(pool, generator=gen)[:count].tolist()
    batch = ops.FlatBatch.build(slots, lengths, torch.device("cpu"))
    state = torch.randn(pool, 2, 64, 64, generator=gen) * 0.3
    total = sum(len(c) for c in cuts)
    captures = torch.full((total, 2, 64, 64), float("nan"))
    got_state, whole_state = state.clone(), state.clone()
    got = wkv_dispatch.wkv7(got_state, batch, *inputs, cuts=tuple(cuts), captures=captures)
    whole = ops.wkv7_torch(whole_state, batch.slot_idx, batch.cu_seqlens, *inputs)
    assert torch.equal(got, whole) and torch.equal(got_state, whole_state)
    index, start = 0, 0
    for call_slot, n in enumerate(lengths):
        for cut in cuts[call_slot]:
            alone = state.clone()
            one = ops.FlatBatch.build([slots[call_slot]], [cut], torch.device("cpu"))
            ops.wkv7_torch(alone, one.slot_idx, one.cu_seqlens, *(x[start : start + cut] for x in inputs))
            assert torch.equal(captures[index], alone[slots[call_slot]]), (call_slot, cut)
            index += 1
        start += n
    runs = sum(1 for i, c in enumerate(cuts) if not c and (i == 0 or cuts[i - 1]))
    parts = wkv_dispatch.split_parts(batch, None, None, tuple(cuts))
    assert len(parts) == runs + max(len(c) + 1 for c in cuts)
    assert sorted(i for p in parts for i in p.capture) == list(range(total))


def test_each_sequential_part_gets_its_own_launch_shape() -> None:
    """The launch shape (rows a thread, direct rows, scaled walk) of a split call's sequential
    parts comes from each part's own slot count and shortest slot; a chunked part has none."""
    lengths = [300, 300, 290, 1, 700]
    cuts = ((), (), (), (), ())
    batch = ops.FlatBatch.build([0, 1, 2, 3, 4], lengths, torch.device("cpu"))
    asked: list[tuple[int, int]] = []

    def launch(slots: int, shortest: int) -> tuple[int, bool, bool]:
        asked.append((slots, shortest))
        return (2, True, True) if shortest >= 128 else (1, False, False)

    parts = wkv_dispatch.split_parts(batch, (4, 5), None, cuts, launch)
    assert [(p.chunked, p.lengths, p.launch) for p in parts] == [
        (False, (300, 300, 290, 1), (1, False, False)),
        (True, (700,), (1, False, False)),
    ]
    assert asked == [(4, 1)]
    parts = wkv_dispatch.split_parts(batch, None, None, ((), (), (100,), (), ()), launch)
    assert [(p.lengths, p.launch) for p in parts] == [
        ((300, 300), (2, True, True)),
        ((1, 700), (1, False, False)),
        ((100,), (1, False, False)),  # the capturing slot's pieces, in stages
        ((190,), (2, True, True)),
    ]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_a_split_call_with_the_triton_kernel_matches_the_whole_sequential_call_in_the_interpreter() -> None:
    results = {result["case"]: result for result in interpreter_cases(HERE / "wkv_split_interpreter.py")}
    assert [tuple(p) for p in results["decode rows, then a long slot"]["parts"]] == [(False, 0, 2), (True, 2, 42), (False, 42, 43)]
    assert [tuple(p) for p in results["one long slot alone"]["parts"]] == [(True, 0, 41)]
    assert [tuple(p) for p in results["captures inside a long slot"]["parts"]] == [(False, 0, 1), (False, 1, 4), (True, 4, 71), (False, 71, 72)]
    assert [tuple(p) for p in results["captures off the chunk ends: sequential pieces"]["parts"]] == [
        (False, 70, 71),
        (False, 0, 5),
        (False, 5, 30),
        (False, 30, 70),
    ]  # the slot without cuts first, then the pieces in stages
    assert len(results) == 5
    for result in results.values():  # fp32 in, ieee products: a few ulps apart
        assert result["y_diff"] <= 2e-6 * max(1.0, result["y_scale"]), result
        assert result["state_diff"] <= 2e-6 * max(1.0, result["state_scale"]), result
        assert result["capture_diff"] <= 2e-6 * max(1.0, result["state_scale"]), result


def test_the_default_policy_chunks_up_to_four_long_slots() -> None:
    """The measurement behind the default: slots of 512+ tokens win up to four of them (7.2B's 64
    heads), sixteen of 2,048 lose, and one of 200 stays sequential."""
    policy = wkv_dispatch.DEFAULT_POLICY
    assert policy.prefers_chunked((4096,), heads=64)
    assert policy.chunked_run((1, 1, 1024), heads=64) == (2, 3)  # decode rows take the sequential kernel beside it
    assert policy.prefers_chunked((1024,) * 4, heads=64)
    assert not policy.prefers_chunked((2048,) * 16, heads=64)
    assert not policy.prefers_chunked((200,), heads=64)


def test_the_sequential_kernel_takes_two_rows_a_thread_only_for_many_long_slots() -> None:
    """Two rows a thread once every slot is long and the chains fill an H100's 132 SMs three
    deep; a decode row in the call, short chunks or few slots keep one row a thread. Twenty-four
    chains an SM or more take the two rows straight to registers."""
    launch = wkv_dispatch.LAYOUT.launch
    scaled = wkv_dispatch.LAYOUT.scaled_rows
    assert launch(64, 512, 64, 132) == (2, True, scaled) and launch(128, 128, 64, 132) == (2, True, scaled)
    assert launch(8, 512, 64, 132) == (2, False, scaled)  # 512 chains: the tile measured faster
    assert launch(32, 512, 64, 132) == (2, False, scaled)  # 2,048 chains: the tile measured faster
    assert launch(49, 512, 64, 132) == (2, False, scaled) and launch(50, 512, 64, 132) == (2, True, scaled)  # 3,168 chains
    assert launch(4, 512, 64, 132) == (1, False, False)  # 256 chains: one row a thread measured faster
    assert launch(64, 1, 64, 132) == (1, False, False)  # a decode row rides along
    assert launch(960, 127, 64, 132) == (1, False, False)  # short chunks
    assert launch(8, 512, 64, 200) == (1, False, False)  # a bigger GPU needs more chains
    assert launch(0, 0, 64, 132) == (1, False, False)
    assert wkv_dispatch.SequentialLayout(scaled_rows=False).launch(64, 512, 64, 132) == (2, True, False)


def test_the_dispatch_passes_the_layout_to_the_sequential_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU the op gets one row a thread whatever the call's lengths (the rule needs a GPU's
    SM count; test_cuda_kernels checks that a CUDA call gets the rule's answer), and the batch
    knows its shortest slot. The twin stands in for the op."""
    seen: list[tuple[object, ...]] = []

    def recording(*args: object) -> torch.Tensor:
        seen.append(args[-3:])
        return ops.wkv7_torch(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(ops, "wkv7", recording)
    gen = torch.Generator().manual_seed(5)
    lengths = [130, 140]
    inputs = wkv_inputs(lengths, 2, torch.float32, gen)
    state = torch.randn(3, 2, 64, 64, generator=gen) * 0.3
    batch = ops.FlatBatch.build([2, 0], lengths, torch.device("cpu"))
    assert batch.shortest == 130
    wkv_dispatch.wkv7(state, batch, *inputs)
    assert seen == [(1, False, False)]


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
