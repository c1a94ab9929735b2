"""`random:<shape>` model specs: benchmarks serve random weights of a real shape without writing a
checkpoint file; backends that do not know the spec refuse it with their reason."""

from __future__ import annotations

from fastapi.testclient import TestClient

from runner_fakes import make_app, settings_with


def test_albatross_serves_a_random_model_spec_over_http() -> None:
    with TestClient(make_app(settings_with(max_tokens=64))) as client:
        switched = client.post("/switch-model", json={"model": "random:2x128", "strategy": "albatross workers=1 batch=2"})
        assert switched.status_code == 200, switched.text
        reply = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
        client.post("/switch-model", json={"model": "", "strategy": ""})


def test_classic_backend_refuses_a_random_model_spec_with_a_load_error() -> None:
    with TestClient(make_app(settings_with())) as client:
        switched = client.post("/switch-model", json={"model": "random:2x128", "strategy": "cpu fp32"})
    assert switched.status_code == 500, switched.text
    assert "failed to load" in switched.json()["error"]["message"]
