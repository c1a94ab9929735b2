"""bench/step_profile.mixed_step_fit: the mixed steps' cost model, and its refusal when the steps
cannot tell a prompt token's cost from a decode row's and the base."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from step_profile import mixed_step_fit
from step_report import print_report


def _steps(tokens: list[int], rows: list[int], noise_ms: float, seed: int = 0) -> list[tuple[float, float, float]]:
    rng = random.Random(seed)
    return [(t, r, 30.0 + 0.025 * t + 0.040 * r + rng.uniform(-noise_ms, noise_ms)) for t, r in zip(tokens, rows)]


def test_steps_that_differ_give_the_costs_they_were_made_of() -> None:
    rng = random.Random(1)
    tokens = [rng.randrange(1_000, 16_384) for _ in range(40)]
    rows = [rng.randrange(0, 960) for _ in range(40)]
    fit = mixed_step_fit(_steps(tokens, rows, noise_ms=0.5))
    assert fit is not None and not fit.get("no_fit")
    assert fit["ms"] == pytest.approx(30.0, abs=1.0)
    assert fit["us_per_prefill_token"] == pytest.approx(25.0, abs=0.5)
    assert fit["us_per_decode_row"] == pytest.approx(40.0, abs=2.0)


def test_steps_alike_in_either_count_are_refused_with_their_spreads() -> None:
    tokens = [16_384 - 7 * n for n in range(16)]  # the whole budget every step
    rows = [100 + 50 * n for n in range(16)]
    fit = mixed_step_fit(_steps(tokens, rows, noise_ms=20.0))
    assert fit is not None and fit["no_fit"]
    assert fit["prefill_tokens_spread"] < 0.05 < fit["decode_rows_spread"]


def test_a_negative_cost_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # Spread enough, but the times fall as the prompt tokens grow: no cost model explains them.
    samples = [(float(t), float(r), 600.0 - 0.01 * t) for t, r in zip(range(2_000, 18_000, 1_000), [400, 420, 380, 450] * 4)]
    fit = mixed_step_fit(samples)
    assert fit is not None and fit["no_fit"]
    print_report({"steps": 16, "total_s": 1.0, "idle_between_steps_s": 0.0, "groups": {}, "mixed_fit": fit})
    assert "no fit of a cost per prompt token" in capsys.readouterr().out


def test_fewer_than_four_steps_give_no_fit() -> None:
    assert mixed_step_fit(_steps([1_000, 2_000, 3_000], [1, 2, 3], noise_ms=0.0)) is None
