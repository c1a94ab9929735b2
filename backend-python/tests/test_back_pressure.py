"""Back-pressure: past the slots plus --max-queued-requests a request gets 429 with Retry-After (in
OpenAI's rate-limit shape), counted in /metrics; a queued request whose client left never takes a
slot; every place in the count comes back however a request ends."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator

import httpx
import openai
import pytest

from runner.interface import AbstractRWKV, GenerationEvent, GenerationRequest
from runner_fakes import live_server, make_app, settings_with

HI = [{"role": "user", "content": "Hi"}]


class GatedBackend(AbstractRWKV):
    """A concurrent backend with `slots` slots whose generations wait for `gate` (set by the test)."""

    backend_name = "gated"
    concurrent = True
    name = "gated-model"

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.gate = asyncio.Event()
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop the generations wait on
        self.started: list[str] = []
        self.closed: list[str] = []

    def generation_slots(self) -> int:
        return self.slots

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: list[int]) -> str:
        return bytes(token_ids).decode()

    def generate(self, request: GenerationRequest) -> Iterator[GenerationEvent]:
        raise NotImplementedError

    async def async_generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        self.loop = asyncio.get_running_loop()
        self.started.append(request.request_id)
        try:
            await self.gate.wait()
            yield GenerationEvent(text="ok", token_ids=[1], completion_tokens=1, prompt_tokens=len(request.prompt_tokens))
            yield GenerationEvent(finish_reason="stop", completion_tokens=1, prompt_tokens=len(request.prompt_tokens))
        finally:
            self.closed.append(request.request_id)


def run(coroutine: object) -> object:
    return asyncio.run(coroutine)  # type: ignore[arg-type]


async def settle(predicate: object, rounds: int = 1000) -> None:
    """Yield to the loop until `predicate()` holds (the requests under test run on this loop)."""
    for _ in range(rounds):
        if predicate():  # type: ignore[operator]
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


def test_past_slots_plus_queue_a_request_gets_429_with_retry_after_in_openais_shape() -> None:
    backend = GatedBackend(slots=2)
    app = make_app(settings_with(max_queued_requests=1), backend)
    context = app.state.context

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            held = [asyncio.create_task(client.post("/v1/completions", json={"prompt": f"p{i}"})) for i in range(3)]
            await settle(lambda: context.admission.in_flight == 3)
            refused = await client.post("/v1/chat/completions", json={"messages": HI})
            assert refused.status_code == 429, refused.text
            assert refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert (error["type"], error["code"], error["param"]) == ("requests", "rate_limit_exceeded", None)
            assert "--max-queued-requests" in error["message"]
            native = await client.post("/v2/chat/completions", json={"contents": ["a"]})
            assert native.status_code == 429
            backend.gate.set()
            replies = await asyncio.gather(*held)
            assert [r.status_code for r in replies] == [200, 200, 200]
            assert context.admission.in_flight == 0
            again = await client.post("/v1/chat/completions", json={"messages": HI})
            assert again.status_code == 200
            metrics = (await client.get("/metrics")).text
            assert 'rwkv_http_responses_total{status="429"} 2' in metrics.splitlines()
            assert "rwkv_admitted_generations 0" in metrics.splitlines() and "rwkv_admission_limit 3" in metrics.splitlines()

    run(scenario())


def test_a_request_larger_than_the_limit_runs_when_nothing_else_does() -> None:
    backend = GatedBackend(slots=1)
    backend.gate.set()
    app = make_app(settings_with(max_queued_requests=0), backend)

    async def scenario() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            reply = await client.post("/v2/chat/completions", json={"contents": ["a", "b", "c"]})
            assert reply.status_code == 200 and len(reply.json()["choices"]) == 3
        assert app.state.context.admission.in_flight == 0

    run(scenario())


def test_the_default_queue_is_four_generations_per_slot() -> None:
    from runner.admission import Admission

    admission = Admission()
    tickets = [admission.admit(1, slots=3) for _ in range(15)]
    with pytest.raises(Exception) as refused:
        admission.admit(1, slots=3)
    assert getattr(refused.value, "status_code", None) == 429
    for ticket in tickets:
        ticket.release()
        ticket.release()  # twice is harmless
    assert admission.in_flight == 0


def test_refused_and_failed_requests_give_their_places_back() -> None:
    backend = GatedBackend(slots=1)
    backend.gate.set()
    app = make_app(settings_with(max_queued_requests=0, max_prompt_tokens=4), backend)

    async def scenario() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            too_long = await client.post("/v1/completions", json={"prompt": "much too long"})
            assert too_long.status_code == 400
            stream = await client.post("/v1/completions", json={"prompt": "ok", "stream": True})
            assert stream.status_code == 200 and stream.text.endswith("data: [DONE]\n\n")
            native_too_long = await client.post("/v2/chat/completions", json={"contents": ["much too long"]})
            assert native_too_long.status_code == 400
        assert app.state.context.admission.in_flight == 0

    run(scenario())


def test_the_openai_client_sees_a_rate_limit_error() -> None:
    backend = GatedBackend(slots=1)
    app = make_app(settings_with(max_queued_requests=0), backend)
    with live_server(app) as base_url:
        holder = httpx.Client(base_url=base_url, timeout=60)
        result: list[int] = []
        thread = threading.Thread(target=lambda: result.append(holder.post("/v1/completions", json={"prompt": "x"}).status_code))
        thread.start()
        try:
            for _ in range(2000):
                if backend.started:
                    break
                threading.Event().wait(0.01)
            client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)
            with pytest.raises(openai.RateLimitError) as error:
                client.chat.completions.create(model="x", messages=HI)  # type: ignore[arg-type]
            assert error.value.code == "rate_limit_exceeded"
            assert error.value.response.headers["retry-after"] == "1"
        finally:
            assert backend.loop is not None
            backend.loop.call_soon_threadsafe(backend.gate.set)
            thread.join(timeout=30)
    assert result == [200]


def test_a_queued_request_whose_client_left_is_closed_before_it_starts_generating() -> None:
    """The driver listens for the disconnect while it waits for the first event, and closes the
    backend's iterator: on the engine that aborts the task while it still waits for a slot."""
    backend = GatedBackend(slots=1)
    app = make_app(settings_with(), backend)
    disconnected = asyncio.Event()

    async def scenario() -> None:
        body = json.dumps({"prompt": "x"}).encode()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, object]:
            if messages:
                return messages.pop(0)
            await disconnected.wait()
            return {"type": "http.disconnect"}

        sent: list[dict[str, object]] = []

        async def send(message: dict[str, object]) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "",
                 "query_string": b"", "headers": [(b"content-type", b"application/json")], "http_version": "1.1",
                 "scheme": "http", "server": ("test", 80), "client": ("c", 1), "asgi": {"version": "3.0"}, "state": {}}
        call = asyncio.create_task(app(scope, receive, send))
        await settle(lambda: backend.started)
        disconnected.set()
        await asyncio.wait_for(call, timeout=30)
        assert backend.closed == backend.started, "the waiting generation was closed"
        assert app.state.context.admission.in_flight == 0

    run(scenario())


def test_a_short_prompt_goes_from_encoding_to_the_backend_without_yielding_to_the_loop() -> None:
    """In a burst every request's handler is queued on the loop at once, and a request that yields
    between parsing and the backend waits there for all the others (session 26: the first of 960
    reached the engine 1.2 s after the clients sent). A short prompt is encoded on the loop and the
    request handed to the backend in the same go: a callback queued while it is encoded runs after."""
    backend = GatedBackend(slots=4)
    app = make_app(settings_with(), backend)
    order: list[str] = []

    def encode(text: str) -> list[int]:
        asyncio.get_running_loop().call_soon(order.append, "a callback queued meanwhile")  # raises off the loop
        return list(text.encode())

    async def recorded(request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        order.append("submitted")
        async for event in GatedBackend.async_generate(backend, request):
            yield event

    backend.encode = encode  # type: ignore[method-assign]
    backend.async_generate = recorded  # type: ignore[method-assign]

    async def scenario() -> None:
        body = json.dumps({"prompt": "x", "stream": True}).encode()
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        disconnected = asyncio.Event()

        async def receive() -> dict[str, object]:
            if messages:
                return messages.pop(0)
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, object]) -> None:
            pass

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "",
                 "query_string": b"", "headers": [(b"content-type", b"application/json")], "http_version": "1.1",
                 "scheme": "http", "server": ("test", 80), "client": ("c", 1), "asgi": {"version": "3.0"}, "state": {}}  # fmt: skip
        call = asyncio.create_task(app(scope, receive, send))
        await settle(lambda: backend.started and len(order) == 2)
        backend.gate.set()
        disconnected.set()
        await asyncio.wait_for(call, timeout=30)

    run(scenario())
    assert order == ["submitted", "a callback queued meanwhile"], order
