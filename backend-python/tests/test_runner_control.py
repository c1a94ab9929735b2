"""Runner control routes over HTTP: status, switching, config, exit, model lists, embeddings,
profile counters and Prometheus metrics."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from runner.context import app_context
from runner_fakes import ScriptedBackend, install_backend, make_app, settings_with


@pytest.fixture
def models_dir(tmp_path: Path) -> Path:
    (tmp_path / "alpha.pth").write_bytes(b"a" * 10)
    (tmp_path / "nested").mkdir()
    (tmp_path / "nested" / "beta.pth").write_bytes(b"b" * 20)
    (tmp_path / "notes.txt").write_text("not a model")
    return tmp_path


@pytest.fixture
def app(models_dir: Path) -> FastAPI:
    return make_app(settings_with(models_dir=models_dir))


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as test_client:
        yield test_client


def test_status_reports_offline_then_the_loaded_model_and_its_effective_values(client: TestClient) -> None:
    offline = client.get("/status").json()
    assert (offline["status"], offline["pid"], offline["backend"], offline["effective"]) == (0, os.getpid(), None, {})
    assert client.post("/switch-model", json={"model": "alpha", "strategy": "fake"}).json() == "success"
    working = client.get("/status").json()
    assert (working["status"], working["backend"], working["strategy"], working["model"]) == (3, "scripted", "fake", "alpha")
    assert working["effective"]["worker_num"] == 1 and working["effective"]["batch_size"] == 4
    assert working["device_name"] == "CPU"


def test_switch_model_unloads_with_an_empty_model(client: TestClient) -> None:
    client.post("/switch-model", json={"model": "nested/beta.pth", "strategy": "fake"})
    assert client.post("/switch-model", json={"model": "", "strategy": ""}).json() == "success"
    assert client.get("/status").json()["status"] == 0


@pytest.mark.parametrize(
    ("body", "status", "mentions"),
    [
        ({"model": "alpha.gguf", "strategy": "fake"}, 400, ".gguf"),
        ({"model": "alpha", "strategy": "tpu fp8"}, 400, "albatross, chirrup, cpu, cuda"),
        ({"model": "missing", "strategy": "fake"}, 404, "missing"),
        ({"model": "alpha", "strategy": "fake explode"}, 500, "failed to load: the scripted load failed"),
    ],
)
def test_switch_model_errors(client: TestClient, body: dict, status: int, mentions: str) -> None:
    response = client.post("/switch-model", json=body)
    assert response.status_code == status and mentions in response.json()["error"]["message"]


def test_switch_model_answers_304_while_a_load_is_in_progress(app: FastAPI, client: TestClient) -> None:
    from runner.model_manager import ModelStatus

    app_context(app).manager.status = ModelStatus.LOADING
    response = client.post("/switch-model", json={"model": "alpha", "strategy": "fake"})
    assert response.status_code == 304 and response.content == b""


def test_deploy_mode_refuses_switch_and_exit(models_dir: Path) -> None:
    with TestClient(make_app(settings_with(models_dir=models_dir, deploy=True))) as client:
        assert client.post("/switch-model", json={"model": "alpha", "strategy": "fake"}).status_code == 403
        assert client.post("/exit", json={}).status_code == 403


def test_a_switch_with_deploy_true_turns_deploy_mode_on(client: TestClient) -> None:
    assert client.post("/switch-model", json={"model": "alpha", "strategy": "fake", "deploy": True}).status_code == 200
    assert client.post("/switch-model", json={"model": "alpha", "strategy": "fake"}).status_code == 403


def test_exit_shuts_the_backend_down_and_asks_the_server_to_stop(app: FastAPI, client: TestClient) -> None:
    backend = ScriptedBackend()
    install_backend(app, backend)
    stops: list[bool] = []
    app_context(app).request_exit = lambda: stops.append(True)
    assert client.post("/exit", json={}).json() == "success"
    assert backend.shutdown_calls == 1 and stops == [True]
    assert client.get("/status").json()["status"] == 0


def test_update_config_refuses_a_state_file_it_cannot_find_naming_every_place_looked(client: TestClient, models_dir: Path) -> None:
    refused = client.post("/update-config", json={"state": "state-models/absent.pth"})
    error = refused.json()["error"]
    assert refused.status_code == 404 and error["param"] == "state"
    assert str(Path.cwd() / "state-models" / "absent.pth") in error["message"]
    assert str(models_dir / "state-models" / "absent.pth") in error["message"]
    assert client.post("/update-config", json={"global_penalty": True, "top_k": 3, "state": ""}).json() == "success"


def test_model_lists_show_the_loaded_checkpoint_stem_then_the_runners_openai_names(app: FastAPI, client: TestClient) -> None:
    offline = client.get("/v1/models").json()
    assert [m["id"] for m in offline["data"]] == ["rwkv", "gpt-3.5-turbo", "text-davinci-003"]
    client.post("/switch-model", json={"model": "alpha", "strategy": "fake"})
    for path in ("/v1/models", "/models", "/openai/v1/models"):
        listing = client.get(path).json()
        assert [(m["id"], m["object"]) for m in listing["data"]] == [("alpha", "model"), ("gpt-3.5-turbo", "model"), ("text-davinci-003", "model")], path
        assert listing["data"][0] == {"id": "alpha", "object": "model", "created": listing["data"][0]["created"], "owned_by": "rwkv", "root": "alpha", "parent": None}
        assert isinstance(listing["data"][0]["created"], int)
    assert client.get("/v1/models/alpha").json()["id"] == "alpha"
    assert client.get("/models/rwkv-7-world").json()["id"] == "alpha", "the Runner answers any id naming rwkv with the loaded model"
    assert client.get("/v1/models/gpt-3.5-turbo").json()["owned_by"] == "openai"
    missing = client.get("/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "The model 'other' does not exist"


def test_credit_grants_answer_the_runners_fixed_grant(client: TestClient) -> None:
    grants = client.get("/dashboard/billing/credit_grants").json()
    assert (grants["object"], grants["total_available"], grants["grants"]["data"][0]["object"]) == ("credit_summary", 10000, "credit_grant")


def test_local_models_lists_checkpoints_under_the_models_dir(client: TestClient) -> None:
    listing = client.get("/local-models").json()["models"]
    assert listing == [
        {"name": "alpha", "path": "alpha.pth", "size_bytes": 10},
        {"name": "beta", "path": str(Path("nested") / "beta.pth"), "size_bytes": 20},
    ]
    for entry in listing:
        assert client.post("/switch-model", json={"model": entry["path"], "strategy": "fake"}).status_code == 200


@pytest.mark.parametrize("loaded", [False, True])
def test_embeddings_are_one_clear_400_on_every_route_with_or_without_a_model(app: FastAPI, client: TestClient, loaded: bool) -> None:
    if loaded:
        install_backend(app, ScriptedBackend())
    paths = ("/v1/embeddings", "/embeddings", "/openai/v1/embeddings", "/v1/engines/text-embedding-ada-002/embeddings")
    # The OpenAI Node SDK asks for base64 by default; the Runner's GUI and Python SDK for floats.
    for body in ({"input": "hello", "model": "rwkv", "encoding_format": "base64"}, {"input": ["a", "b"]}, {"input": [[1, 2]]}):
        for path in paths:
            response = client.post(path, json=body)
            assert response.status_code == 400, (path, body)
            assert response.json()["error"]["message"].startswith("embeddings are not supported: RWKV-7")
    assert client.post("/v1/embeddings", json={"input": 3}).status_code == 422, "an invalid body is still named"


def test_profile_answers_the_runners_fields_even_when_disabled(client: TestClient) -> None:
    profile = client.get("/albatross/profile").json()
    runner_fields = ("requests", "stream_requests", "tokens", "stream_chunks", "bytes", "completion_wait_ms",
                     "disconnect_check_ms", "json_dump_ms", "yield_resume_ms", "request_wall_ms")
    assert set(runner_fields) <= set(profile) and profile["enabled"] is False
    assert all(profile[name] == 0 for name in runner_fields)


def test_profile_counts_requests_tokens_and_chunks_and_resets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALBATROSS_PROFILE", "1")
    with TestClient(make_app(backend=ScriptedBackend(["a", "b", "c"]))) as client:
        client.post("/v1/completions", json={"prompt": "x"})
        client.post("/v1/completions", json={"prompt": "x", "stream": True})
        profile = client.get("/albatross/profile").json()
        assert profile["enabled"] is True
        assert (profile["requests"], profile["stream_requests"], profile["tokens"]) == (2, 1, 6)
        assert profile["stream_chunks"] == 4 and profile["bytes"] > 0  # 3 deltas + the finish chunk
        assert profile["completion_wait_ms"] >= 0.0 and profile["request_wall_ms"] > 0.0
        assert client.get("/albatross/profile", params={"reset": "true"}).json()["requests"] == 2
        assert client.get("/albatross/profile").json()["requests"] == 0
        client.post("/v1/completions", json={"prompt": "x"})
        assert client.post("/albatross/profile/reset").json() == {"success": True}
        assert client.get("/albatross/profile").json()["requests"] == 0


def test_metrics_expose_counters_histograms_and_backend_gauges(app: FastAPI, client: TestClient) -> None:
    install_backend(app, ScriptedBackend(["a", "b"]))
    client.post("/v1/completions", json={"prompt": "xyz"})
    client.post("/v1/completions", json={"prompt": "xyz", "max_tokens": 10**9})
    text = client.get("/metrics").text
    lines = set(text.splitlines())
    assert 'rwkv_requests_total{route="/v1/completions"} 2' in lines
    assert 'rwkv_request_errors_total{status="400"} 1' in lines
    assert "rwkv_prompt_tokens_total 3" in lines and "rwkv_completion_tokens_total 2" in lines
    assert "rwkv_time_to_first_token_seconds_count 1" in lines and "rwkv_inter_token_seconds_count 1" in lines
    assert "rwkv_backend_batch_size 4" in lines and 'rwkv_backend_cache_hits{key="l1"} 2' in lines
