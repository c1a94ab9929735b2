"""RWKV7.forward reproduces the official `rwkv` package (RWKV_V7_ON=1, "cpu fp32") to 1e-4."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from albatross.model import RWKV7
from albatross.state import StatePool
from runner.classic_backend import rwkv_model_module

ReferenceRWKV = rwkv_model_module().RWKV

TOLERANCE = 1e-4
PROMPT_TOKENS = 64
DECODE_STEPS = 32


def _reference(path: Path) -> ReferenceRWKV:
    return ReferenceRWKV(model=str(path.with_suffix("")), strategy="cpu fp32")


def _random_prompt(seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 65536, (PROMPT_TOKENS,), generator=generator).tolist()


def _max_diff(expected: torch.Tensor, actual: torch.Tensor) -> float:
    assert expected.shape == actual.shape, f"shape {list(actual.shape)} != reference {list(expected.shape)}"
    return (expected.float() - actual.float()).abs().max().item()


@pytest.mark.parametrize("fixture_name", ["tiny_checkpoint", "small_checkpoint"])
def test_prefill_then_greedy_decode_matches_reference_at_every_step(
    fixture_name: str, request: pytest.FixtureRequest
) -> None:
    path: Path = request.getfixturevalue(fixture_name)
    reference = _reference(path)
    model = RWKV7.load(path, progress=False)
    pool = StatePool(model, batch_size=3)
    slot = 1
    prompt = _random_prompt(seed=11)

    expected, ref_state = reference.forward(prompt, None)
    actual = model.forward(pool, [slot], [prompt])
    assert actual.shape == (1, model.config.vocab_size) and actual.dtype == torch.float32
    diff = _max_diff(expected, actual[0])
    assert diff <= TOLERANCE, f"prefill logits differ from the reference by {diff:.2e}"

    token = int(expected.argmax())
    for step in range(DECODE_STEPS):
        expected, ref_state = reference.forward([token], ref_state)
        actual = model.forward(pool, [slot], [[token]])
        diff = _max_diff(expected, actual[0])
        assert diff <= TOLERANCE, f"decode step {step} (token {token}) differs from the reference by {diff:.2e}"
        token = int(expected.argmax())

    # The pool's state is the reference state: shifts and WKV matrices of every layer.
    state = pool.read(slot)
    for layer in range(model.config.n_layer):
        att, wkv, ffn = ref_state[3 * layer : 3 * layer + 3]
        for name, ours, theirs in (("att_shift", state.att_shift[layer], att), ("ffn_shift", state.ffn_shift[layer], ffn), ("wkv", state.wkv[layer], wkv)):
            diff = _max_diff(theirs, ours)
            assert diff <= TOLERANCE, f"layer {layer} {name} differs from the reference state by {diff:.2e}"


@pytest.mark.parametrize("fixture_name", ["tiny_checkpoint", "small_checkpoint"])
def test_full_output_matches_reference_full_output_for_every_token(
    fixture_name: str, request: pytest.FixtureRequest
) -> None:
    path: Path = request.getfixturevalue(fixture_name)
    reference = _reference(path)
    model = RWKV7.load(path, progress=False)
    pool = StatePool(model, batch_size=2)
    prompt = _random_prompt(seed=12)

    expected, _ = reference.forward(prompt, None, full_output=True)
    outputs = model.forward(pool, [0], [prompt], full_output=True)
    assert isinstance(outputs, list) and len(outputs) == 1
    assert outputs[0].shape == (PROMPT_TOKENS, model.config.vocab_size)
    per_token = (expected - outputs[0]).abs().amax(dim=-1)
    worst = int(per_token.argmax())
    assert per_token[worst] <= TOLERANCE, f"token {worst} of the prompt differs by {per_token[worst]:.2e}"
