"""The GPU model (fp16 weights, CUDA kernels) computes what the CPU fp32 model computes."""

from __future__ import annotations

import pytest
import torch

from albatross import cuda_ops, ops
from albatross.cuda_graphs import DecodeGraphRunner
from albatross.model import RWKV7
from albatross.random_checkpoint import CheckpointShape, random_state_dict

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

SHAPE = CheckpointShape(n_layer=4, n_embd=256)
# Chosen (on the CPU, fp32) so that every greedy step's top-2 logit margin is well above fp16
# rounding: the minimum over the prompt and all 64 steps is MIN_MARGIN.
WEIGHT_SEED = 3
PROMPT_SEED = 112
MIN_MARGIN = 0.065  # measured: 0.0650 (CPU fp32)
STEPS = 64


@pytest.fixture(scope="module")
def models() -> tuple[RWKV7, RWKV7]:
    cuda_ops.enable_cuda_kernels()
    assert "wkv7" in ops.registered_cuda_ops(), "the CUDA WKV kernel must be active for this comparison"
    cpu = RWKV7.from_state_dict(random_state_dict(SHAPE, seed=WEIGHT_SEED), "cpu", torch.float32, progress=False)
    gpu = RWKV7.from_state_dict(random_state_dict(SHAPE, seed=WEIGHT_SEED), "cuda", torch.float16, progress=False)
    return cpu, gpu


def _prompt() -> list[int]:
    return torch.randint(0, 65536, (32,), generator=torch.Generator().manual_seed(PROMPT_SEED)).tolist()


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double().cpu() - expected.double()).norm() / expected.double().norm()).item()


def test_fp16_gpu_logits_and_greedy_continuation_match_cpu_fp32(models: tuple[RWKV7, RWKV7]) -> None:
    cpu, gpu = models
    cpu_pool, gpu_pool = cpu.new_pool(2), gpu.new_pool(2)
    expected = cpu.forward(cpu_pool, [1], [_prompt()])
    actual = gpu.forward(gpu_pool, [1], [_prompt()])
    error = _relative_error(actual, expected)
    assert error <= 1e-2, f"prefill logits: relative error {error:.2e} > 1e-2"
    margins = []
    cpu_tokens: list[int] = []
    gpu_tokens: list[int] = []
    worst = error
    for _ in range(STEPS):
        top = expected[0].topk(2).values
        margins.append(float(top[0] - top[1]))
        cpu_tokens.append(int(expected[0].argmax()))
        gpu_tokens.append(int(actual[0].argmax()))
        expected = cpu.forward(cpu_pool, [1], [[cpu_tokens[-1]]])
        actual = gpu.forward(gpu_pool, [1], [[gpu_tokens[-1]]])
        worst = max(worst, _relative_error(actual, expected))
    print(f"greedy 64 steps: min top-2 margin {min(margins):.4f}, worst logits relative error {worst:.2e}")
    assert min(margins) >= 0.9 * MIN_MARGIN, f"the chosen prompt's CPU margins changed: min {min(margins):.4f}"
    assert gpu_tokens == cpu_tokens, f"greedy continuations diverge at step {next(i for i, (a, b) in enumerate(zip(gpu_tokens, cpu_tokens)) if a != b)}"
    assert worst <= 1e-2, f"decode logits: relative error {worst:.2e} > 1e-2"


def test_batched_mixed_prefill_and_decode_match_cpu(models: tuple[RWKV7, RWKV7]) -> None:
    cpu, gpu = models
    gen = torch.Generator().manual_seed(21)
    prompts = [torch.randint(0, 65536, (n,), generator=gen).tolist() for n in (1, 9, 1, 40, 3)]
    slots = [4, 0, 2, 1, 6]
    cpu_pool, gpu_pool = cpu.new_pool(8), gpu.new_pool(8)
    expected = cpu.forward(cpu_pool, slots, prompts)
    actual = gpu.forward(gpu_pool, slots, prompts)
    error = _relative_error(actual, expected)
    assert error <= 1e-2, f"mixed batch logits: relative error {error:.2e} > 1e-2"
    state_error = _relative_error(gpu_pool.wkv[:, slots].float(), cpu_pool.wkv[:, slots])
    assert state_error <= 1e-2, f"WKV states: relative error {state_error:.2e} > 1e-2"


def test_decode_graph_replay_equals_eager_decode(models: tuple[RWKV7, RWKV7]) -> None:
    _, gpu = models
    gen = torch.Generator().manual_seed(5)
    pool = gpu.new_pool(10)
    prompts = [torch.randint(0, 65536, (n,), generator=gen).tolist() for n in (5, 8, 3, 11, 2, 7)]
    gpu.forward(pool, list(range(6)), prompts)
    runner = DecodeGraphRunner(gpu, pool, scratch_slot=9, buckets=(1, 4, 8))
    slots = [0, 2, 5]  # 3 rows: runs in the 4-bucket with one padded row
    tokens = torch.randint(0, 65536, (3,), generator=gen)
    saved = (pool.att_shift.clone(), pool.ffn_shift.clone(), pool.wkv.clone())
    eager = gpu.forward(pool, slots, [[t] for t in tokens.tolist()])
    eager_wkv = pool.wkv[:, slots].clone()
    pool.att_shift.copy_(saved[0]), pool.ffn_shift.copy_(saved[1]), pool.wkv.copy_(saved[2])
    replayed = runner.decode(torch.tensor(slots, device="cuda"), tokens.cuda())
    error = _relative_error(replayed, eager.cpu())
    assert error <= 1e-3, f"graph replay logits differ from eager by {error:.2e}"
    assert torch.equal(replayed.argmax(-1), eager.argmax(-1))
    assert _relative_error(pool.wkv[:, slots].float(), eager_wkv.float().cpu()) <= 1e-3
    untouched = [1, 3, 4, 6, 7, 8]
    assert torch.equal(pool.wkv[:, untouched], saved[2][:, untouched]), "the graph touched slots it was not given"


@pytest.mark.parametrize("state_dtype", [torch.float16, torch.float32])
def test_states_captured_inside_a_chunk_match_feeding_each_prefix_alone(models: tuple[RWKV7, RWKV7], state_dtype: torch.dtype) -> None:
    """The prefix cache's checkpoints inside a long chunk on the GPU: the slot with cuts runs up to
    its first cut on the sequential kernel and the rest on the chunked kernel, which copies the
    state out at the other cuts (the long slot beside it is chunked too, the decode row
    sequential); each captured state matches the state of feeding that prefix alone."""
    _, gpu = models
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 65530, (n,), generator=gen).tolist() for n in (1, 1200, 600, 1)]
    cuts = [[], [256, 512, 768, 1024], [], []]
    pool, reference = gpu.new_pool(6, state_dtype), gpu.new_pool(6, state_dtype)
    slots = [5, 1, 3, 0]
    logits, saved = gpu.forward_saving(pool, slots, prompts, cuts)
    expected = gpu.forward(reference, slots, prompts)
    assert _relative_error(logits, expected.cpu()) <= 1e-2
    for slot in slots:
        a, b = pool.read(slot), reference.read(slot)
        for name in ("att_shift", "ffn_shift", "wkv"):
            assert _relative_error(getattr(a, name), getattr(b, name).double()) <= 1e-2, (slot, name)
    for cut, state in zip(cuts[1], saved[1]):
        alone = gpu.new_pool(6, state_dtype)
        gpu.forward(alone, [1], [prompts[1][:cut]])
        want = alone.read(1)
        for name in ("att_shift", "ffn_shift", "wkv"):
            got = getattr(state, name).cpu()
            assert torch.isfinite(got.float()).all()
            assert _relative_error(got, getattr(want, name).double()) <= 1e-2, (cut, name)


def test_building_the_long_prefill_kernels_at_load_leaves_every_slot_as_it_was(models: tuple[RWKV7, RWKV7]) -> None:
    """DeviceStep.warm_long_prefill runs a long prompt on slot 0, with and without captures, before
    any task holds a slot: afterwards slot 0 is zero again and every other slot untouched, and a
    budget too small for a long chunk skips it."""
    from albatross_engine.device_step import DeviceStep

    _, gpu = models
    step = DeviceStep(gpu, batch_size=4, state_dtype="fp16", cuda_graphs=False)
    gpu.forward(step.pool, [1, 2], [[5, 6, 7], [8]])  # give two slots a history
    before = [step.pool.read(slot) for slot in range(4)]
    step.warm_long_prefill(prefill_budget=16384)
    step.warm_long_prefill(prefill_budget=256)
    torch.cuda.synchronize()
    for slot in range(4):
        after = step.pool.read(slot)
        for name in ("att_shift", "ffn_shift", "wkv"):
            got = getattr(after, name)
            want = torch.zeros_like(got) if slot == 0 else getattr(before[slot], name)
            assert torch.equal(got, want), (slot, name)
