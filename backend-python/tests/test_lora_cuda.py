"""The fused LoRA kernels on a GPU (skipped without one): the 7.2B block's shapes in fp16 and bf16
at 1-4 rows against the eager path, replay from a CUDA graph, and decode through them against
decode without them."""

from __future__ import annotations

import pytest
import torch

from albatross import loras
from albatross.random_checkpoint import CheckpointShape, random_state_dict

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

DEV = "cuda"
# Relative to the largest output; both sides round (the eager one through cuBLAS, which may reduce
# in fp16), so twice the GEMV tests' bounds against float64.
TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 3.2e-2}


def _operands(rows: int, n: int, C: int, R: int, G: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype)

    return randn(6, rows, C, scale=1.0), randn(n, C, R, scale=C**-0.5), randn(n, R, C, scale=R**-0.5), randn(C, G, scale=C**-0.5), randn(G, C, scale=G**-0.5)


def _fused(*operands: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from albatross import lora_triton

    return lora_triton.fused_loras(*operands)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert error <= TOLERANCE[dtype], f"error {error:.2e}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [2, 3])
def test_the_7b_block_shapes_match_the_eager_path(n: int, rows: int, dtype: torch.dtype) -> None:
    operands = _operands(rows, n, 4096, 160, 480, dtype, seed=rows + 10 * n)
    lora, gate = _fused(*operands)
    want_lora, want_gate = loras.loras_torch(*operands)
    _close(lora, want_lora, dtype)
    _close(gate, want_gate, dtype)


def test_results_are_deterministic_and_replay_from_a_cuda_graph() -> None:
    operands = _operands(1, 3, 2048, 96, 256, torch.float16, seed=3)
    first = _fused(*operands)
    for _ in range(3):
        again = _fused(*operands)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    static = [t.clone() for t in operands]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _fused(*static)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _fused(*static)
    fresh = _operands(1, 3, 2048, 96, 256, torch.float16, seed=4)
    static[0].copy_(fresh[0])
    graph.replay()
    want = _fused(fresh[0], *operands[1:])
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])


def test_decode_through_the_fused_loras_matches_the_eager_path() -> None:
    from albatross.model import RWKV7

    model = RWKV7.from_state_dict(random_state_dict(CheckpointShape(n_layer=4, n_embd=512), seed=8, device=DEV), DEV, progress=False)
    outputs = []
    for enabled in (True, False):
        loras.set_fused_allowed(enabled)
        try:
            assert loras.fused_applies(torch.empty(6, 2, 512, device=DEV, dtype=model.dtype)) == (enabled and model.dtype in (torch.float16, torch.bfloat16))
            pool = model.new_pool(3)
            model.forward(pool, [0, 2], [[11, 12, 13, 14, 15, 16], [7, 8]])
            outputs.append([model.forward(pool, [0, 2], [[21 + i], [31 + i]]) for i in range(4)])
        finally:
            loras.set_fused_allowed(loras.FUSED_BY_DEFAULT)
    for got, expected in zip(*outputs):
        rel = ((got - expected).norm() / expected.norm()).item()
        assert rel < 1e-2, f"logits relative difference {rel:.2e}"
