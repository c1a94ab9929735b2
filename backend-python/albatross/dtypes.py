"""The floating-point types of weights, activations and states, and their names.

Short names (`fp32`, `fp16`, `bf16`) are what strategies, options and command lines take; torch's
own names (`float32`, `float16`, `bfloat16`) are what serialized slot states record. On a GPU
weights, activations and WKV states default to fp16 (for states: docs/performance.md, "Default WKV
state dtype"); on the CPU to fp32, bit-comparable with the reference package.
"""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(DTYPES.values())


def torch_name(dtype: torch.dtype) -> str:
    """`float32`, `float16` or `bfloat16`."""
    return str(dtype).removeprefix("torch.")


_BY_ANY_NAME: dict[str, torch.dtype] = {
    **DTYPES,
    **{torch_name(dtype): dtype for dtype in SUPPORTED_DTYPES},
    "half": torch.float16,
}


def dtype_named(name: str) -> torch.dtype:
    """A short name, torch's name or `half`; anything else is a ValueError listing the names."""
    dtype = _BY_ANY_NAME.get(name)
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(sorted(_BY_ANY_NAME))}")
    return dtype


def default_dtype_name(device_type: str) -> str:
    """What weights, activations and WKV states use on `device_type` when nothing is asked."""
    return "fp16" if device_type == "cuda" else "fp32"
