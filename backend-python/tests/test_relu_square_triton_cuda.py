"""The key product with relu^2 in its epilogue (albatross/relu_square_triton.py) on a Hopper GPU
(skipped elsewhere): against float64 at least as exact as cuBLAS plus the relu_square pass, at the
7.2B channel mix's shape and sizes off the tiles, in fp16 and bf16, at every tile shape the
benchmark times; a NaN row as the pass has it; replay from a CUDA graph; a prefill through it
against one without it."""

from __future__ import annotations

import pytest
import torch

from albatross import linear, ops
from albatross.random_checkpoint import CheckpointShape, random_state_dict
from albatross.relu_square_triton import CANDIDATES, Tiles

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU"),
]

DEV = "cuda"
# Of the largest output: one rounding of the fp32 accumulator's square is half an ulp (fp16 2**-11,
# bf16 2**-8); the accumulators themselves differ from float64 by a few fp32 ulps a sum.
BOUND = {torch.float16: 6e-4, torch.bfloat16: 4.5e-3}


def _operands(rows: int, K: int, N: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(rows, K, generator=gen, device=DEV).to(dtype)
    return x, (torch.randn(K, N, generator=gen, device=DEV) * K**-0.5).to(dtype)


def _errors(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> tuple[float, float]:
    exact = torch.relu(x.double() @ weight.double()).square()
    unfused = ops.relu_square(x @ weight)
    scale = exact.abs().max()
    return ((got.double() - exact).abs().max() / scale).item(), ((unfused.double() - exact).abs().max() / scale).item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("rows", "K", "N"), [(1, 256, 1024), (17, 256, 1024), (1023, 512, 2048), (4097, 4096, 16384), (300, 2560, 10240)])
def test_as_exact_as_cublas_and_the_pass(rows: int, K: int, N: int, dtype: torch.dtype) -> None:
    from albatross import relu_square_triton

    x, weight = _operands(rows, K, N, dtype, seed=rows + K)
    got = relu_square_triton.product_relu_square(x, weight)
    assert got.shape == (rows, N) and got.dtype == dtype
    fused, unfused = _errors(got, x, weight)
    assert fused <= BOUND[dtype] and fused <= unfused * 1.01 + 1e-7, (fused, unfused)


@pytest.mark.parametrize("tiles", CANDIDATES, ids=lambda tiles: tiles.label())
def test_every_tile_shape_the_benchmark_times(tiles: Tiles) -> None:
    from albatross import relu_square_triton

    x, weight = _operands(1500, 1024, 4096 + 256, torch.float16, seed=CANDIDATES.index(tiles))
    fused, unfused = _errors(relu_square_triton.product_relu_square(x, weight, tiles), x, weight)
    assert fused <= BOUND[torch.float16] and fused <= unfused * 1.01 + 1e-7, (tiles.label(), fused, unfused)


def test_a_nan_row_gives_what_the_pass_gives() -> None:
    from albatross import relu_square_triton

    x, weight = _operands(300, 512, 1024, torch.float16, seed=3)
    x[7, 11] = float("nan")
    got = relu_square_triton.product_relu_square(x, weight)
    assert torch.equal(got[7], ops.relu_square(x @ weight)[7])  # fmaxf(NaN, 0) = 0 on both paths
    assert torch.equal(got[7], torch.zeros_like(got[7]))


def test_replays_from_a_cuda_graph() -> None:
    from albatross import relu_square_triton

    x, weight = _operands(2048, 512, 2048, torch.float16, seed=5)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        relu_square_triton.product_relu_square(x, weight)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = relu_square_triton.product_relu_square(x, weight)
    fresh, _ = _operands(2048, 512, 2048, torch.float16, seed=6)
    x.copy_(fresh)
    graph.replay()
    assert torch.equal(out, relu_square_triton.product_relu_square(fresh, weight))


def test_a_prefill_through_it_matches_one_without() -> None:
    from albatross.model import RWKV7

    model = RWKV7.from_state_dict(random_state_dict(CheckpointShape(n_layer=2, n_embd=512), seed=9, device=DEV), DEV, progress=False)
    prompts = [[(7 * i + 3 * s) % 60000 + 1 for i in range(600)] for s in range(2)]  # 1,200 rows: over the threshold
    outputs = []
    for enabled in (True, False):
        linear.set_fused_relu_square(enabled)
        try:
            pool = model.new_pool(2)
            outputs.append(model.forward(pool, [0, 1], prompts))
        finally:
            linear.set_fused_relu_square(linear.FUSED_RELU_SQUARE_BY_DEFAULT)
    got, expected = outputs
    rel = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
    assert 0 < rel < 1e-2, f"logits relative difference {rel:.2e} (0 would mean the kernel did not run)"


def test_the_engine_builds_it_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeviceStep.warm_long_prefill takes the fused product once where a step's rows may (so the
    first long prompt does not wait for Triton's build), and not where no step can have that many
    rows (prompt budget plus decode rows)."""
    from albatross.model import RWKV7
    from albatross_engine.device_step import DeviceStep

    model = RWKV7.from_state_dict(random_state_dict(CheckpointShape(n_layer=2, n_embd=512), seed=9, device=DEV), DEV, progress=False)
    calls: list[int] = []
    real = linear.mm_relu_square
    monkeypatch.setattr(linear, "mm_relu_square", lambda x, weight: calls.append(x.shape[0]) or real(x, weight))
    linear.set_fused_relu_square(True)
    try:
        step = DeviceStep(model, batch_size=2, state_dtype="fp16", cuda_graphs=False)
        probe_rows = linear.FUSED_RELU_SQUARE_MIN_ROWS  # the chunked kernels' warm-up prompt is shorter
        step.warm_long_prefill(prefill_budget=probe_rows - 3)  # with the 2 decode rows, one short
        assert probe_rows not in calls, calls
        step.warm_long_prefill(prefill_budget=16384)
        assert calls.count(probe_rows) == 1, calls
    finally:
        linear.set_fused_relu_square(linear.FUSED_RELU_SQUARE_BY_DEFAULT)
