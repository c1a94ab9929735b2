"""Prometheus text exposition: counters and histograms measured in the routes and the request log,
plus the numeric fields of the loaded backend's `status()`: gauges (queue depth, active slots, step
time, ...) and, for its cumulative fields, counters named `..._total` (tokens, finished requests,
cache hits per tier, ...)."""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

LATENCY_BUCKETS_S: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
INTER_TOKEN_BUCKETS_S: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
DURATION_BUCKETS_S: tuple[float, ...] = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")


@dataclass(slots=True)
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if list(self.buckets) != sorted(self.buckets):
            raise ValueError("histogram buckets must be ascending")
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, help_text: str) -> list[str]:
        return [f"# HELP {name} {help_text}", f"# TYPE {name} histogram", *self.samples(name)]

    def samples(self, name: str, labels: str = "") -> list[str]:
        """The `_bucket`, `_sum` and `_count` samples; `labels` is `key="value",...` or empty."""
        prefix = f"{labels}," if labels else ""
        out: list[str] = []
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts):
            cumulative += count
            out.append(f'{name}_bucket{{{prefix}le="{bound}"}} {cumulative}')
        out.append(f'{name}_bucket{{{prefix}le="+Inf"}} {self.count}')
        braces = f"{{{labels}}}" if labels else ""
        out.append(f"{name}_sum{braces} {self.total:.6f}")
        out.append(f"{name}_count{braces} {self.count}")
        return out


@dataclass(slots=True)
class ServerMetrics:
    requests: dict[str, int] = field(default_factory=dict)  # completion requests by route path
    errors: dict[int, int] = field(default_factory=dict)  # error answers of completion routes by HTTP status
    responses: dict[int, int] = field(default_factory=dict)  # every answer by HTTP status (401s, 429s, ...)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS_S))
    inter_token: Histogram = field(default_factory=lambda: Histogram(INTER_TOKEN_BUCKETS_S))
    request_duration: dict[str, Histogram] = field(default_factory=dict)  # by route template

    def count_request(self, route: str) -> None:
        self.requests[route] = self.requests.get(route, 0) + 1

    def count_error(self, status_code: int) -> None:
        self.errors[status_code] = self.errors.get(status_code, 0) + 1

    def observe_response(self, route: str, status_code: int, seconds: float) -> None:
        """Every finished request (runner.request_log); `route` is the route's path template."""
        self.responses[status_code] = self.responses.get(status_code, 0) + 1
        histogram = self.request_duration.get(route)
        if histogram is None:
            histogram = self.request_duration[route] = Histogram(DURATION_BUCKETS_S)
        histogram.observe(seconds)


# Cumulative fields of a backend's status(): exposed as counters named `..._total`. Every other
# number is a gauge. A dict-valued field is split the same way, key by key.
BACKEND_COUNTERS: frozenset[str] = frozenset(
    {
        "steps",
        "decode_tokens_total",
        "prefill_tokens_total",
        "generated_tokens_total",
        "requests_finished",
        "prefix_cache_hits",
        "prefix_cache_misses",
        "cached_prompt_tokens_total",
        "shared_prompt_tokens_total",
        "state_saves",
        "requests_rejected",
        "queued_requests_dropped",
        "state_cache.l1_hits",
        "state_cache.l2_hits",
        "state_cache.l3_hits",
        "state_cache.prefix_dropped",
        "state_cache.misses",
        "state_cache.puts",
        "state_cache.disk_writes",
        "state_cache.disk_write_errors",
        "state_cache.corrupt_rows_dropped",
        "state_cache.disk_evictions",
    }
)


def _metric_name(*parts: str) -> str:
    return _NAME_UNSAFE.sub("_", "_".join(parts)).lower()


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: object) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def _counter_name(name: str) -> str:
    return name if name.endswith("_total") else name + "_total"


def backend_metrics(status: Mapping[str, object]) -> list[str]:
    """Numbers become `rwkv_backend_<key>` gauges, or `rwkv_backend_<key>_total` counters for the
    keys in BACKEND_COUNTERS; a dict of numbers becomes one family labelled by `key` (two when it
    holds both kinds)."""
    out: list[str] = []
    for key in sorted(status):
        value = status[key]
        name = _metric_name("rwkv_backend", key)
        number = _number(value)
        if number is not None:
            if key in BACKEND_COUNTERS:
                out += [f"# TYPE {_counter_name(name)} counter", f"{_counter_name(name)} {number:g}"]
            else:
                out += [f"# TYPE {name} gauge", f"{name} {number:g}"]
        elif isinstance(value, Mapping):
            samples = [(str(k), _number(v)) for k, v in value.items()]
            numbers = [(k, v) for k, v in samples if v is not None]
            whole_counter = key in BACKEND_COUNTERS
            gauges = [(k, v) for k, v in numbers if not whole_counter and f"{key}.{k}" not in BACKEND_COUNTERS]
            counters = [(k, v) for k, v in numbers if whole_counter or f"{key}.{k}" in BACKEND_COUNTERS]
            if gauges:
                out.append(f"# TYPE {name} gauge")
                out += [f'{name}{{key="{_label(k)}"}} {v:g}' for k, v in gauges]
            if counters:
                out.append(f"# TYPE {_counter_name(name)} counter")
                out += [f'{_counter_name(name)}{{key="{_label(k)}"}} {v:g}' for k, v in counters]
    return out


def render(
    metrics: ServerMetrics,
    model_status: int,
    backend_status: Mapping[str, object],
    labels: Sequence[tuple[str, str]] = (),
    admission: tuple[int, int] | None = None,
) -> str:
    """`admission`: (generations admitted now, the limit), from runner.admission."""
    info = ",".join(f'{k}="{_label(v)}"' for k, v in labels)
    lines = [
        "# HELP rwkv_model_status 0 offline, 2 loading, 3 working",
        "# TYPE rwkv_model_status gauge",
        f"rwkv_model_status{{{info}}} {model_status}" if info else f"rwkv_model_status {model_status}",
        "# HELP rwkv_requests_total completion requests by route",
        "# TYPE rwkv_requests_total counter",
    ]
    lines += [f'rwkv_requests_total{{route="{_label(r)}"}} {n}' for r, n in sorted(metrics.requests.items())]
    lines += ["# HELP rwkv_request_errors_total error responses of completion routes by status", "# TYPE rwkv_request_errors_total counter"]
    lines += [f'rwkv_request_errors_total{{status="{s}"}} {n}' for s, n in sorted(metrics.errors.items())]
    lines += [
        "# TYPE rwkv_prompt_tokens_total counter",
        f"rwkv_prompt_tokens_total {metrics.prompt_tokens}",
        "# TYPE rwkv_completion_tokens_total counter",
        f"rwkv_completion_tokens_total {metrics.completion_tokens}",
    ]
    lines += ["# HELP rwkv_http_responses_total every answer by HTTP status (401 refused passwords, 429 full queue, ...)", "# TYPE rwkv_http_responses_total counter"]
    lines += [f'rwkv_http_responses_total{{status="{s}"}} {n}' for s, n in sorted(metrics.responses.items())]
    lines += metrics.time_to_first_token.lines("rwkv_time_to_first_token_seconds", "request start to first generated text")
    lines += metrics.inter_token.lines("rwkv_inter_token_seconds", "time between generated tokens, per streamed delta")
    lines += ["# HELP rwkv_request_duration_seconds request start to the end of its answer, by route", "# TYPE rwkv_request_duration_seconds histogram"]
    for route, histogram in sorted(metrics.request_duration.items()):
        lines += histogram.samples("rwkv_request_duration_seconds", f'route="{_label(route)}"')
    if admission is not None:
        lines += [
            "# HELP rwkv_admitted_generations generations running or queued (runner.admission)",
            "# TYPE rwkv_admitted_generations gauge",
            f"rwkv_admitted_generations {admission[0]}",
            "# HELP rwkv_admission_limit slots plus --max-queued-requests; past it requests get 429",
            "# TYPE rwkv_admission_limit gauge",
            f"rwkv_admission_limit {admission[1]}",
        ]
    lines += backend_metrics(backend_status)
    return "\n".join(lines) + "\n"
