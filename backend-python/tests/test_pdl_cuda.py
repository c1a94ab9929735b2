"""The few-row products read what the kernel before them wrote (run on a GPU; skipped without one).

On compute capability 9.0+ the split-K GEMVs may be launched to overlap the kernel before them,
which lets them launch at once (albatross/cuda/pdl.cuh); they stream weights early and must wait
for that kernel before reading x. Here the kernel before is a long in-place residual layer norm
(16,384 rows, one block each, so its last rows are written last) and the product reads its last
row: a product that read early would see the old row. Eager launches and a CUDA graph replay.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from albatross import cuda_ops, int8_dispatch, linear, ops
from albatross.quant import quantize

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

DEV = "cuda"
ROWS, K, N = 16384, 4096, 4096


@pytest.fixture(scope="module", autouse=True)
def kernels() -> Iterator[None]:
    results = cuda_ops.enable_cuda_kernels()
    for name in ("fused", "gemv", "int8"):
        assert results[name].how in ("prebuilt", "jit"), results[name].describe()
    linear.set_gemv_allowed(True)  # off by default for fp16 weights; this test exercises it
    try:
        yield
    finally:
        linear.set_gemv_allowed(linear.GEMV_BY_DEFAULT)


def _products() -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    gen = torch.Generator(device=DEV).manual_seed(21)
    dense = (torch.randn(K, N, generator=gen, device=DEV) / K**0.5).half()
    packed = quantize(torch.randn(K, N, generator=gen, device=DEV) / K**0.5)
    assert int8_dispatch.gemv_enabled()
    return {"fp16 GEMV": lambda x: linear.gemv(x, dense), "int8 GEMV": lambda x: int8_dispatch.int8_gemv(x, packed)}


def _residual() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=DEV).manual_seed(22)
    x = torch.randn(ROWS, K, generator=gen, device=DEV).half()
    delta = torch.randn(ROWS, K, generator=gen, device=DEV).half()
    weight = torch.randn(K, generator=gen, device=DEV).half()
    bias = torch.randn(K, generator=gen, device=DEV).half()
    return x, delta, weight, bias


def _case(name: str) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
    """The product, the residual before the norm, the norm's other operands, and the product of
    the last row after the norm (computed with a sync between the two kernels)."""
    product = _products()[name]
    x, delta, weight, bias = _residual()
    updated = x.clone()
    ops.add_layer_norm(updated, delta, weight, bias)
    torch.cuda.synchronize()
    expected = product(updated[-1:])
    assert not torch.equal(updated[-1:], x[-1:])
    return product, x, (delta, weight, bias), expected


@pytest.mark.parametrize("name", ["fp16 GEMV", "int8 GEMV"])
def test_a_product_after_a_long_kernel_reads_its_output(name: str) -> None:
    product, x, (delta, weight, bias), expected = _case(name)

    for _ in range(3):  # eager: the two launches back to back, nothing between them
        fresh = x.clone()
        torch.cuda.synchronize()
        ops.add_layer_norm(fresh, delta, weight, bias)
        got = product(fresh[-1:])
        assert torch.equal(got, expected), f"{name} read x before the layer norm had written it"


@pytest.mark.parametrize("name", ["fp16 GEMV", "int8 GEMV"])
def test_a_captured_product_after_a_long_kernel_reads_its_output(name: str) -> None:
    product, x, (delta, weight, bias), expected = _case(name)

    static = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        ops.add_layer_norm(static, delta, weight, bias)
        product(static[-1:])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.add_layer_norm(static, delta, weight, bias)
        static_y = product(static[-1:])
    for _ in range(3):
        static.copy_(x)
        graph.replay()
        assert torch.equal(static_y, expected), f"{name} in a graph read x before the layer norm had written it"
