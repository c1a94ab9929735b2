"""The key product with relu^2 in its epilogue (albatross/relu_square_triton.py) on a Hopper GPU
(skipped elsewhere): it rounds as cuBLAS plus the relu_square pass do, so it differs from them
only where the fp32 sums, added in another order, round to a neighbouring value, at the 7.2B
channel mix's shape and sizes off the tiles, in fp16 and bf16, at every tile shape the benchmark
times; a NaN row as the pass has it; replay from a CUDA graph; a prefill through it against one
without it; the engine's build of it at load."""

from __future__ import annotations

import pytest
import torch

from albatross import linear, lora_prep, ops
from albatross.random_checkpoint import CheckpointShape, random_state_dict
from albatross.relu_square_triton import CANDIDATES, Tiles

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU"),
]

DEV = "cuda"
# Against the unfused path, relative to the element: a product one ulp away (fp16 2**-10, bf16
# 2**-7 of it at most), squared and rounded again.
WORST = {torch.float16: 2.0**-8, torch.bfloat16: 2.0**-5}


def _operands(rows: int, K: int, N: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(rows, K, generator=gen, device=DEV).to(dtype)
    return x, (torch.randn(K, N, generator=gen, device=DEV) * K**-0.5).to(dtype)


def _check(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """`got` against cuBLAS plus the pass: few elements differ, each by a neighbouring product's
    square; so its error against float64 is theirs."""
    unfused = ops.relu_square(x @ weight)
    assert got.shape == unfused.shape and got.dtype == unfused.dtype
    differ = (got != unfused).double().mean().item()
    worst = ((got.double() - unfused.double()).abs() / (unfused.double().abs() + 2.0**-24)).max().item()
    assert differ <= 0.01 and worst <= WORST[x.dtype], (differ, worst)
    exact = torch.relu(x.double() @ weight.double()).square()
    scale = exact.abs().max()
    fused_error = ((got.double() - exact).abs().max() / scale).item()
    unfused_error = ((unfused.double() - exact).abs().max() / scale).item()
    assert fused_error <= 1.5 * unfused_error + 1e-6, (fused_error, unfused_error)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("rows", "K", "N"), [(1, 256, 1024), (17, 256, 1024), (1023, 512, 2048), (4097, 4096, 16384), (300, 2560, 10240)])
def test_rounds_as_cublas_and_the_pass(rows: int, K: int, N: int, dtype: torch.dtype) -> None:
    from albatross import relu_square_triton

    x, weight = _operands(rows, K, N, dtype, seed=rows + K)
    _check(relu_square_triton.product_relu_square(x, weight), x, weight)


@pytest.mark.parametrize("tiles", CANDIDATES, ids=lambda tiles: tiles.label())
def test_every_tile_shape_the_benchmark_times(tiles: Tiles) -> None:
    from albatross import relu_square_triton

    x, weight = _operands(1500, 1024, 4096 + 256, torch.float16, seed=CANDIDATES.index(tiles))
    _check(relu_square_triton.product_relu_square(x, weight, tiles), x, weight)


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


def test_a_prefill_through_it_matches_one_without(monkeypatch: pytest.MonkeyPatch) -> None:
    from albatross import relu_square_triton
    from albatross.model import RWKV7

    model = RWKV7.from_state_dict(random_state_dict(CheckpointShape(n_layer=2, n_embd=512), seed=9, device=DEV), DEV, progress=False)
    prompts = [[(7 * i + 3 * s) % 60000 + 1 for i in range(600)] for s in range(2)]  # 1,200 rows: over the threshold
    calls: list[int] = []
    real = relu_square_triton.product_relu_square
    monkeypatch.setattr(relu_square_triton, "product_relu_square", lambda x, weight: calls.append(x.shape[0]) or real(x, weight))
    outputs = []
    for enabled in (True, False):
        linear.set_fused_relu_square(enabled)
        try:
            pool = model.new_pool(2)
            outputs.append(model.forward(pool, [0, 1], prompts))
        finally:
            linear.set_fused_relu_square(linear.FUSED_RELU_SQUARE_BY_DEFAULT)
    assert calls == [1200, 1200], calls  # one a layer, with the path on only
    got, expected = outputs
    rel = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
    assert rel < 1e-3, f"logits relative difference {rel:.2e} (the same roundings: only the sums' order differs)"


def test_the_engine_builds_it_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeviceStep.warm_long_prefill runs a prompt long enough for the fused product before any
    task holds a slot (so the first long prompt does not wait for Triton's build), and not where
    the step's prompt budget is too small; slot 0 is zero again afterwards."""
    from albatross.model import RWKV7
    from albatross_engine.device_step import DeviceStep

    model = RWKV7.from_state_dict(random_state_dict(CheckpointShape(n_layer=2, n_embd=512), seed=9, device=DEV), DEV, progress=False)
    calls: list[int] = []
    real = linear.mm_relu_square
    monkeypatch.setattr(linear, "mm_relu_square", lambda x, weight: calls.append(x.shape[0]) or real(x, weight))
    linear.set_fused_relu_square(True)
    try:
        step = DeviceStep(model, batch_size=2, state_dtype="fp16", cuda_graphs=False)
        probe_rows = max(linear.FUSED_RELU_SQUARE_MIN_ROWS, lora_prep.MIN_ROWS)  # the chunked kernels' warm-up prompt is shorter
        step.warm_long_prefill(prefill_budget=probe_rows - 1)
        assert probe_rows not in calls, calls
        step.warm_long_prefill(prefill_budget=16384)
        assert calls.count(probe_rows) == 2, calls  # one a layer
        assert not step.pool.read(0).wkv.any()
    finally:
        linear.set_fused_relu_square(linear.FUSED_RELU_SQUARE_BY_DEFAULT)
