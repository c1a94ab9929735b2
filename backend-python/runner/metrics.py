"""Prometheus text exposition: counters and histograms measured in the routes, plus the numeric
fields of the loaded backend's `status()` as gauges (queue depth, active slots, step time, cache
hits per tier, ... whatever the backend reports)."""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

LATENCY_BUCKETS_S: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
INTER_TOKEN_BUCKETS_S: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
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
        out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts):
            cumulative += count
            out.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {self.total:.6f}")
        out.append(f"{name}_count {self.count}")
        return out


@dataclass(slots=True)
class ServerMetrics:
    requests: dict[str, int] = field(default_factory=dict)  # by route path
    errors: dict[int, int] = field(default_factory=dict)  # by HTTP status
    prompt_tokens: int = 0
    completion_tokens: int = 0
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS_S))
    inter_token: Histogram = field(default_factory=lambda: Histogram(INTER_TOKEN_BUCKETS_S))

    def count_request(self, route: str) -> None:
        self.requests[route] = self.requests.get(route, 0) + 1

    def count_error(self, status_code: int) -> None:
        self.errors[status_code] = self.errors.get(status_code, 0) + 1


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


def backend_gauges(status: Mapping[str, object]) -> list[str]:
    """Numbers become `rwkv_backend_<key>`; a dict of numbers becomes one gauge labelled by key."""
    out: list[str] = []
    for key in sorted(status):
        value = status[key]
        name = _metric_name("rwkv_backend", key)
        number = _number(value)
        if number is not None:
            out += [f"# TYPE {name} gauge", f"{name} {number:g}"]
        elif isinstance(value, Mapping):
            samples = [(str(k), _number(v)) for k, v in value.items()]
            samples = [(k, v) for k, v in samples if v is not None]
            if samples:
                out.append(f"# TYPE {name} gauge")
                out += [f'{name}{{key="{_label(k)}"}} {v:g}' for k, v in samples]
    return out


def render(metrics: ServerMetrics, model_status: int, backend_status: Mapping[str, object], labels: Sequence[tuple[str, str]] = ()) -> str:
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
    lines += metrics.time_to_first_token.lines("rwkv_time_to_first_token_seconds", "request start to first generated text")
    lines += metrics.inter_token.lines("rwkv_inter_token_seconds", "time between generated tokens, per streamed delta")
    lines += backend_gauges(backend_status)
    return "\n".join(lines) + "\n"
