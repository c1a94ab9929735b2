"""`bench_int8.py kernels` on the CPU (its dry run): every measurement is a JSON line written and
flushed when taken, so a run that dies keeps its rows; an implementation over its time cap is
interrupted and its later rows skipped with the reason; the summary picks the best path per row
count and merges neighbours into the ROW_PATHS it suggests."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import int8_kernels
from albatross.quant import Int8Weight


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _products(product: int8_kernels.Product) -> int8_kernels.Maker:
    return lambda dense, weights: [product for _ in dense]


def _only(monkeypatch: pytest.MonkeyPatch, *impls: int8_kernels.Impl) -> None:
    fp16 = next(impl for impl, _ in int8_kernels.implementations() if impl.name == "fp16 cuBLAS")
    monkeypatch.setattr(int8_kernels, "implementations", lambda: [(fp16, ""), *((impl, "") for impl in impls)])


def test_a_dry_run_writes_every_row_as_it_goes(tmp_path: Path) -> None:
    out = tmp_path / "k.jsonl"
    int8_kernels.kernels_main(("tiny",), (1, 8), 2, 60.0, ("dequantize", "slab 2"), out, device="cpu")
    lines = _lines(out)
    assert lines[0]["what"] == "kernels" and lines[0]["device"] == "cpu"
    rows = [line for line in lines if "rows" in line and "impl" in line]
    assert [(r["rows"], r["impl"]) for r in rows] == [(1, "fp16 cuBLAS"), (1, "int8 slab 2 MB"), (1, "int8 dequantize + cuBLAS"),
                                                       (8, "fp16 cuBLAS"), (8, "int8 slab 2 MB"), (8, "int8 dequantize + cuBLAS")]  # fmt: skip
    dequantized = [r for r in rows if r["impl"] == "int8 dequantize + cuBLAS"]
    assert all(float(r["us"]) > 0 and float(r["error"]) < 1e-2 and r["path"] == "dequantize" for r in dequantized), dequantized  # type: ignore[arg-type]
    assert all("failed" in r for r in rows if "slab" in str(r["impl"])), "the slab path needs a GPU: its rows say why"
    assert "summary" in lines[-1] and lines[-1]["suggested_ROW_PATHS"] == [[1 << 62, "dequantize"]]


def test_rows_measured_before_a_crash_stay_in_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def dies_at_eight_rows(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 8:
            raise SystemExit("killed")  # not an Exception: nothing catches it, as with a kill
        return x @ torch.zeros(x.shape[1], 96, dtype=x.dtype)

    _only(monkeypatch, int8_kernels.Impl("int8 doomed", _products(dies_at_eight_rows)))
    out = tmp_path / "k.jsonl"
    with pytest.raises(SystemExit):
        int8_kernels.kernels_main(("tiny",), (1, 8), 2, 60.0, (), out, device="cpu")
    measured = [(line["rows"], line["impl"]) for line in _lines(out) if "us" in line]
    assert measured == [(1, "fp16 cuBLAS"), (1, "int8 doomed"), (8, "fp16 cuBLAS")]


def test_an_implementation_over_its_cap_is_interrupted_and_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def slow(x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.3)  # a compile or an autotune that would take the whole call
        return x @ torch.zeros(x.shape[1], 96, dtype=x.dtype)

    _only(monkeypatch, int8_kernels.Impl("int8 slow", _products(slow)))
    out = tmp_path / "k.jsonl"
    started = time.perf_counter()
    int8_kernels.kernels_main(("tiny",), (1, 8, 64), 1, 0.5, (), out, device="cpu")
    slow_rows = [line for line in _lines(out) if line.get("impl") == "int8 slow"]
    assert [r["rows"] for r in slow_rows] == [1, 8, 64]
    assert "over its time cap" in str(slow_rows[0]["skipped"])
    assert all("over its" in str(r["skipped"]) for r in slow_rows[1:])
    assert time.perf_counter() - started < 30, "the cap did not stop the slow implementation"


def _record(shape: str, rows: int, impl: str, us: float, fp16: float, path: str = "") -> dict[str, object]:
    return {"shape": shape, "rows": rows, "impl": impl, "us": us, "vs_fp16": fp16 / us, **({"path": path} if path else {})}


def test_the_summary_suggests_the_best_path_per_row_count() -> None:
    records: list[dict[str, object]] = []
    for shape in ("a", "b"):
        for rows, tile, swap, slab in ((64, 10.0, 8.0, 20.0), (256, 20.0, 12.0, 30.0), (960, 50.0, 40.0, 30.0), (4096, 200.0, 150.0, 120.0)):
            records += [_record(shape, rows, "fp16 cuBLAS", 10.0, 10.0), _record(shape, rows, "int8 tile (default)", tile, 10.0, "tile"),
                        _record(shape, rows, "int8 swap x", swap, 10.0, "swap"), _record(shape, rows, "int8 slab 8 MB", slab, 10.0, "slab"),
                        _record(shape, rows, "gemlite A16W8", 5.0 if rows == 64 else 500.0, 10.0)]  # fmt: skip
    records.append({**_record("a", 960, "int8 swap y", 1.0, 10.0), "wrong": True})  # a wrong answer never wins
    summary = int8_kernels.summarize(records)
    assert summary["suggested_ROW_PATHS"] == [(256, "swap"), (1 << 62, "slab")]
    best = {(r["shape"], r["rows"]): r for r in summary["summary"]}  # type: ignore[attr-defined]
    assert best["a", 64]["best"] == "gemlite A16W8" and best["a", 64]["best_path"] == "swap"
    assert best["a", 960]["best"] == "int8 slab 8 MB" and abs(float(best["a", 960]["best_vs_fp16"]) - 1 / 3) < 1e-9


def test_the_rotation_sizes_and_one_product_per_weight_copy() -> None:
    assert int8_kernels._copies(16 << 20) == 12 and int8_kernels._copies(256 << 20) == 2 and int8_kernels._copies(1 << 10) == 16
    weights = [Int8Weight(torch.zeros(4, 4, dtype=torch.int8), torch.zeros(4)) for _ in range(3)]
    products = int8_kernels._ours(lambda x, w: x @ w.dequantize(x.dtype))([], weights)
    assert len(products) == 3
