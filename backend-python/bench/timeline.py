"""The engine-counter timeline both benchmarks print: samples of the engine's counters while a load
runs (in process from `AlbatrossRWKV.status()`, over HTTP from `GET /status`'s "effective"), shown
as rates per interval, so a slow prefill ramp can be told apart from slow decode steps."""

from __future__ import annotations

from collections.abc import Mapping

TIMELINE_KEYS = ("active_slots", "queue_depth", "steps", "step_time_ms", "decode_tokens_total", "prefill_tokens_total",
                 "generated_tokens_total", "state_saves")  # fmt: skip


def timeline_point(elapsed: float, status: Mapping[str, object]) -> dict[str, float]:
    point = {"t": round(elapsed, 3)}
    point.update({k: float(v) for k in TIMELINE_KEYS if isinstance(v := status.get(k), (int, float))})
    return point


def print_timeline(points: list[dict[str, float]], every_s: float) -> None:
    """Per interval of at least `every_s`: steps/s, generated and prefilled tokens/s, and the slots in
    use and queue depth at its end."""
    print(f"{'t s':>7}{'active':>8}{'queue':>7}{'steps/s':>9}{'gen tok/s':>11}{'prefill tok/s':>15}{'step ms':>9}")
    last: dict[str, float] | None = None
    for point in points:
        if last is not None and point["t"] - last["t"] < every_s:
            continue
        if last is not None:
            dt = point["t"] - last["t"]
            steps, generated, prefilled = ((point.get(k, 0.0) - last.get(k, 0.0)) / dt
                                           for k in ("steps", "generated_tokens_total", "prefill_tokens_total"))  # fmt: skip
            print(f"{point['t']:>7.1f}{point.get('active_slots', 0):>8.0f}{point.get('queue_depth', 0):>7.0f}"
                  f"{steps:>9.1f}{generated:>11.0f}{prefilled:>15.0f}{point.get('step_time_ms', 0):>9.1f}")  # fmt: skip
        last = point
