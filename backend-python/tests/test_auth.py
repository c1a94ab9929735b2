"""With --password, every route refuses a missing or wrong password (401 JSON), whoever added it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import APIRouter, FastAPI
from fastapi.routing import iter_route_contexts
from fastapi.testclient import TestClient

from runner_fakes import ScriptedBackend, make_app, settings_with

PASSWORD = "s3cret-password"
OPEN_ROUTES = {("GET", "/"), ("GET", "/healthz"), ("GET", "/readyz")}


def every_route(app: FastAPI) -> list[tuple[str, str]]:
    """(method, concrete path) of every API route, path parameters filled in."""
    found: list[tuple[str, str]] = []
    for route in iter_route_contexts(app.routes):
        methods = route.methods or set()
        path = route.path
        if path is None:
            continue
        concrete = re.sub(r"\{[^}]+\}", "x", path)
        found += [(method, concrete) for method in sorted(methods - {"HEAD"})]
    return found


@pytest.fixture
def app() -> FastAPI:
    return make_app(settings_with(password=PASSWORD), ScriptedBackend(["ok"]))


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as test_client:
        yield test_client


def assert_refused(response_status: int, body: dict, what: str) -> None:
    assert response_status == 401, f"{what}: expected 401, got {response_status} {body}"
    assert body["error"]["type"] == "authentication_error", f"{what}: {body}"


def test_every_route_refuses_a_missing_or_wrong_password(app: FastAPI, client: TestClient) -> None:
    routes = [r for r in every_route(app) if r not in OPEN_ROUTES]
    assert ("POST", "/v1/chat/completions") in routes and ("GET", "/status") in routes, routes
    for method, path in routes:
        body = {"messages": [{"role": "user", "content": "Hi"}], "prompt": "x", "model": "", "strategy": "cpu fp32"}
        missing = client.request(method, path, json=body if method != "GET" else None)
        assert_refused(missing.status_code, missing.json(), f"{method} {path} without a password")
        wrong = client.request(method, path, json=body if method != "GET" else None, headers={"Authorization": "Bearer nope"})
        assert_refused(wrong.status_code, wrong.json(), f"{method} {path} with a wrong bearer")
        if method != "GET":
            wrong_field = client.request(method, path, json={**body, "password": "nope"})
            assert_refused(wrong_field.status_code, wrong_field.json(), f"{method} {path} with a wrong password field")


def test_a_router_added_after_the_app_was_built_is_protected_too(app: FastAPI) -> None:
    late = APIRouter()

    @late.get("/late-addition")
    async def late_addition() -> dict[str, str]:
        return {"ok": "yes"}

    app.include_router(late)
    with TestClient(app) as client:
        assert client.get("/late-addition").status_code == 401
        assert client.get("/late-addition", headers={"Authorization": f"Bearer {PASSWORD}"}).json() == {"ok": "yes"}


def test_liveness_routes_stay_open(client: TestClient) -> None:
    assert client.get("/").json() == {"Hello": "World!"}
    assert client.get("/healthz").status_code == 200


def test_the_bearer_header_or_the_password_field_lets_a_request_through(client: TestClient) -> None:
    assert client.get("/status", headers={"Authorization": f"Bearer {PASSWORD}"}).status_code == 200
    body = {"prompt": "x", "password": PASSWORD}
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "ok"


def test_without_a_password_flag_nothing_asks_for_one() -> None:
    with TestClient(make_app(backend=ScriptedBackend(["ok"]))) as client:
        assert client.get("/status").status_code == 200
        assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 200


def test_web_gui_files_are_open_but_the_api_beside_them_is_not(tmp_path: Path) -> None:
    (tmp_path / "index.html").write_text("<html>gui</html>")
    (tmp_path / "app.js").write_text("console.log('gui')")
    app = make_app(settings_with(password=PASSWORD, webui=True, webui_dir=tmp_path), ScriptedBackend(["ok"]))
    with TestClient(app) as client:
        assert "gui" in client.get("/").text
        assert client.get("/app.js").status_code == 200
        assert client.get("/status").status_code == 401
        assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 401


@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", None])
def test_a_password_field_counts_whatever_the_content_type(client: TestClient, content_type: str | None) -> None:
    """Bodies are read as JSON whatever the Content-Type (browsers' simple requests send text/plain)."""
    headers = {"Content-Type": content_type} if content_type else {}
    body = json.dumps({"prompt": "x", "password": PASSWORD})
    reply = client.post("/v1/completions", content=body, headers=headers)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == "ok"
    wrong = client.post("/v1/completions", content=json.dumps({"prompt": "x", "password": "nope"}), headers=headers)
    assert_refused(wrong.status_code, wrong.json(), f"wrong password field with {content_type}")
