"""`random:<shape>` model specs: benchmarks serve random weights of a real shape without writing a
checkpoint file; backends that do not know the spec refuse it with their reason."""

from __future__ import annotations

from fastapi.testclient import TestClient

from runner_fakes import make_app, settings_with


def test_albatross_serves_a_random_model_spec_over_http() -> None:
    greedy = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "stop_token_ids": []}
    with TestClient(make_app(settings_with(max_tokens=64))) as client:
        try:
            switched = client.post("/switch-model", json={"model": "random:2x128", "strategy": "albatross workers=1 batch=2"})
            assert switched.status_code == 200, switched.text
            status = client.get("/status").json()
            assert (status["backend"], status["model"]) == ("albatross", "random-2x128")
            first, again = (client.post("/v1/completions", json=greedy) for _ in range(2))
            assert first.status_code == 200, first.text
            assert first.json()["usage"] == {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}
            assert first.json()["choices"][0]["finish_reason"] == "length"
            assert again.json()["choices"] == first.json()["choices"], "the same random weights answer greedy requests the same"
        finally:
            client.post("/switch-model", json={"model": "", "strategy": ""})


def test_classic_backend_refuses_a_random_model_spec_before_loading() -> None:
    with TestClient(make_app(settings_with())) as client:
        switched = client.post("/switch-model", json={"model": "random:2x128", "strategy": "cpu fp32"})
    assert switched.status_code == 400, switched.text
    error = switched.json()["error"]
    assert error["param"] == "model" and "needs an albatross strategy" in error["message"]
