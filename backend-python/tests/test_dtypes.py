"""albatross/dtypes.py: the one table of floating-point types and their names."""

from __future__ import annotations

import pytest
import torch

from albatross.dtypes import DTYPES, default_dtype_name, dtype_named, torch_name
from albatross_engine.config import AlbatrossBackendConfig


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("fp32", torch.float32), ("float32", torch.float32), ("fp16", torch.float16), ("half", torch.float16),
     ("float16", torch.float16), ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16)],
)  # fmt: skip
def test_short_torch_and_alias_names_name_the_same_dtype(name: str, dtype: torch.dtype) -> None:
    assert dtype_named(name) is dtype


def test_torch_names_read_back_as_their_dtype() -> None:
    assert {torch_name(dtype) for dtype in DTYPES.values()} == {"float32", "float16", "bfloat16"}
    assert all(dtype_named(torch_name(dtype)) is dtype for dtype in DTYPES.values())


def test_an_unknown_name_is_an_error_listing_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown dtype 'fp8'; known: .*bf16.*fp32"):
        dtype_named("fp8")


def test_a_gpu_defaults_to_fp16_and_the_cpu_to_fp32_for_weights_and_states() -> None:
    assert (default_dtype_name("cuda"), default_dtype_name("cpu")) == ("fp16", "fp32")
    config = AlbatrossBackendConfig()
    assert (config.effective_dtype("cuda"), config.effective_state_dtype("cuda")) == ("fp16", "fp16")
    assert (config.effective_dtype("cpu"), config.effective_state_dtype("cpu")) == ("fp32", "fp32")
    chosen = AlbatrossBackendConfig(dtype="bf16", state_dtype="fp32")
    assert (chosen.effective_dtype("cuda"), chosen.effective_state_dtype("cuda")) == ("bf16", "fp32")
