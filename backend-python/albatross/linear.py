"""The model's matrix products `x @ W` (W stored `[in, out]`): the one seam where a weight format
plugs in. A weight is a float tensor (fp16/bf16/fp32: torch's product) or an object that
multiplies itself (`Int8Weight.mm`: int8 with per-channel scales, albatross/quant.py).

`mm` and `bmm` are the only places the model multiplies by a weight matrix, so a new format (or
a faster kernel for one) changes nothing in the model.
"""

from __future__ import annotations

import threading
from typing import Union

import torch

from albatross.quant import Int8Weight

Weight = Union[torch.Tensor, Int8Weight]

_COUNTER_SLOTS = 1 << 16  # per device: one int32 per (matrix, column tile) of a split-K call

_counters: dict[int, torch.Tensor] = {}
_counters_lock = threading.Lock()


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


def mm(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """`x [R, K] @ W [K, N]`."""
    if isinstance(weight, Int8Weight):
        return weight.mm(x)
    return torch.mm(x, weight)


def bmm(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """`x [B, R, K] @ W [B, K, N]` (a stack of products, as the r/k/v projections)."""
    if isinstance(weight, Int8Weight):
        return weight.mm(x)
    return torch.bmm(x, weight)


def weight_bytes(weight: Weight) -> int:
    if isinstance(weight, Int8Weight):
        return weight.nbytes
    return weight.numel() * weight.element_size()
