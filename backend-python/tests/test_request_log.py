"""Operations: one log line per finished request, quiet polls, JSON logs, Prometheus conventions."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from runner.request_log import JsonFormatter
from runner_fakes import ScriptedBackend, make_app, settings_with

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def app() -> FastAPI:
    return make_app(settings_with(password="pw"), ScriptedBackend(["a", "b", "c"]))


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app, headers={"Authorization": "Bearer pw"}) as test_client:
        yield test_client


def request_lines(caplog: pytest.LogCaptureFixture, level: int = logging.INFO) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "runner.requests" and r.levelno >= level]


def test_a_finished_request_is_one_line_with_its_id_route_status_tokens_ttft_duration_and_finish(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="runner.requests")
    reply = client.post("/v1/chat/completions", json={"messages": HI})
    assert reply.status_code == 200
    [line] = request_lines(caplog)
    fields = line.fields  # type: ignore[attr-defined]
    assert fields["request_id"] == reply.headers["x-request-id"]
    assert (fields["method"], fields["path"], fields["route"], fields["status"]) == ("POST", "/v1/chat/completions", "/v1/chat/completions", 200)
    assert fields["completion_tokens"] == 3 and fields["prompt_tokens"] > 0 and fields["finish_reason"] == "stop"
    assert fields["ttft_s"] is not None and fields["duration_s"] >= fields["ttft_s"]
    message = line.getMessage()
    for part in (reply.headers["x-request-id"], "POST /v1/chat/completions 200", "completion=3", "finish=stop", "ttft=", "duration="):
        assert part in message, message


def test_a_stream_is_logged_once_when_it_ends(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="runner.requests")
    with client.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True, "n": 2}) as reply:
        assert reply.read().endswith(b"data: [DONE]\n\n")
    [line] = request_lines(caplog)
    assert line.fields["completion_tokens"] == 6 and line.fields["finish_reason"] == "stopx2"  # type: ignore[attr-defined]


def test_refusals_are_logged_and_a_client_request_id_is_kept(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="runner.requests")
    refused = client.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer wrong", "X-Request-Id": "trace-42"})
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "trace-42"
    bad = client.post("/v1/completions", json={"prompt": "x", "top_p": 7})
    assert bad.status_code == 422
    lines = request_lines(caplog)
    assert [(r.fields["status"], r.fields["finish_reason"]) for r in lines] == [(401, "-"), (422, "-")]  # type: ignore[attr-defined]
    assert lines[0].fields["request_id"] == "trace-42"  # type: ignore[attr-defined]


def test_status_polls_are_not_logged_at_info_level(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="runner.requests")
    for _ in range(3):
        assert client.get("/status").status_code == 200
    assert client.get("/healthz").status_code == 200
    assert request_lines(caplog, logging.INFO) == []
    assert len(request_lines(caplog, logging.DEBUG)) == 4


def test_json_log_lines_carry_the_request_fields() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("runner.requests")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with TestClient(make_app(backend=ScriptedBackend(["a"]))) as client:
            client.post("/v1/completions", json={"prompt": "x"})
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    [entry] = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert entry["level"] == "info" and entry["logger"] == "runner.requests" and entry["status"] == 200
    assert entry["completion_tokens"] == 1 and entry["finish_reason"] == "stop" and entry["message"].startswith("request ")


def test_model_load_switch_and_unload_are_logged(client: TestClient, caplog: pytest.LogCaptureFixture, tmp_path: object) -> None:
    caplog.set_level(logging.INFO, logger="runner.model_manager")
    assert client.post("/switch-model", json={"model": "random:tiny", "strategy": "fake"}).status_code == 200
    assert client.post("/switch-model", json={"model": "random:other", "strategy": "fake"}).status_code == 200
    assert client.post("/switch-model", json={"model": "", "strategy": "fake"}).status_code == 200
    messages = [r.getMessage() for r in caplog.records if r.name == "runner.model_manager"]
    assert any(m.startswith("loading random:tiny") for m in messages), messages
    assert any(m.startswith("loading random:other") and "replacing random:tiny" in m for m in messages), messages
    assert any(m.startswith("loaded random:other") for m in messages), messages
    assert any(m.startswith("unloaded random:other") for m in messages), messages


def families(client: TestClient) -> dict[str, object]:
    text = client.get("/metrics").text
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_metrics_follow_prometheus_conventions_and_count_refusals(client: TestClient) -> None:
    client.post("/v1/completions", json={"prompt": "x"})
    client.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer wrong"})
    found = families(client)
    for name, family in found.items():
        kind = family.type  # type: ignore[attr-defined]
        if kind == "counter":
            # the parser drops the _total suffix from a counter family's name; every sample keeps it
            assert all(s.name.endswith("_total") for s in family.samples), name  # type: ignore[attr-defined]
        assert kind in ("counter", "gauge", "histogram"), (name, kind)
    responses = {s.labels["status"]: s.value for s in found["rwkv_http_responses"].samples}  # type: ignore[attr-defined]
    assert responses["401"] == 1 and responses["200"] >= 1
    duration = found["rwkv_request_duration_seconds"]
    assert duration.type == "histogram"  # type: ignore[attr-defined]
    counts = {s.labels["route"]: s.value for s in duration.samples if s.name.endswith("_count")}  # type: ignore[attr-defined]
    assert counts["/v1/completions"] == 2
    assert found["rwkv_time_to_first_token_seconds"].type == "histogram"  # type: ignore[attr-defined]
    assert found["rwkv_inter_token_seconds"].type == "histogram"  # type: ignore[attr-defined]


def test_cumulative_backend_fields_are_counters_and_the_rest_gauges() -> None:
    from runner.metrics import ServerMetrics, render

    status = {"active_slots": 3, "steps": 10, "generated_tokens_total": 50, "requests_finished": {"stop": 2}, "state_cache": {"l1_hits": 4, "l1_entries": 1}}
    found = {f.name: f for f in text_string_to_metric_families(render(ServerMetrics(), 3, status))}
    assert found["rwkv_backend_active_slots"].type == "gauge"
    assert found["rwkv_backend_steps"].type == "counter" and found["rwkv_backend_generated_tokens"].type == "counter"
    assert [s.name for s in found["rwkv_backend_requests_finished"].samples] == ["rwkv_backend_requests_finished_total"]
    assert found["rwkv_backend_state_cache"].type in ("counter", "gauge")
    text = render(ServerMetrics(), 3, status)
    assert 'rwkv_backend_state_cache{key="l1_entries"} 1' in text and 'rwkv_backend_state_cache_total{key="l1_hits"} 4' in text
