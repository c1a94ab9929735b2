"""RWKV-Runner's and other clients' request details, route by route, on a scripted backend: CORS and
the origin guard, model paths, refused switches, the Runner's chat template and stops, conRWKV's and
OpenAI's extra fields, /file-to-text. The bodies are the ones the clients send (their sources are
cited where a body is built)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from runner.context import app_context
from runner.prompts import DEFAULT_CHAT_STOPS, ChatNames, ChatTurn, ToolCall, chat_stops, runner_chat_template
from runner.stop_echo import StopStringEcho
from runner_fakes import ScriptedBackend, install_backend, make_app, settings_with, sse_payloads

WAILS_ORIGINS = ("http://wails.localhost", "wails://wails")


@pytest.fixture
def backend() -> ScriptedBackend:
    return ScriptedBackend(["Hel", "lo"])


@pytest.fixture
def app(tmp_path: Path, backend: ScriptedBackend) -> FastAPI:
    (tmp_path / "alpha.pth").write_bytes(b"weights")
    return make_app(settings_with(models_dir=tmp_path), backend)


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as test_client:
        yield test_client


def last_prompt(backend: ScriptedBackend) -> str:
    return backend.decode(backend.requests[-1].prompt_tokens)


# ---- CORS and the origin guard -------------------------------------------------------------------


def preflight(client: TestClient, path: str, origin: str) -> object:
    return client.options(path, headers={"Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})


@pytest.mark.parametrize("origin", [*WAILS_ORIGINS, "http://localhost:5173", "http://127.0.0.1:8000", "http://[::1]:3000", "http://localhost"])
def test_the_desktop_shell_and_local_pages_pass_preflight_and_requests_by_default(client: TestClient, origin: str) -> None:
    for path in ("/switch-model", "/update-config", "/v1/chat/completions"):
        answer = preflight(client, path, origin)
        assert answer.status_code == 200, (path, answer.text)
        assert answer.headers["access-control-allow-origin"] == origin
        assert "POST" in answer.headers["access-control-allow-methods"]
    reply = client.post("/update-config", json={"top_p": 0.5}, headers={"Origin": origin})
    assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == origin


@pytest.mark.parametrize("content_type", ["application/json", "text/plain"])
def test_a_foreign_page_can_neither_read_nor_act(client: TestClient, app: FastAPI, content_type: str) -> None:
    """A text/plain POST is a "simple" request that browsers send without a preflight: refusing it
    here is what stops a web page from switching or stopping a local server."""
    evil = "http://evil.example"
    assert preflight(client, "/switch-model", evil).headers.get("access-control-allow-origin") is None
    body = json.dumps({"model": "", "strategy": ""})
    refused = client.post("/switch-model", content=body, headers={"Origin": evil, "Content-Type": content_type})
    assert refused.status_code == 403 and "--cors-origins" in refused.json()["error"]["message"]
    assert "access-control-allow-origin" not in refused.headers
    assert client.post("/exit", headers={"Origin": evil}).status_code == 403
    assert app_context(app).manager.backend is not None, "the model must still be loaded"


def test_a_page_served_by_this_server_is_same_origin(client: TestClient) -> None:
    reply = client.post("/update-config", json={"top_k": 2}, headers={"Origin": "http://testserver", "Host": "testserver"})
    assert reply.status_code == 200


@pytest.mark.parametrize(("flag", "origin", "allowed"), [("https://chat.example", "https://chat.example", True), ("*", "https://any.example", True), ("https://chat.example", "https://other.example", False)])
def test_cors_origins_adds_origins_and_star_allows_all(tmp_path: Path, flag: str, origin: str, allowed: bool) -> None:
    with TestClient(make_app(settings_with(models_dir=tmp_path, cors_origins=(flag,)), ScriptedBackend())) as client:
        answer = preflight(client, "/v1/chat/completions", origin)
        assert (answer.headers.get("access-control-allow-origin") is not None) is allowed
        status = client.post("/update-config", json={"top_k": 1}, headers={"Origin": origin}).status_code
        assert status == (200 if allowed else 403)
        assert preflight(client, "/switch-model", "wails://wails").status_code == 200, "the desktop shell stays allowed"


def test_the_preflight_is_answered_before_the_password_check(tmp_path: Path) -> None:
    with TestClient(make_app(settings_with(models_dir=tmp_path, password="pw"), ScriptedBackend())) as client:
        assert preflight(client, "/switch-model", "http://wails.localhost").status_code == 200
        refused = client.post("/update-config", json={}, headers={"Origin": "http://wails.localhost"})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "http://wails.localhost"


# ---- model paths and refused switches -----------------------------------------------------------


def test_a_relative_model_path_is_found_in_the_working_directory_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner_root, models_dir = tmp_path / "runner", tmp_path / "elsewhere"
    (runner_root / "models").mkdir(parents=True)
    models_dir.mkdir()
    (runner_root / "models" / "gui.pth").write_bytes(b"weights")
    (models_dir / "flag.pth").write_bytes(b"weights")
    monkeypatch.chdir(runner_root)
    with TestClient(make_app(settings_with(models_dir=models_dir))) as client:
        # RWKV-Runner's RunButton.tsx: `${customModelsPath}/${modelName}` with customModelsPath "./models"
        assert client.post("/switch-model", json={"model": "./models/gui.pth", "strategy": "fake"}).status_code == 200
        assert client.get("/status").json()["model_path"] == str(runner_root / "models" / "gui.pth")
        assert client.post("/switch-model", json={"model": "flag", "strategy": "fake"}).status_code == 200
        missing = client.post("/switch-model", json={"model": "./models/absent.pth", "strategy": "fake"})
        message = missing.json()["error"]["message"]
        assert missing.status_code == 404
        assert str(runner_root / "models" / "absent.pth") in message and str(models_dir / "models" / "absent.pth") in message
        assert client.get("/status").json()["model"] == "flag", "a refused switch keeps the old model"


def test_model_path_at_start_is_resolved_like_the_guis_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "start.pth").write_bytes(b"weights")
    monkeypatch.chdir(tmp_path)
    settings = settings_with(model_path="./models/start", strategy="fake", models_dir=tmp_path / "elsewhere")
    with TestClient(make_app(settings)) as client:
        assert client.get("/status").json()["model_path"] == str(tmp_path / "models" / "start.pth")


@pytest.mark.parametrize(
    ("body", "status", "param", "mentions"),
    [
        ({"model": "alpha", "strategy": "cpu fp32"}, 400, "model", "not a loadable RWKV-7 checkpoint"),
        ({"model": "alpha", "strategy": "cpu int4"}, 400, "strategy", "valid strategies"),
        ({"model": "alpha", "strategy": "tpu"}, 400, "strategy", "first word"),
        ({"model": "missing", "strategy": "cpu fp32"}, 404, "model", "looked for"),
        # Found by fuzzing /switch-model (tests/test_route_fuzz.py): both were a 500.
        ({"model": "~0", "strategy": "cpu fp32"}, 404, "model", "looked for"),  # no user "0" to expand
        ({"model": "m" * 5000, "strategy": "cpu fp32"}, 404, "model", "(5002 characters)"),  # ENAMETOOLONG
        # On the CPU: more workers than cores (999 once took the process down for memory), and
        # more host memory than the machine has (a batch of 10^8 state slots).
        ({"model": "random:tiny", "strategy": "albatross workers=999 device=cpu"}, 400, "strategy", "CPU workers"),
        ({"model": "random:tiny", "strategy": "albatross batch=100000000 device=cpu"}, 400, "strategy", "GB of host memory"),
    ],
)
def test_a_switch_that_cannot_succeed_is_refused_while_the_old_model_keeps_serving(
    client: TestClient, app: FastAPI, body: dict, status: int, param: str, mentions: str
) -> None:
    """Issue 11 #10: the old model used to be unloaded first, leaving the server with none."""
    refused = client.post("/switch-model", json=body)
    assert refused.status_code == status and refused.json()["error"]["param"] == param
    assert mentions in refused.json()["error"]["message"]
    assert client.get("/status").json()["status"] == 3
    assert client.post("/v1/completions", json={"prompt": "x"}).json()["choices"][0]["text"] == "Hello"


# ---- /update-config as RunButton.tsx sends it -----------------------------------------------------


def test_update_config_takes_the_runners_body_and_global_penalty_reaches_the_jobs(client: TestClient, backend: ScriptedBackend) -> None:
    # RunButton.tsx updateConfig(...) with a state-less config (stateModel "" is the "None" option)
    body = {"max_tokens": 100000, "temperature": 1, "top_p": 0.3, "presence_penalty": 0, "frequency_penalty": 1, "penalty_decay": 0.996, "global_penalty": True, "state": ""}
    assert client.post("/update-config", json=body).json() == "success"
    client.post("/v1/completions", json={"prompt": "a,b"})
    request = backend.requests[-1]
    assert request.sampling.max_tokens == 100000
    assert request.penalized_prompt_ids == [ord("a"), ord("b")], "',' is one of the Runner's unpenalized characters"
    client.post("/v1/completions", json={"prompt": "ab", "global_penalty": False})
    assert backend.requests[-1].penalized_prompt_ids == []


def test_max_tokens_accepts_the_guis_whole_range_and_the_cap_is_named(client: TestClient, tmp_path: Path) -> None:
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 102400}).status_code == 200
    with TestClient(make_app(settings_with(models_dir=tmp_path, max_tokens=1000), ScriptedBackend())) as capped:
        refused = capped.post("/update-config", json={"max_tokens": 1001})
        assert refused.status_code == 400 and "--max-tokens" in refused.json()["error"]["message"]


def test_a_state_file_on_a_backend_without_state_support_is_a_clear_400(client: TestClient, tmp_path: Path) -> None:
    import torch

    torch.save({"blocks.0.att.time_state": torch.zeros(1, 64, 64)}, tmp_path / "s.pth")
    refused = client.post("/update-config", json={"state": str(tmp_path / "s.pth")})
    assert refused.status_code == 400 and "does not support state files" in refused.json()["error"]["message"]


# ---- the Runner's chat template ---------------------------------------------------------------


def test_a_preset_chat_with_deepthink_gives_the_runners_prompt(client: TestClient, backend: ScriptedBackend) -> None:
    # Chat.tsx onSubmit: the preset's and the conversation's messages, then DeepThink's open
    # assistant turn, with the preset's names and presystem.
    body = {
        "messages": [
            {"role": "system", "content": "You are Alice, a cheerful guide."},
            {"role": "user", "content": "Who are you?"},
            {"role": "assistant", "content": "I am Alice."},
            {"role": "user", "content": "Tell me a joke."},
            {"role": "assistant", "content": "<think>", "prefix": True},
        ],
        "stream": True,
        "model": "rwkv",
        "max_tokens": 1000,
        "temperature": 1,
        "top_p": 0.3,
        "presence_penalty": 0,
        "frequency_penalty": 1,
        "user_name": "Bob",
        "assistant_name": "Alice",
        "presystem": True,
    }
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert last_prompt(backend) == (
        "Bob: hi\n\nAlice: Hi. I am your assistant and I will provide expert full response in full details. "
        "Please feel free to ask any question and I will always answer it.\n\n"
        "System: You are Alice, a cheerful guide.\n\nBob: Who are you?\n\nAlice: I am Alice.\n\n"
        "Bob: Tell me a joke.\n\nAlice: <think>"
    )
    # The scripted tokenizer is one byte per token: the names' first tokens are "B" and "A".
    assert backend.requests[-1].sampling.stop == (*DEFAULT_CHAT_STOPS, "\n\nB")


def test_system_name_quick_think_and_raw_follow_the_runner(client: TestClient, backend: ScriptedBackend) -> None:
    messages = [
        {"role": "system", "content": "Rules.", "raw": True},
        {"role": "user", "content": "Hi\r\n\r\nthere", "raw": False},
        {"role": "assistant", "content": "<think>\n</think>", "prefix": True},
    ]
    client.post("/v1/chat/completions", json={"messages": messages, "system_name": "Narrator"})
    # RWKV-5+ template: contents verbatim (raw only mattered to the Runner's RWKV-4 template).
    assert last_prompt(backend) == "Narrator: Rules.\n\nUser: Hi\r\n\r\nthere\n\nAssistant: <think>\n</think>"


def test_tool_calls_and_tool_results_in_the_history_render_as_the_runner_renders_them(client: TestClient, backend: ScriptedBackend) -> None:
    # Chat.tsx: a tool call turn is an assistant message with empty content and tool_calls, then
    # a tool message with the configured return value.
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "content": "22", "tool_call_id": "call_abc"},
    ]
    assert client.post("/v1/chat/completions", json={"messages": messages}).status_code == 200
    assert last_prompt(backend) == (
        'User: Weather in Paris?\n\nAssistant: get_weather\n```python\ntool_call("city"="Paris", "unit"="C")\n```\n\n'
        "Observation: 22\n\nAssistant:"
    )
    bad = [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]
    refused = client.post("/v1/chat/completions", json={"messages": bad})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages.0.tool_calls.0.function.arguments"


def test_with_tools_offered_earlier_calls_read_in_the_tools_templates_form(client: TestClient, backend: ScriptedBackend) -> None:
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "-3", "tool_call_id": "c1"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    client.post("/v1/chat/completions", json={"messages": messages, "tools": [weather]})
    prompt = last_prompt(backend)
    assert 'Assistant: <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n\nObservation: -3\n\n' in prompt
    assert "tool_call(" not in prompt


def test_a_client_stop_adds_to_the_name_stops_instead_of_replacing_them(client: TestClient, backend: ScriptedBackend) -> None:
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stop": "END", "user_name": "Zed"})
    assert backend.requests[-1].sampling.stop == ("END", "\n\nZ", "\n\nA")
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stop": []})
    assert backend.requests[-1].sampling.stop == ("\n\nU", "\n\nA")


def test_name_stops_use_the_first_token_of_each_name_with_the_world_tokenizer() -> None:
    from albatross.tokenizer import get_tokenizer

    tokenizer = get_tokenizer()
    stops = chat_stops(None, ChatNames(), tokenizer.encode, tokenizer.decode)
    assert stops == (*DEFAULT_CHAT_STOPS, "\n\nAss"), "'Assistant' is two World tokens, 'Ass' + 'istant' (the Runner stops at the first)"
    custom = chat_stops(["###"], ChatNames(user="小明", assistant="Bob"), tokenizer.encode, tokenizer.decode)
    assert custom == ("###", "\n\n小", "\n\nBob")


def test_add_generation_prompt_false_leaves_the_assistant_header_off() -> None:
    turns = [ChatTurn("user", "Hi")]
    assert runner_chat_template(turns) == "User: Hi\n\nAssistant:"
    assert runner_chat_template(turns, add_generation_prompt=False) == "User: Hi\n\n"
    assert runner_chat_template([ChatTurn("assistant", None, ToolCall("f", {}))]) == "Assistant: f\n```python\ntool_call()\n```\n\nAssistant:"
    assert runner_chat_template([ChatTurn("assistant", "<think>", prefix=True), ChatTurn("user", "x")]).startswith("Assistant: <think>\n\n")


# ---- conRWKV (vLLM) and OpenAI details -------------------------------------------------------


def test_a_prompt_instead_of_messages_on_the_chat_route_is_a_text_completion(client: TestClient, backend: ScriptedBackend) -> None:
    # conRWKV's /v1/chat/completions: `prompt` without `messages` is used as it is
    reply = client.post("/v1/chat/completions", json={"model": "rwkv", "prompt": "Once upon", "max_completion_tokens": 1}).json()
    assert reply["object"] == "text_completion" and reply["choices"][0]["text"] == "Hel"
    assert last_prompt(backend) == "Once upon"


def test_ignore_eos_drops_the_end_of_text_stop(client: TestClient, backend: ScriptedBackend) -> None:
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "ignore_eos": True})
    assert backend.requests[-1].sampling.stop_token_ids == ()
    client.post("/v1/completions", json={"prompt": "x", "ignore_eos": True, "stop_token_ids": [0, 7]})
    assert backend.requests[-1].sampling.stop_token_ids == (7,)


def test_n_null_is_one_choice_and_openai_v1_completions_exists(client: TestClient) -> None:
    for path in ("/v1/completions", "/openai/v1/completions"):
        reply = client.post(path, json={"prompt": "x", "n": None, "max_completion_tokens": 1}).json()
        assert [c["text"] for c in reply["choices"]] == ["Hel"], path
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "n": None}).json()
    assert len(chat["choices"]) == 1


def test_stop_string_echo_finds_the_stop_that_completed_first() -> None:
    echo = StopStringEcho(["\n\nUser", "\n\nU", "END"], lambda ids: "".join(chr(i) for i in ids))
    from runner.interface import GenerationEvent

    first = echo(0, GenerationEvent(text="Hi", token_ids=[ord(c) for c in "Hi\n"]))
    last = echo(0, GenerationEvent(text="", token_ids=[ord(c) for c in "\nUser: more"], finish_reason="stop"))
    assert (first.text, last.text) == ("Hi", "\n\nU")
    length = echo(1, GenerationEvent(text="abc", token_ids=[97, 98, 99], finish_reason="length"))
    assert length.text == "abc"


# ---- /file-to-text -----------------------------------------------------------------------------


def test_file_to_text_reads_a_txt_upload_as_the_gui_sends_it(client: TestClient) -> None:
    # Chat.tsx: POST /file-to-text?file_name=<name> with FormData file_data = the file's blob
    text = "第一行\nsecond line\n"
    reply = client.post("/file-to-text", params={"file_name": "notes.txt"}, files={"file_data": ("notes.txt", text.encode(), "text/plain")})
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"pages": [{"page_content": text, "metadata": {"source": "notes.txt"}}]}
    gbk = client.post("/file-to-text", data={"file_name": "a.txt", "file_encoding": "gbk"}, files={"file_data": ("a.txt", "汉字".encode("gbk"))})
    assert gbk.json()["pages"][0]["page_content"] == "汉字"


@pytest.mark.parametrize(
    ("files", "params", "status", "param"),
    [
        ({"file_data": ("a.docx", b"PK..")}, {}, 400, "file_name"),
        ({"file_data": ("a.txt", b"\xff\xfe\xfa")}, {}, 400, "file_encoding"),
        ({"file_data": ("a.pdf", b"not a pdf")}, {}, 400, "file_data"),
        ({"other": ("a.txt", b"x")}, {}, 422, "file_data"),
        ({"file_data": ("a.txt", b"x")}, {"file_encoding": "no-such-codec"}, 422, "file_encoding"),
        ({"file_data": ("a.txt", b"x")}, {"file_encoding": "utf-8\x00"}, 422, "file_encoding"),  # was a 500 (fuzz)
    ],
)
def test_file_to_text_refuses_what_it_cannot_read(client: TestClient, files: dict, params: dict, status: int, param: str) -> None:
    reply = client.post("/file-to-text", params=params, files=files)
    assert reply.status_code == status and reply.json()["error"]["param"] == param


def test_file_to_text_is_bounded_by_the_body_limit(tmp_path: Path) -> None:
    with TestClient(make_app(settings_with(models_dir=tmp_path, max_body_bytes=1024))) as client:
        reply = client.post("/file-to-text", files={"file_data": ("big.txt", b"x" * 4096)})
        assert reply.status_code == 413 and "--max-body-bytes" in reply.json()["error"]["message"]


def test_a_stream_from_the_gui_origin_carries_the_cors_header(client: TestClient) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
    reply = client.post("/v1/chat/completions", json=body, headers={"Origin": "wails://wails"})
    assert reply.headers["access-control-allow-origin"] == "wails://wails"
    assert sse_payloads(reply.text)[-1] == "[DONE]"


def test_status_reports_the_device_the_backend_runs_on_not_the_strategys_guess(app: FastAPI, client: TestClient) -> None:
    class CpuAlbatross(ScriptedBackend):
        def status(self) -> dict[str, object]:
            return {"device": "cpu", "worker_num": 1}

    install_backend(app, CpuAlbatross(), strategy="albatross device=cpu")
    status = client.get("/status").json()
    assert status["device_name"] == "CPU" and isinstance(status["gpu_available"], bool)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_password_counts_whatever_the_content_type_says(tmp_path: Path, content_type: str | None) -> None:
    """curl -d sends form-urlencoded, some clients text/plain or nothing: the body is JSON anyway."""
    headers = {} if content_type is None else {"Content-Type": content_type}
    with TestClient(make_app(settings_with(models_dir=tmp_path, password="pw"), ScriptedBackend(["ok"]))) as client:
        body = json.dumps({"prompt": "x", "password": "pw", "n": None})
        reply = client.post("/v1/completions", content=body, headers=headers)
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "ok", reply.text
        assert client.post("/update-config", content=json.dumps({"top_k": 2, "password": "pw"}), headers=headers).status_code == 200
        assert client.post("/update-config", content=json.dumps({"top_k": 2, "password": "no"}), headers=headers).status_code == 401


def test_an_upload_authenticates_with_the_bearer_header(tmp_path: Path) -> None:
    with TestClient(make_app(settings_with(models_dir=tmp_path, password="pw"))) as client:
        files = {"file_data": ("a.txt", b"hello")}
        assert client.post("/file-to-text", files=files).status_code == 401
        reply = client.post("/file-to-text", files=files, headers={"Authorization": "Bearer pw"})
        assert reply.status_code == 200 and reply.json()["pages"][0]["page_content"] == "hello"
