"""`albatross.linear` is the torch product wherever the GEMV kernel does not apply (the CPU, more
than four rows, fp32), and the `gemv` op's twin is `x @ W`: the kernel itself is tested on the GPU
in test_gemv_cuda.py."""

from __future__ import annotations

import torch

from albatross import linear, ops


def test_products_on_the_cpu_are_torch_products() -> None:
    gen = torch.Generator().manual_seed(0)
    x, W = torch.randn(2, 64, generator=gen), torch.randn(64, 48, generator=gen)
    assert not linear.takes_gemv(x, W)
    assert torch.equal(linear.mm(x, W), torch.mm(x, W))
    xb, Wb = torch.randn(3, 1, 64, generator=gen), torch.randn(3, 64, 48, generator=gen)
    assert torch.equal(linear.bmm(xb, Wb), torch.bmm(xb, Wb))


def test_the_gemv_op_on_the_cpu_is_its_twin() -> None:
    gen = torch.Generator().manual_seed(1)
    counters = torch.zeros(4, dtype=torch.int32)
    x, W = torch.randn(3, 40, generator=gen).half(), torch.randn(40, 24, generator=gen).half()
    assert torch.equal(ops.gemv(x, W, counters), x @ W)
    xb, Wb = torch.randn(3, 2, 40, generator=gen), torch.randn(3, 40, 16, generator=gen)
    assert torch.equal(ops.gemv(xb, Wb, counters), torch.bmm(xb, Wb))
    assert not counters.any(), "the twin leaves the kernel's workspace alone"


def test_the_kernel_is_taken_only_when_loaded_and_allowed() -> None:
    """On the CPU no library registers the op's CUDA kernel, so nothing takes it even when allowed."""
    loaded = "gemv" in ops.registered_cuda_ops()
    assert linear.gemv_enabled() == (loaded and linear.GEMV_BY_DEFAULT)
    try:
        linear.set_gemv_allowed(True)
        assert linear.gemv_enabled() == loaded
        linear.set_gemv_allowed(False)
        assert not linear.gemv_enabled()
    finally:
        linear.set_gemv_allowed(linear.GEMV_BY_DEFAULT)


def test_fp32_logits_on_the_cpu_are_the_product_converted() -> None:
    gen = torch.Generator().manual_seed(2)
    x, W = torch.randn(5, 64, generator=gen).bfloat16(), torch.randn(64, 40, generator=gen).bfloat16()
    try:
        linear.set_fp32_product_out(True)  # CUDA only (aten::mm.dtype has no CPU kernel): converted here
        out = linear.mm_float32(x, W)
    finally:
        linear.set_fp32_product_out(linear.FP32_PRODUCT_OUT_BY_DEFAULT)
    assert out.dtype == torch.float32 and torch.equal(out, torch.mm(x, W).float())
