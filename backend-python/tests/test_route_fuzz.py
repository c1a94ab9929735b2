"""Every route, fuzzed from the server's own OpenAPI document (schemathesis): bodies and parameters
that fit the schema and ones that break it, sent over HTTP to a live server serving a tiny
random-weight Albatross model. No answer may be a 5xx, every 4xx is a JSON error with a message,
and after the fuzz nothing is left admitted and a greedy request generates what it did before.

The examples are derandomized, so CI sends the same requests every run; FUZZ_EXAMPLES=200 (say)
searches further on a developer's machine. `max_tokens` (and `max_completion_tokens`) is held at
8: the fuzz is about what the server accepts and how it refuses, not about long generations
(runner.settings caps those).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")  # requirements-test.txt; absent on the GPU image
from hypothesis import HealthCheck, given, settings
from schemathesis.generation.modes import GenerationMode

from runner.app import create_app
from runner.settings import ServerSettings
from runner_fakes import live_server, settings_with

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "12"))
MAX_TOKENS = 8
# Routes left out of the shared server's fuzz, and why. /switch-model is fuzzed on a server of its
# own (it may unload the model every other case needs); /exit is not fuzzed (it ends the process).
LEFT_OUT = {
    "/exit": "ends the server process",
    "/switch-model": "fuzzed on a server of its own below",
}

_DOCUMENT = create_app(ServerSettings()).openapi()  # building the app loads no model
_OPERATION_LIST = [result.ok() for result in schemathesis.openapi.from_dict(_DOCUMENT).get_all_operations()]
_EVERY_OPERATION = {f"{op.method.upper()} {op.path}": op for op in _OPERATION_LIST}
OPERATIONS = {key: op for key, op in _EVERY_OPERATION.items() if op.path not in LEFT_OUT}  # the shared server's


def _breakable(raw: dict[str, Any]) -> bool:
    """A body or a query parameter to break (a free-text path segment cannot be broken)."""
    return "requestBody" in raw or any(parameter.get("in") != "path" for parameter in raw.get("parameters", ()))


BREAKABLE = sorted(key for key, op in OPERATIONS.items() if _breakable(op.definition.raw))


SWITCH = "POST /switch-model"


# A greedy completion with every sampling field given, so no default the fuzz sets through
# /update-config can change it: taken before the fuzz, compared after it.
GREEDY = {"prompt": "The albatross glides over the southern ocean", "max_tokens": 24, "temperature": 0, "top_p": 1,
          "presence_penalty": 0, "frequency_penalty": 0, "stop": [], "stop_token_ids": []}  # fmt: skip
_greedy_before: dict[str, str] = {}


def _greedy(base_url: str) -> str:
    reply = httpx.post(base_url + "/v1/completions", json=GREEDY, timeout=60)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["text"])


def _serve(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = settings_with(
        model_path=str(tiny_checkpoint),
        strategy="albatross workers=1 batch=8",
        models_dir=tiny_checkpoint.parent,
        state_cache_path=tmp_path_factory.mktemp("fuzz-states") / "states.sqlite3",
    )
    with live_server(create_app(config)) as base_url:
        deadline = time.monotonic() + 120
        while httpx.get(base_url + "/status", timeout=10).json().get("status") != 3:  # 3: working
            assert time.monotonic() < deadline, "the model did not load"
            time.sleep(0.2)
        _greedy_before[base_url] = _greedy(base_url)
        yield base_url


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _serve(tiny_checkpoint, tmp_path_factory)


@pytest.fixture(scope="module")
def own_server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _serve(tiny_checkpoint, tmp_path_factory)


def _above(value: Any, bound: int) -> bool:
    """A number past `bound`: pydantic takes 5019.0 for an int field, as JSON clients send it."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > bound


def _bounded(body: Any) -> None:
    if isinstance(body, dict):
        if not isinstance(body.get("max_tokens"), (int, float)) or _above(body["max_tokens"], MAX_TOKENS):
            body["max_tokens"] = MAX_TOKENS
        if _above(body.get("max_completion_tokens"), MAX_TOKENS):
            body["max_completion_tokens"] = MAX_TOKENS  # OpenAI's newer name wins over max_tokens
        for many in ("n", "best_of"):
            if _above(body.get(many), 4):
                body[many] = 4


def _header(response: Any, name: str) -> str:
    value = response.headers.get(name, "")
    return value[0] if isinstance(value, list) else str(value)


def _fuzz(server: str, key: str, mode: GenerationMode) -> None:
    operation = _EVERY_OPERATION[key]

    @given(case=operation.as_strategy(mode))
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    def answers_without_a_server_error(case: Any) -> None:
        _bounded(case.body)
        response = case.call(base_url=server, timeout=120)
        sent = f"{key} ({mode}) with body {json.dumps(case.body, default=str)[:600]}, query {case.query}, path {case.path_parameters}"
        assert response.status_code < 500, f"{response.status_code} {response.text[:500]!r}\nfor {sent}"
        if response.status_code >= 400:
            assert _header(response, "content-type").startswith("application/json"), f"a {response.status_code} that is not JSON for {sent}"
            error = json.loads(response.text).get("error")
            assert isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"], f"no error message: {response.text[:300]!r} for {sent}"

    answers_without_a_server_error()


@pytest.mark.parametrize("key", sorted(OPERATIONS))
def test_requests_that_fit_the_schema_get_no_server_error(server: str, key: str) -> None:
    _fuzz(server, key, GenerationMode.POSITIVE)


@pytest.mark.parametrize("key", BREAKABLE)
def test_requests_that_break_the_schema_get_a_json_4xx(server: str, key: str) -> None:
    _fuzz(server, key, GenerationMode.NEGATIVE)


def test_after_the_fuzz_nothing_is_left_admitted_and_a_greedy_reply_is_unchanged(server: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        metrics = httpx.get(server + "/metrics", timeout=10).text
        admitted = next(line for line in metrics.splitlines() if line.startswith("rwkv_admitted_generations"))
        if float(admitted.split()[-1]) == 0:
            break
        assert time.monotonic() < deadline, f"generations still admitted a minute after the fuzz: {admitted}"
        time.sleep(0.2)
    assert _greedy_before[server], "the greedy reference must have text"
    assert _greedy(server) == _greedy_before[server], "the fuzz changed what a greedy request generates"


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_switch_model_fuzzed_on_a_server_of_its_own(own_server: str, mode: GenerationMode) -> None:
    _fuzz(own_server, SWITCH, mode)


def test_every_route_is_fuzzed_or_left_out_with_a_reason() -> None:
    assert set(_DOCUMENT["paths"]) == {op.path for op in OPERATIONS.values()} | set(LEFT_OUT)
    assert SWITCH in _EVERY_OPERATION
    assert len(OPERATIONS) >= 30, sorted(OPERATIONS)
