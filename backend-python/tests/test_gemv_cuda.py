"""The split-K GEMV kernel computes `x @ W` for 1-4 rows (run on a GPU; skipped without one)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from albatross import cuda_ops, linear, ops
from albatross.random_checkpoint import CheckpointShape, random_state_dict

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

DEV = "cuda"
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # relative to the largest output


@pytest.fixture(scope="module", autouse=True)
def kernels() -> Iterator[None]:
    results = cuda_ops.enable_cuda_kernels()
    assert results["gemv"].how in ("prebuilt", "jit"), results["gemv"].describe()
    linear.set_gemv_allowed(True)  # off by default (cuBLAS measured faster); these tests exercise it
    try:
        assert linear.gemv_enabled()
        yield
    finally:
        linear.set_gemv_allowed(linear.GEMV_BY_DEFAULT)


def _operands(rows: int, K: int, N: int, dtype: torch.dtype, seed: int, batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    lead = () if batch is None else (batch,)
    x = torch.randn(*lead, rows, K, generator=gen, device=DEV).to(dtype)
    W = (torch.randn(*lead, K, N, generator=gen, device=DEV) / K**0.5).to(dtype)
    return x, W


def _check(y: torch.Tensor, x: torch.Tensor, W: torch.Tensor) -> None:
    expected = x.double() @ W.double()
    assert y.shape == expected.shape and y.dtype == x.dtype
    assert torch.isfinite(y).all(), "an output was not written"
    error = ((y.double() - expected).abs().max() / expected.abs().max()).item()
    assert error <= TOLERANCE[x.dtype], f"max error {error:.2e} of the largest output"


SHAPES_7B = [(4096, 4096), (4096, 16384), (16384, 4096), (4096, 65536), (4096, 160), (160, 4096), (4096, 96), (96, 4096), (4096, 480), (480, 4096)]


@pytest.mark.parametrize("K, N", SHAPES_7B, ids=[f"{k}x{n}" for k, n in SHAPES_7B])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gemv_matches_the_product_on_the_7b_shapes(K: int, N: int, rows: int, dtype: torch.dtype) -> None:
    x, W = _operands(rows, K, N, dtype, seed=K + N + rows)
    poison = torch.full((rows, N), float("nan"), dtype=dtype, device=DEV)
    del poison  # the caching allocator hands this block to y: an output left unwritten stays NaN
    _check(linear.gemv(x, W), x, W)


@pytest.mark.parametrize("K, N", [(1, 8), (7, 16), (33, 264), (1000, 2056), (2049, 520)], ids=str)
def test_gemv_edge_sizes(K: int, N: int) -> None:
    """K not a multiple of the rows in flight; N not a multiple of the 256-column tile."""
    x, W = _operands(3, K, N, torch.float16, seed=K * N)
    _check(linear.gemv(x, W), x, W)


def test_batched_gemv_is_one_product_per_matrix() -> None:
    x, W = _operands(2, 4096, 4096, torch.float16, seed=3, batch=3)  # the r/k/v projections
    y = linear.bmm(x, W)
    _check(y, x, W)


def test_rows_of_a_wider_tensor() -> None:
    wide, W = _operands(2, 8192, 4096, torch.float16, seed=4)
    x = wide[:, 1024 : 1024 + 4096]  # row stride 8192, as the model's per-mix views
    _check(linear.mm(x, W[:4096]), x, W[:4096])


def test_results_are_deterministic_and_the_counters_return_to_zero() -> None:
    x, W = _operands(1, 4096, 16384, torch.float16, seed=5)
    first = linear.gemv(x, W)
    for _ in range(5):
        assert torch.equal(linear.gemv(x, W), first)
    torch.cuda.synchronize()
    assert int(linear.counters(x.device).abs().sum()) == 0


def test_gemv_replays_from_a_cuda_graph() -> None:
    x, W = _operands(1, 4096, 4096, torch.float16, seed=6)
    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        linear.mm(static_x, W)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = linear.mm(static_x, W)
    for seed in (7, 8):
        fresh, _ = _operands(1, 4096, 4096, torch.float16, seed=seed)
        static_x.copy_(fresh)
        graph.replay()
        assert torch.equal(static_y, linear.gemv(fresh, W))


def test_the_op_is_the_kernel_and_its_twin_elsewhere() -> None:
    """The dispatcher runs the CUDA kernel for CUDA tensors (no Python twin in between)."""
    assert "gemv" in ops.registered_cuda_ops()
    x, W = _operands(2, 512, 256, torch.float16, seed=10)
    _check(ops.gemv(x, W, linear.counters(x.device)), x, W)
    assert torch.equal(ops.gemv(x.cpu().float(), W.cpu().float(), torch.zeros(1, dtype=torch.int32)), x.cpu().float() @ W.cpu().float())


def test_more_rows_or_fp32_take_torch() -> None:
    x, W = _operands(5, 256, 256, torch.float16, seed=9)
    assert not linear.takes_gemv(x, W)
    assert not linear.takes_gemv(x[:2].float(), W.float())
    assert linear.takes_gemv(x[:2], W)
    with pytest.raises(RuntimeError, match="1 to 4 rows"):
        linear.gemv(x, W)


def test_decode_through_the_gemv_matches_cublas() -> None:
    from albatross.model import RWKV7

    model = RWKV7.from_state_dict(random_state_dict(CheckpointShape(n_layer=4, n_embd=512), seed=8, device=DEV), DEV, progress=False)
    outputs = []
    for enabled in (True, False):
        linear.set_gemv_allowed(enabled)
        try:
            pool = model.new_pool(3)
            prompt = model.forward(pool, [0, 2], [[11, 12, 13, 14, 15, 16], [7, 8]])
            steps = [model.forward(pool, [0, 2], [[21 + i], [31 + i]]) for i in range(4)]
        finally:
            linear.set_gemv_allowed(True)  # the module fixture's setting
        outputs.append((prompt, steps))
    (_, with_gemv), (_, with_cublas) = outputs
    for got, expected in zip(with_gemv, with_cublas):
        rel = ((got - expected).norm() / expected.norm()).item()
        assert rel < 1e-2, f"logits relative difference {rel:.2e}"


@pytest.mark.parametrize("rows", [1, 3, 7, 960])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_fp32_logits_are_the_product_unrounded(rows: int, dtype: torch.dtype) -> None:
    """The LM head's product: cuBLAS's fp32 result (more than 4 rows) is within fp32 accumulation
    error of float64, finer than the 16-bit product; the GEMV's rows (gemv on in this module)
    are its 16-bit result converted."""
    x, W = _operands(rows, 4096, 1024, dtype, seed=11 + rows)
    try:
        linear.set_fp32_product_out(True)
        out = linear.mm_float32(x, W)
        assert out.dtype == torch.float32 and out.shape == (rows, 1024)
        if linear.takes_gemv(x, W):
            assert torch.equal(out, linear.gemv(x, W).float())
            return
        expected = x.double() @ W.double()
        error = ((out.double() - expected).abs().max() / expected.abs().max()).item()
        rounded = ((torch.mm(x, W).double() - expected).abs().max() / expected.abs().max()).item()
        assert error < 1e-4 and error < rounded, (error, rounded)
        linear.set_fp32_product_out(False)
        assert torch.equal(linear.mm_float32(x, W), torch.mm(x, W).float())
    finally:
        linear.set_fp32_product_out(linear.FP32_PRODUCT_OUT_BY_DEFAULT)
