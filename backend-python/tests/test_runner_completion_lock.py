"""One-at-a-time backends: requests wait for the completion lock in turn, and a request whose
client leaves while it waits gives up without ever reaching the backend."""

from __future__ import annotations

import time

import httpx
import pytest

from runner_fakes import ScriptedBackend, live_server, make_app, settings_with


def wait_for(condition, what: str) -> None:
    for _ in range(1000):  # the bound only guards a hang
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_waiting_request_whose_client_leaves_never_reaches_the_backend() -> None:
    backend = ScriptedBackend([f"t{i} " for i in range(100_000)], piece_delay_s=0.001)
    with live_server(make_app(settings_with(max_tokens=200_000), backend)) as base_url:
        holder = httpx.stream("POST", base_url + "/v1/completions", json={"prompt": "first", "stream": True, "max_tokens": 100_000})
        with holder as response:
            lines = response.iter_lines()  # keep the iterator: dropping it closes the connection
            next(lines)  # the first request holds the lock and is streaming
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(base_url + "/v1/completions", json={"prompt": "second", "max_tokens": 5}, timeout=0.5)
            time.sleep(1.0)  # several of the waiter's disconnect checks
        wait_for(lambda: backend.active == 0, "the first request to be aborted")
        after = httpx.post(base_url + "/v1/completions", json={"prompt": "third", "max_tokens": 3}, timeout=30)
    assert after.status_code == 200, after.text
    prompts = [bytes(r.prompt_tokens).decode() for r in backend.requests]
    assert prompts == ["first", "third"], f"the request whose client left must not run: {prompts}"
