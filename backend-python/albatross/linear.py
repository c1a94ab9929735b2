"""The model's matrix products `x @ W` (W stored `[in, out]`): the one seam where a weight format
plugs in. A weight is a float tensor (fp16/bf16/fp32) or an object that multiplies itself
(`Int8Weight.mm`: int8 with per-channel scales, albatross/quant.py).

A float product with 1-4 rows of fp16/bf16 on a GPU whose kernel library is loaded can take the
`gemv` op (the split-K kernel of `albatross/cuda/gemv.cu`; its twin is `x @ W`, `ops.gemv_torch`)
when `set_gemv_allowed(True)`; any other takes torch's product (cuBLAS on a GPU). The kernel is off
by default: on the H200 cuBLAS read the 7.2B decode weights at 3.5-4.5 TB/s, faster than the
kernel at every shape and row count measured (docs/performance.md, "Split-K GEMV").

`mm` and `bmm` are the only places the model multiplies by a weight matrix, so a new format (or
a faster kernel for one) changes nothing in the model; `mm_relu_square` is the channel mix's key
product with its `relu^2`, which a many-row fp16/bf16 call on a Hopper GPU can take in one kernel
(`albatross/relu_square_triton.py`) when `set_fused_relu_square(True)`.
"""

from __future__ import annotations

import threading
from typing import Union

import torch

from albatross import ops, triton_paths
from albatross.quant import Int8Weight

Weight = Union[torch.Tensor, Int8Weight]

GEMV_MAX_ROWS = 4
_GEMV_DTYPES = (torch.float16, torch.bfloat16)
_COUNTER_SLOTS = 1 << 16  # per device: one int32 per (matrix, column tile) of a split-K call

_counters: dict[int, torch.Tensor] = {}
_counters_lock = threading.Lock()
GEMV_BY_DEFAULT = False  # measured slower than cuBLAS (docs/performance.md, "Split-K GEMV")
_gemv_allowed = GEMV_BY_DEFAULT  # benchmarks and tests switch the float GEMV on to compare
_gemv_loaded = False  # latched once the gemv library has registered the op's CUDA kernel
# The LM head's cuBLAS product writes fp32 instead of a 16-bit result converted by a second
# kernel. On the H200 (7.2B graph decode, docs/performance.md "Session 19") batch 960 went 28,622
# -> 28,740 tok/s and batch 1 202 -> 203; `bench_model.py --fp32-logits on,off` compares.
FP32_PRODUCT_OUT_BY_DEFAULT = True
_fp32_product_out = FP32_PRODUCT_OUT_BY_DEFAULT  # benchmarks and tests switch it to compare
# The key product with relu^2 in its epilogue (relu_square_triton.py), for calls of at least
# FUSED_RELU_SQUARE_MIN_ROWS rows: off until bench/bench_ffn_key.py shows it beating cuBLAS plus
# the relu_square pass on a GPU.
FUSED_RELU_SQUARE_BY_DEFAULT = False
FUSED_RELU_SQUARE_MIN_ROWS = 1024
_fused_relu_square = FUSED_RELU_SQUARE_BY_DEFAULT


def counters(device: torch.device) -> torch.Tensor:
    """The zeroed tile counters of one device that the split-K kernels share (each call leaves
    them zero). Made once, before any graph capture reads them (the capture's warm-up comes first)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    buffer = _counters.get(index)
    if buffer is None:
        with _counters_lock:
            buffer = _counters.get(index)
            if buffer is None:
                buffer = torch.zeros(_COUNTER_SLOTS, dtype=torch.int32, device=torch.device("cuda", index))
                _counters[index] = buffer
    return buffer


def set_gemv_allowed(allowed: bool) -> None:
    """Let few-row float products take the GEMV kernel, or keep them on cuBLAS (the default)."""
    global _gemv_allowed
    _gemv_allowed = allowed


def gemv_enabled() -> bool:
    """Whether few-row float products on a GPU take the kernel: allowed, and its library loaded (by
    cuda_ops.enable_cuda_kernels). A loaded kernel stays registered, so True is remembered; until
    then each call asks the dispatcher (a GPU without the library runs cuBLAS)."""
    global _gemv_loaded
    if not _gemv_loaded:
        _gemv_loaded = torch._C._dispatch_has_kernel_for_dispatch_key(f"{ops.NAMESPACE}::gemv", "CUDA")
    return _gemv_allowed and _gemv_loaded


def takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The float GEMV kernel's preconditions (it also checks them, and raises)."""
    return (
        x.is_cuda
        and x.shape[-2] <= GEMV_MAX_ROWS
        and x.dtype in _GEMV_DTYPES
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and weight.shape[-2] >= 1
        and weight.shape[-1] % 8 == 0
        and weight.data_ptr() % 16 == 0
        and x.stride(-1) == 1
        and gemv_enabled()
    )


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The op: x `[R, K]` @ W `[K, N]`, or `[B, R, K]` @ `[B, K, N]`, R <= 4."""
    return ops.gemv(x, weight, counters(x.device))


def mm(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """`x [R, K] @ W [K, N]`."""
    if isinstance(weight, Int8Weight):
        return weight.mm(x)
    if takes_gemv(x, weight):
        return gemv(x, weight)
    return torch.mm(x, weight)


def mm_float32(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """`mm` with an fp32 result (the LM head's logits, which the sampler takes in fp32). A 16-bit
    product on a GPU that cuBLAS runs writes fp32 from its fp32 accumulators (`out_dtype`): no
    pass converting a 16-bit [R, V] result, and no rounding of the logits to 16 bits on the way.
    The GEMV, int8 and CPU products convert their result."""
    if (
        _fp32_product_out
        and isinstance(weight, torch.Tensor)
        and x.is_cuda
        and x.dim() == 2
        and x.dtype in _GEMV_DTYPES
        and weight.dtype == x.dtype
        and not takes_gemv(x, weight)
    ):
        return torch.mm(x, weight, out_dtype=torch.float32)
    return mm(x, weight).float()


def set_fp32_product_out(allowed: bool) -> None:
    """Let `mm_float32` have cuBLAS write fp32, or convert a 16-bit product after."""
    global _fp32_product_out
    _fp32_product_out = allowed


def set_fused_relu_square(allowed: bool) -> None:
    """Let many-row key products take the kernel with relu^2 in its epilogue, or keep cuBLAS and the pass."""
    global _fused_relu_square
    _fused_relu_square = allowed


def takes_fused_relu_square(x: torch.Tensor, weight: Weight) -> bool:
    """The fused kernel's preconditions: its TMA loads and stores need rows 16-byte aligned and
    contiguous along them, and it was built and measured for Hopper (sm90) only."""
    return (
        _fused_relu_square
        and isinstance(weight, torch.Tensor)
        and x.is_cuda
        and x.dim() == 2
        and x.shape[0] >= FUSED_RELU_SQUARE_MIN_ROWS
        and x.dtype in _GEMV_DTYPES
        and weight.dtype == x.dtype
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (x, weight))
        and weight.shape[1] % 8 == 0
        and triton_paths.hopper(x.device)
    )


def mm_relu_square(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """`relu(x @ W)^2`, the channel mix's key product: in one kernel where it applies, otherwise
    the product then the `relu_square` op."""
    if takes_fused_relu_square(x, weight):
        from albatross import relu_square_triton  # Triton is imported only where a GPU path runs

        assert isinstance(weight, torch.Tensor)
        return relu_square_triton.product_relu_square(x, weight)
    return ops.relu_square(mm(x, weight))


def bmm(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """`x [B, R, K] @ W [B, K, N]` (a stack of products, as the r/k/v projections)."""
    if isinstance(weight, Int8Weight):
        return weight.mm(x)
    if takes_gemv(x, weight):
        return gemv(x, weight)
    return torch.bmm(x, weight)


def weight_bytes(weight: Weight) -> int:
    if isinstance(weight, Int8Weight):
        return weight.nbytes
    return weight.numel() * weight.element_size()
