"""The int8 dispatch's choice of path (CPU: a GPU is simulated by patching torch.cuda.is_available,
since choosing calls nothing on the device): `ROW_PATHS` decides above the GEMV's rows, a path
that is switched off falls back to dequantizing, and the memory plan's threshold follows the table.
On a GPU, test_int8_cuda.py checks `path_for` on real operands."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from albatross import int8_dispatch
from albatross.quant import quantize


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(int8_dispatch, "_triton", True)
    yield
    int8_dispatch.set_allowed(gemv=True, tile=True, swap=True, slab=True)


TABLE = ((63, "tile"), (256, "swap"), (2048, "slab"), (1 << 62, "dequantize"))


def test_the_table_names_only_known_paths_and_ends_with_every_row_count() -> None:
    assert all(path in int8_dispatch.PATHS and path != "gemv" for _, path in int8_dispatch.ROW_PATHS)
    bounds = [most for most, _ in int8_dispatch.ROW_PATHS]
    assert bounds == sorted(bounds) and bounds[-1] >= 1 << 40
    assert bounds[0] > int8_dispatch.GEMV_MAX_ROWS


@pytest.mark.usefixtures("gpu")
def test_rows_take_the_first_table_entry_that_holds_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(int8_dispatch, "ROW_PATHS", TABLE)
    chosen = {rows: int8_dispatch.row_path(rows) for rows in (5, 63, 64, 256, 257, 960, 2048, 2049, 16384)}
    assert chosen == {5: "tile", 63: "tile", 64: "swap", 256: "swap", 257: "slab", 960: "slab", 2048: "slab", 2049: "dequantize", 16384: "dequantize"}


@pytest.mark.usefixtures("gpu")
def test_a_path_switched_off_dequantizes_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(int8_dispatch, "ROW_PATHS", TABLE)
    int8_dispatch.set_allowed(swap=False)
    assert int8_dispatch.row_path(100) == "dequantize"
    assert int8_dispatch.row_path(10) == "tile" and int8_dispatch.row_path(1000) == "slab"
    int8_dispatch.set_allowed(swap=True, slab=False)
    assert int8_dispatch.row_path(100) == "swap" and int8_dispatch.row_path(1000) == "dequantize"
    monkeypatch.setattr(int8_dispatch, "_triton", False)  # no Triton: every Triton path dequantizes
    assert {int8_dispatch.row_path(rows) for rows in (10, 100, 1000)} == {"dequantize"}


@pytest.mark.usefixtures("gpu")
def test_the_memory_plan_threshold_stops_at_the_first_dequantizing_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(int8_dispatch, "_gemv_loaded", True)
    monkeypatch.setattr(int8_dispatch, "ROW_PATHS", TABLE)
    assert int8_dispatch.dequantize_above_rows("cuda") == 256  # the slab path allocates a buffer
    int8_dispatch.set_allowed(swap=False)
    assert int8_dispatch.dequantize_above_rows("cuda") == 63
    int8_dispatch.set_allowed(tile=False, swap=True)
    assert int8_dispatch.dequantize_above_rows("cuda") == int8_dispatch.GEMV_MAX_ROWS
    monkeypatch.setattr(int8_dispatch, "ROW_PATHS", ((1 << 62, "swap"),))
    assert int8_dispatch.dequantize_above_rows("cuda") == 1 << 62
    assert int8_dispatch.dequantize_above_rows("cpu") == 0


@pytest.mark.usefixtures("gpu")
def test_cpu_operands_always_take_the_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(int8_dispatch, "ROW_PATHS", TABLE)
    weight = quantize(torch.randn(64, 48, generator=torch.Generator().manual_seed(1)))
    for rows in (1, 100, 1000):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        assert int8_dispatch.path_for(x, weight) == "dequantize"
        assert torch.allclose(int8_dispatch.int8_mm(x, weight), x @ weight.dequantize(torch.float32), atol=1e-5, rtol=0)
