"""The scaled WKV walk's algorithm on the CPU (docs/kernels.md, "Scaled walk"; the kernel itself is
tested on a GPU by test_wkv_scaled_cuda.py): its float32 arithmetic (`wkv_reference.scaled_walk`)
is as accurate against a float64 walk as the plain float32 walk, folds exactly where the rule
says, and gives the plain walk's bits wherever every token folds (a chunk's first token, decays
of 0)."""

from __future__ import annotations

import math

import pytest
import torch

from wkv_reference import SCALED_FLOOR, assert_as_accurate_as_plain, scaled_walk, walk, wkv_inputs

H, N = 2, 64


def _inputs(T: int, log_decay: tuple[float, float], seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A state and one slot's rows r, w, k, v, a, b ([T, H, N]) in a trained model's ranges, w
    uniform in `log_decay`."""
    gen = torch.Generator().manual_seed(seed)
    inputs = wkv_inputs([T], H, torch.float32, gen, log_decay=log_decay)
    return torch.randn(H, N, N, generator=gen) * 0.3, [x.view(T, H, N) for x in inputs]


@pytest.mark.parametrize(
    "T, log_decay",
    [(512, (-5.0, -0.5)), (2048, (-5.0, -0.5)), (512, (-0.6, -0.5)), (300, (-3.0, 3.0))],
    ids=["512", "2048", "fastest-trained", "faster"],
)
def test_the_scaled_walk_is_as_accurate_as_the_plain_walk(T: int, log_decay: tuple[float, float]) -> None:
    state, inputs = _inputs(T, log_decay, seed=T)
    want_state, want_y = walk(state, inputs, torch.float64)
    plain_state, plain_y = walk(state, inputs, torch.float32)
    got_state, got_y, folds = scaled_walk(state, inputs)
    assert int(folds.min()) >= 1  # a chunk's first token always folds
    assert_as_accurate_as_plain((("state", got_state, plain_state, want_state), ("y", got_y, plain_y, want_y)))


def test_a_head_folds_when_its_product_would_fall_below_the_floor() -> None:
    """A constant log-decay of -0.5 (a trained model's fastest decay, 0.545 a token) takes the
    product below 2**-20 on the 23rd token after a fold: folds at tokens 0, 23, 46, 69 and 92."""
    state, inputs = _inputs(100, (-0.5, -0.5), seed=1)
    decay = math.exp(-math.exp(-0.5))
    assert decay**22 >= SCALED_FLOOR > decay**23
    _, _, folds = scaled_walk(state, inputs)
    assert folds.tolist() == [5] * H


def test_where_every_token_folds_the_scaled_walk_is_the_plain_one_to_the_bit() -> None:
    """A one-token chunk, and decays of exactly 0 (every token folds, P stays 1), take the plain
    step's arithmetic: the kernel's one-token slots keep the decode kernel's bits this way."""
    state, inputs = _inputs(1, (-5.0, -0.5), seed=2)
    assert all(torch.equal(a, b) for a, b in zip(scaled_walk(state, inputs)[:2], walk(state, inputs, torch.float32)))
    state, inputs = _inputs(40, (5.0, 6.0), seed=3)
    assert torch.exp(-torch.exp(inputs[1])).max() == 0
    got_state, got_y, folds = scaled_walk(state, inputs)
    plain_state, plain_y = walk(state, inputs, torch.float32)
    assert folds.tolist() == [40] * H
    assert torch.equal(got_state, plain_state) and torch.equal(got_y, plain_y)
