"""bench/mixed_step_cost.py: the grid fit recovers a known step-time model, and the script runs
end to end on a tiny CPU model (its figures there mean nothing; the GPU run is the measurement)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import mixed_step_cost


def test_fit_recovers_base_per_token_and_per_row_costs() -> None:
    points = [(p, r, 21.5 + 0.0229 * p + 0.0341 * r) for p in (0, 2048, 8192, 16384) for r in (0, 240, 960) if p or r]
    fit = mixed_step_cost.fit_linear(points)
    assert fit is not None
    base, per_token, per_row, residual = fit
    assert (base, per_token, per_row) == pytest.approx((21.5, 0.0229, 0.0341), rel=1e-9)
    assert residual < 1e-9
    decode_only = mixed_step_cost.fit_linear([(0, r, 3.0 + 0.038 * r) for r in (240, 480, 960)], ("R",))
    assert decode_only is not None and decode_only[:3] == pytest.approx((3.0, 0.0, 0.038))


def test_fit_refuses_a_grid_that_varies_one_column() -> None:
    # Every mixed step of a burst carries the whole budget: the base and the per-token cost are one unknown.
    assert mixed_step_cost.fit_linear([(16384, r, 400.0 + 0.03 * r) for r in (100, 400, 900)]) is None


def test_the_script_times_every_cell_on_a_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "mixed.json"
    mixed_step_cost.main(["--shape", "1x64", "--device", "cpu", "--decode-rows", "0,2,3", "--prompt-tokens", "0,8,16",
                          "--chunks", "8", "--reps", "1", "--json", str(out)])  # fmt: skip
    figures = json.loads(out.read_text())
    cells = {(c["prompt_tokens"], c["decode_rows"]): c["ms"] for c in figures["cells"]}
    assert set(cells) == {(p, r) for p in (0, 8, 16) for r in (0, 2, 3)} - {(0, 0)}
    assert all(set(ms) == ({"mixed", "split"} if p and r else {"mixed"}) for (p, r), ms in cells.items())
    assert set(figures["graph_decode_ms"]) == {"2", "3"}
    assert {f["way"] for f in figures["fits"]} == {"mixed", "split", "graph decode"}


def test_one_prompt_cells_are_one_chunk_each(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "long.json"
    mixed_step_cost.main(["--shape", "1x64", "--device", "cpu", "--one-prompt", "--prompt-tokens", "4,8", "--decode-rows", "0,2",
                          "--reps", "1", "--json", str(out)])  # fmt: skip
    cells = json.loads(out.read_text())["cells"]
    assert {(c["chunk"], c["prompt_tokens"], c["decode_rows"]) for c in cells} == {(4, 4, 0), (4, 4, 2), (8, 8, 0), (8, 8, 2)}
    lone = capsys.readouterr().out.split("a lone prompt of 8 tokens")[1].splitlines()[2:]
    assert [line.split()[:3] for line in lone] == [["4", "0", "2"], ["4", "2", "2"], ["8", "0", "1"], ["8", "2", "1"]]
