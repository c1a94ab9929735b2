"""Decode a small random model with some batch-1 Triton paths on and then off, eagerly and from
CUDA graphs, and check that the logits agree (shared by test_norm_mix_cuda.py and
test_wkv_decode_cuda.py; needs a GPU)."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch

from albatross.cuda_graphs import DecodeGraphRunner
from albatross.random_checkpoint import CheckpointShape, random_state_dict


def assert_decode_matches_without(paths: Sequence[ModuleType]) -> None:
    """`paths`: modules with `set_fused_allowed` and `FUSED_BY_DEFAULT` (loras, norm_mix, wkv_decode)."""
    from albatross.model import RWKV7

    model = RWKV7.from_state_dict(random_state_dict(CheckpointShape(n_layer=4, n_embd=512), seed=8, device="cuda"), "cuda", progress=False)
    eager, graphed = [], []
    for enabled in (True, False):
        for path in paths:
            path.set_fused_allowed(enabled)
        try:
            pool = model.new_pool(4, torch.float16)
            model.forward(pool, [0, 2], [[11, 12, 13, 14, 15, 16], [7, 8]])  # prefill: the unfused ops either way
            eager.append([model.forward(pool, [0, 2], [[21 + i], [31 + i]]) for i in range(4)])
            runner = DecodeGraphRunner(model, pool, scratch_slot=3, buckets=(2,))
            slots = torch.tensor([0, 2], device="cuda")
            graphed.append([runner.decode(slots, torch.tensor([41 + i, 51 + i], device="cuda")).clone() for i in range(4)])
        finally:
            for path in paths:
                path.set_fused_allowed(path.FUSED_BY_DEFAULT)
    for got, expected in [*zip(*eager), *zip(*graphed)]:
        rel = ((got - expected).norm() / expected.norm()).item()
        assert rel < 1e-2, f"logits relative difference {rel:.2e}"
