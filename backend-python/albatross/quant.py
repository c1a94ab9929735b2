"""Int8 weights (W8A16): the large matrices stored as int8 with one scale per output channel.

`weights=int8` quantizes r, k, v, output, the FFN key/value and the head at load; the LoRA
matrices, norms, mixing vectors and the embedding stay in the activation dtype, and activations
stay 16-bit (fp32 on the CPU). A matrix `W [K, N]` (stored `[in, out]`, as the model multiplies
`x @ W`) becomes `q [K, N]` int8 and `scale [N]` fp32 with

    scale[n] = max_k |W[k, n]| / 127,   q[k, n] = round(W[k, n] / scale[n])   (symmetric, no zero point)

so `x @ W ~= (x @ q) * scale`: the scale is constant along the reduction, and kernels multiply
their fp32 sums by it once per output. Per-channel against per-group scales: docs/performance.md
("int8 weights").

The product itself is `Int8Weight.mm`; which implementation runs (the CUDA GEMV for a few rows,
the Triton tile kernel, or the torch twin below) is `albatross.int8_dispatch`'s choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WEIGHT_FORMATS: tuple[str, ...] = ("fp16", "int8")  # `weights=` words; fp16: kept at the activation dtype
DEFAULT_WEIGHT_FORMAT = "fp16"
# The checkpoint keys (by suffix) of the matrices `weights=int8` stores as int8: r, k, v, output,
# the FFN key and value (`ffn.key.weight`, `ffn.value.weight`) and the head.
LARGE_MATRICES: tuple[str, ...] = ("receptance.weight", "key.weight", "value.weight", "output.weight", "head.weight")
QMAX = 127  # symmetric range [-127, 127]: -128 is never produced, so negation is exact
_QUANTIZE_SLAB = 1 << 24  # elements quantized at once: bounds the fp32 temporaries at load (64 MB)


def check_weight_format(name: str) -> str:
    if name not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weights format {name!r}; known: {', '.join(WEIGHT_FORMATS)}")
    return name


@dataclass(slots=True, eq=False)
class Int8Weight:
    """`q [..., K, N]` int8 and `scale [..., N]` fp32 on one device; a leading batch dimension
    holds stacked matrices (the layer's receptance, key and value)."""

    q: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        if self.q.dtype != torch.int8 or self.q.dim() not in (2, 3):
            raise ValueError(f"q must be an int8 [K, N] or [B, K, N] tensor, got {self.q.dtype} {list(self.q.shape)}")
        expected = (*self.q.shape[:-2], self.q.shape[-1])
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != expected:
            raise ValueError(f"scale must be fp32 {list(expected)}, got {self.scale.dtype} {list(self.scale.shape)}")
        if self.q.device != self.scale.device:
            raise ValueError("q and scale must be on one device")

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 4 * self.scale.numel()

    def __getitem__(self, index: int) -> Int8Weight:
        """One matrix of a stack (views, no copy)."""
        if self.q.dim() != 3:
            raise TypeError("only a stacked [B, K, N] weight can be indexed")
        return Int8Weight(self.q[index], self.scale[index])

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The float matrix `q * scale` in `dtype` (the product is computed in fp32, then cast)."""
        return (self.q.float() * self.scale.unsqueeze(-2)).to(dtype)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W`: `[R, K] -> [R, N]`, or `[B, R, K] -> [B, R, N]` for a stack."""
        from albatross import int8_dispatch  # the kernels' module imports this one

        return int8_dispatch.int8_mm(x, self)


def quantize(weight: torch.Tensor, device: torch.device | None = None) -> Int8Weight:
    """Per-output-channel symmetric int8 of `weight [..., K, N]` (any float dtype, any device),
    computed in fp32 a slab of columns at a time so the temporaries stay small. `device` (default:
    the weight's) holds the result and computes each slab, so a matrix still in host memory moves
    to the GPU a slab at a time and never whole at the file's precision."""
    if weight.dim() not in (2, 3) or not weight.is_floating_point():
        raise ValueError(f"quantize takes a float [K, N] or [B, K, N] matrix, got {weight.dtype} {list(weight.shape)}")
    target = weight.device if device is None else device
    K, N = weight.shape[-2], weight.shape[-1]
    q = torch.empty(weight.shape, dtype=torch.int8, device=target)
    scale = torch.empty((*weight.shape[:-2], N), dtype=torch.float32, device=target)
    columns = max(1, _QUANTIZE_SLAB // max(1, K * (weight.numel() // (K * N))))
    for start in range(0, N, columns):
        part = weight[..., start : start + columns].to(target, torch.float32)
        part_scale = part.abs().amax(dim=-2) / QMAX
        # An all-zero column keeps scale 0 and q 0; dividing by 1 there avoids 0/0.
        divisor = torch.where(part_scale > 0, part_scale, torch.ones_like(part_scale)).unsqueeze(-2)
        q[..., start : start + columns] = torch.round(part / divisor).clamp_(-QMAX, QMAX).to(torch.int8)
        scale[..., start : start + columns] = part_scale
    return Int8Weight(q, scale)


def int8_mm_torch(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """The twin of every int8 kernel: dequantize to the activation dtype, then the float product
    (cuBLAS on a GPU). Exact up to the rounding of `q * scale` to that dtype."""
    return torch.matmul(x, weight.dequantize(x.dtype))
