"""A step with prompt chunks takes its decode rows' ids from the previous step's sampled ids on the
device: issuing it never reads them on the host (so it is queued while that step runs), and it
computes what a forward fed those ids from the host computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from albatross import ops
from albatross.model import RWKV7
from albatross.sampler import PenaltyPool
from albatross_engine.device_step import DeviceStep
from albatross_engine.scheduler import Row, RowKind, StepPlan
from albatross_engine.tasks import EngineTask, SyncChannel
from runner.interface import SamplingParams

SAMPLED = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, stop_token_ids=())


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Path) -> RWKV7:
    return RWKV7.load(tiny_checkpoint, device="cpu", progress=False)


def task(prompt: list[int], seed: int) -> EngineTask:
    made = EngineTask(prompt, SAMPLED, seed=seed, channel=SyncChannel())
    made.seed32 = seed
    return made


def sampling(rows: list[Row]) -> StepPlan:
    for n, row in enumerate(rows):
        row.sample_row = n
        row.task.sampled += 1
    return StepPlan(rows=rows, sample_count=len(rows), decode_tokens=sum(r.kind is not RowKind.PREFILL for r in rows),
                    prefill_tokens=sum(r.stop - r.start for r in rows if r.kind is RowKind.PREFILL))


def test_a_mixed_step_feeds_the_previous_ids_on_the_device(model: RWKV7) -> None:
    torch.manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,)).tolist() for n in (5, 3, 7, 4)]
    tasks = [task(prompt, seed=11 + n) for n, prompt in enumerate(prompts)]
    step = DeviceStep(model, batch_size=4, cuda_graphs=False)
    # Step 1: three prompts in full, each sampling its first token.
    first = step.issue(sampling([Row(tasks[n], n, RowKind.PREFILL, 0, len(prompts[n])) for n in range(3)]))
    before = [step.pool.read(slot) for slot in range(4)]
    penalties = PenaltyPool(4, vocab, model.device)  # as they stand before step 2
    penalties.penalties.copy_(step.penalties.penalties)
    penalties.seen.copy_(step.penalties.seen)
    # Step 2: slots 2 and 0 decode the ids step 1 sampled for them (rows 2 and 0), slot 1 feeds its
    # own without sampling, and slot 3 prefills a chunk of its prompt: one forward, one sampler call.
    rows = [Row(tasks[2], 2, RowKind.DECODE, input_row=2), Row(tasks[3], 3, RowKind.PREFILL, 0, 4),
            Row(tasks[0], 0, RowKind.DECODE, input_row=0)]
    plan = sampling(rows)
    plan.rows.append(Row(tasks[1], 1, RowKind.FEED, input_row=1))
    plan.decode_tokens += 1
    second = step.issue(plan)
    assert first.ids_at is None, "the mixed step waited for the previous step's ids on the host"
    assert first.ids is not None
    fed = first.ids.tolist()
    # The same forward with step 1's ids fed from the host, on a copy of the states before step 2.
    reference = model.new_pool(4, step.pool.state_dtype)
    for slot, state in enumerate(before):
        reference.write(slot, state)
    logits = model.forward(reference, [2, 3, 0, 1], [[fed[2]], prompts[3][:4], [fed[0]], [fed[1]]])
    assert isinstance(logits, torch.Tensor)
    for slot in range(4):
        got, want = step.pool.read(slot), reference.read(slot)
        for name in ("att_shift", "ffn_shift", "wkv"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (slot, name)
    inputs = step._sampling_inputs(plan)
    want_ids = ops.sample(logits[:3], inputs.slots, inputs.batch, penalties).tolist()
    assert second.token_ids() == want_ids


def test_a_decode_row_without_previous_ids_fails_the_step_before_anything_runs(model: RWKV7) -> None:
    tasks = [task([1, 2, 3], seed=1), task([4, 5], seed=2)]
    step = DeviceStep(model, batch_size=2, cuda_graphs=False)
    before = [step.pool.read(slot) for slot in range(2)]
    plan = sampling([Row(tasks[0], 0, RowKind.DECODE, input_row=0), Row(tasks[1], 1, RowKind.PREFILL, 0, 2)])
    with pytest.raises(RuntimeError, match="previous step's sampled ids"):
        step.issue(plan)
    for slot in range(2):
        after = step.pool.read(slot)
        assert all(torch.equal(getattr(after, n), getattr(before[slot], n)) for n in ("att_shift", "ffn_shift", "wkv"))


@pytest.mark.parametrize("mixed", [False, True], ids=["decode step", "mixed step"])
def test_a_decode_row_outside_the_previous_ids_fails_the_step_before_anything_runs(model: RWKV7, mixed: bool) -> None:
    """Either kind of step refuses on the host a row that would gather past the previous step's
    sampled ids (on a GPU that gather would be a device-side assert, fatal to the process)."""
    tasks = [task([1, 2, 3], seed=1), task([4, 5], seed=2)]
    step = DeviceStep(model, batch_size=2, cuda_graphs=False)
    step.issue(sampling([Row(tasks[0], 0, RowKind.PREFILL, 0, 3)]))  # samples one id
    before = [step.pool.read(slot) for slot in range(2)]
    rows = [Row(tasks[0], 0, RowKind.DECODE, input_row=1)]
    if mixed:
        rows.append(Row(tasks[1], 1, RowKind.PREFILL, 0, 2))
    with pytest.raises(RuntimeError, match="feeds sampled id 1 of a step that sampled 1"):
        step.issue(sampling(rows))
    for slot in range(2):
        after = step.pool.read(slot)
        assert all(torch.equal(getattr(after, n), getattr(before[slot], n)) for n in ("att_shift", "ffn_shift", "wkv"))
