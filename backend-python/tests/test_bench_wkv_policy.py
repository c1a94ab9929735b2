"""bench_wkv_chunked.recommend turns a table of timings into the dispatch policy's switch point."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "external"))

from bench_wkv_chunked import Timing, recommend


def _timings(cases: dict[tuple[int, int], tuple[float, float]]) -> list[Timing]:
    rows = []
    for (sequences, length), (sequential, chunked) in cases.items():
        label = f"prefill {sequences}x{length}"
        rows.append(Timing(label, sequences, length, "fp32", "sequential", sequential, 0.0))
        rows.append(Timing(label, sequences, length, "fp32", "chunked bv=32 w8 ieee", chunked, 0.0))
    return rows


def test_the_switch_point_is_the_shortest_winning_prompt_and_the_widest_winning_batch() -> None:
    policy = recommend(
        _timings({(1, 64): (60, 90), (1, 256): (240, 150), (1, 4096): (3900, 700), (4, 1024): (1000, 800), (16, 2048): (3600, 4000), (64, 512): (3600, 9000)}),
        heads=64,
    )
    assert policy.min_tokens == 256
    assert policy.max_long_heads == 4 * 64


def test_no_win_gives_a_policy_that_never_takes_the_chunked_kernel_for_measured_lengths() -> None:
    policy = recommend(_timings({(1, 64): (60, 90), (1, 4096): (3900, 4100)}), heads=64)
    assert not policy.prefers_chunked((4096,), heads=64)
