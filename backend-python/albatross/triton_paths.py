"""What the batch-1 Triton paths share (`loras`, `norm_mix`, `wkv_decode`): each one's switch, and
whether a call qualifies (Triton present, fp16/bf16 tensors on a GPU, at most MAX_ROWS rows), and
whether their kernels let the next kernel in the stream launch before they finish.

That signal (`griddepcontrol.launch_dependents`, compute capability 9.0+) matters only to a
kernel launched to overlap its predecessor (the few-row GEMVs, albatross/cuda/pdl.cuh); every other
kernel still waits for the whole grid. The PTX instruction does not exist before sm90, hence the
check; `ALBATROSS_PDL=0` turns it off, as it does those launches."""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass, field

import torch

MAX_ROWS = 4
_TRITON = importlib.util.find_spec("triton") is not None  # CUDA builds of torch ship it
DTYPES = (torch.float16, torch.bfloat16)  # the activations the Triton paths take


@dataclass(slots=True)
class TritonPath:
    """One path's switch: `default` until `set_allowed` (benchmarks and tests compare both)."""

    default: bool
    allowed: bool = field(init=False)

    def __post_init__(self) -> None:
        self.allowed = self.default

    def set_allowed(self, allowed: bool) -> None:
        self.allowed = allowed

    def applies(self, tensor: torch.Tensor, rows: int) -> bool:
        return self.allowed and _TRITON and tensor.is_cuda and tensor.dtype in DTYPES and rows <= MAX_ROWS


def launch_dependents(device: torch.device) -> bool:
    if device.type != "cuda" or os.environ.get("ALBATROSS_PDL") == "0":
        return False
    return _capability(device_index(device))[0] >= 9


def hopper(device: torch.device) -> bool:
    """A Hopper GPU (sm90) with Triton: where the kernels written for its TMA and wgmma were measured."""
    return _TRITON and device.type == "cuda" and _capability(device_index(device))[0] == 9


def device_index(device: torch.device) -> int:
    """A CUDA device's index (`cuda` alone: the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)
