"""RWKV-Runner's GUI (v1.9.11) against this server with its default flags, end to end on a tiny
random RWKV-7 model: the desktop Run flow from the shell's web origin, a preset chat with DeepThink
and a state-tuned file, each against the official `rwkv` package's greedy output; /file-to-text
with a .txt and a .pdf; state files that do not fit.

The request bodies are the GUI's (frontend/src/components/RunButton.tsx: updateConfig and
switchModel; frontend/src/pages/Chat.tsx: the chat body and the attachment upload), with the
values a person would have set; `test_the_guis_request_fields_are_the_ones_replayed_here` checks
the field names against the mirrored sources when they are present.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from albatross.tokenizer import get_tokenizer
from pdf_builder import text_pdf
from runner.app import create_app
from runner.classic_backend import rwkv_model_module
from runner.prompts import DEFAULT_CHAT_STOPS
from runner_fakes import settings_with, sse_payloads

RUNNER_MIRROR = Path(os.environ.get("RUNNER_MIRROR", "/work/.mirror/josStorer+RWKV-Runner/repo"))
SHELL = {"Origin": "http://wails.localhost"}  # the desktop shell's web view on Windows
GUI_STRATEGY = "albatross workers=1 batch=960"  # utils/index.tsx getStrategy: CUDA High Performance, the defaults
# Compared with the package's CPU fp32 run: on a GPU machine the engine must stay on the CPU too.
STRATEGIES = [GUI_STRATEGY + " device=cpu", "cpu fp32"]
MODEL = "./models/rwkv7-tiny.pth"  # RunButton.tsx: `${customModelsPath}/${modelName}`, customModelsPath "./models"
N_LAYER, N_HEAD, HEAD_SIZE = 2, 2, 64  # the tiny checkpoint (conftest.py)


def update_config_body(state: str = "", global_penalty: bool = False, max_tokens: int = 100000) -> dict[str, Any]:
    """RunButton.tsx updateConfig(t, {...}): apiParameters of a config (defaultConfigs.ts values)."""
    return {
        "max_tokens": max_tokens,
        "temperature": 1,
        "top_p": 0.3,
        "presence_penalty": 0,
        "frequency_penalty": 1,
        "penalty_decay": 0.996,
        "global_penalty": global_penalty,
        "state": state,
    }


def switch_model_body(strategy: str) -> dict[str, Any]:
    """RunButton.tsx switchModel({...}): no custom tokenizer (undefined is left out by JSON)."""
    return {"model": MODEL, "strategy": strategy, "customCuda": False, "deploy": False}


def chat_body(messages: list[dict[str, Any]], **preset: Any) -> dict[str, Any]:
    """Chat.tsx onSubmit's body with greedy chat params (tools undefined, penalty_decay at its
    default is undefined: both left out)."""
    return {
        "messages": messages,
        "stream": True,
        "model": "rwkv",
        "max_tokens": 24,
        "temperature": 0,
        "top_p": 0.3,
        "presence_penalty": 0,
        "frequency_penalty": 0,
        **preset,
    }


def random_time_state(n_layer: int, n_head: int, head_size: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"blocks.{i}.att.time_state": torch.randn(n_head, head_size, head_size, generator=generator) * 0.5 for i in range(n_layer)}


@pytest.fixture(scope="module")
def runner_root(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """RWKV-Runner's folder layout, as the backend's working directory (the GUI starts it there)."""
    root = tmp_path_factory.mktemp("RWKV-Runner")
    (root / "models").mkdir()
    (root / "state-models").mkdir()
    shutil.copy(tiny_checkpoint, root / "models" / "rwkv7-tiny.pth")
    torch.save(random_time_state(N_LAYER, N_HEAD, HEAD_SIZE, seed=5), root / "state-models" / "tuned.pth")
    torch.save(random_time_state(N_LAYER + 1, N_HEAD, HEAD_SIZE, seed=6), root / "state-models" / "three-layers.pth")
    torch.save(random_time_state(N_LAYER, N_HEAD * 2, HEAD_SIZE // 2, seed=7), root / "state-models" / "narrow-heads.pth")
    shutil.copy(tiny_checkpoint, root / "state-models" / "a-model-not-a-state.pth")
    (root / "state-models" / "notes.txt").write_text("not a state")
    previous = Path.cwd()
    os.chdir(root)
    try:
        yield root
    finally:
        os.chdir(previous)


@pytest.fixture(scope="module")
def server(runner_root: Path) -> Iterator[TestClient]:
    """The server as the GUI starts it: default flags (no --cors-origins, no --models-dir)."""
    with TestClient(create_app(settings_with(state_cache_path=runner_root / "states.sqlite3"))) as client:
        yield client


def load(client: TestClient, strategy: str) -> None:
    reply = client.post("/switch-model", json=switch_model_body(strategy), headers=SHELL)
    assert reply.status_code == 200, reply.text


# ---- the official package's greedy reference ----------------------------------------------------


_PACKAGE: dict[str, Any] = {}


def package_model(root: Path) -> Any:
    if "model" not in _PACKAGE:
        _PACKAGE["model"] = rwkv_model_module().RWKV(model=str(root / "models" / "rwkv7-tiny"), strategy="cpu fp32")
    return _PACKAGE["model"]


def package_state(time_state: dict[str, torch.Tensor] | None) -> list[torch.Tensor] | None:
    if time_state is None:
        return None
    state: list[torch.Tensor] = []
    for i in range(N_LAYER):
        state += [torch.zeros(N_HEAD * HEAD_SIZE), time_state[f"blocks.{i}.att.time_state"].float().clone(), torch.zeros(N_HEAD * HEAD_SIZE)]
    return state


def package_greedy_text(root: Path, prompt: str, steps: int, stops: tuple[str, ...], time_state: dict[str, torch.Tensor] | None = None, penalized: list[int] | None = None) -> str:
    """The package's greedy continuation (ending at token 0 or `steps`), cut at the stop string
    that completes first, as the server cuts it. `penalized`: the prompt ids that global_penalty
    counts, applied by the definition: each generated or counted id t adds `frequency` plus
    `presence` on first use, and every penalty decays after each id (presence 0, frequency 1,
    decay 0.996 here)."""
    tokenizer = get_tokenizer()
    model = package_model(root)
    logits, state = model.forward(tokenizer.encode(prompt), package_state(time_state))
    penalties: dict[int, float] = {}

    def count(token: int) -> None:
        for key in penalties:
            penalties[key] *= 0.996
        penalties[token] = penalties.get(token, 0.0) + 1.0

    for token in penalized or []:
        count(token)
    produced: list[int] = []
    for _ in range(steps):
        adjusted = logits.float().clone()
        for key, value in penalties.items():
            adjusted[key] -= value
        token = int(torch.argmax(adjusted))
        if token == 0:
            break
        produced.append(token)
        if penalized is not None:
            count(token)
        logits, state = model.forward([token], state)
    text = tokenizer.decode_bytes(produced).decode("utf-8", errors="replace")
    matches = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    return text[: min(matches)[1]] if matches else text


def streamed_text(reply: Any) -> str:
    assert reply.status_code == 200, reply.text
    chunks = [json.loads(p) for p in sse_payloads(reply.text) if p != "[DONE]"]
    assert not any("error" in c for c in chunks), chunks
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))


# ---- the Run flow ---------------------------------------------------------------------------------


def test_the_desktop_run_flow_from_the_shells_origin_with_default_flags(server: TestClient) -> None:
    # readRoot, getStatus, then updateConfig and switchModel, each preflighted by the web view
    root = server.get("/", headers=SHELL)
    assert root.status_code == 200 and root.headers["access-control-allow-origin"] == SHELL["Origin"]
    assert server.get("/status", headers=SHELL).status_code == 200
    for path in ("/update-config", "/switch-model"):
        answer = server.options(path, headers={**SHELL, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == SHELL["Origin"], path
    configured = server.post("/update-config", json=update_config_body(), headers=SHELL)
    assert configured.status_code == 200 and configured.json() == "success", configured.text
    load(server, GUI_STRATEGY)
    status = server.get("/status", headers=SHELL).json()
    assert (status["status"], status["backend"], status["model"]) == (3, "albatross", "rwkv7-tiny")
    runs_on = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    assert status["effective"]["batch_size"] == 960 and status["device_name"] == runs_on
    reply = server.post("/v1/chat/completions", json=chat_body([{"role": "user", "content": "Hello!"}], max_tokens=8), headers=SHELL)
    assert reply.headers["access-control-allow-origin"] == SHELL["Origin"]
    assert len(streamed_text(reply)) >= 0 and sse_payloads(reply.text)[-1] == "[DONE]"


# ---- a preset chat with DeepThink --------------------------------------------------------------


PRESET_MESSAGES = [
    {"role": "system", "content": "Alice is a friendly guide who answers briefly."},
    {"role": "user", "content": "Hi Alice!"},
    {"role": "assistant", "content": "Hello Bob, how can I help?"},
    {"role": "user", "content": "Tell me about albatrosses."},
]
PRESET = {"user_name": "Bob", "assistant_name": "Alice", "presystem": True}
DEEPTHINK_PROMPT = (
    "Bob: hi\n\nAlice: Hi. I am your assistant and I will provide expert full response in full details. "
    "Please feel free to ask any question and I will always answer it.\n\n"
    "System: Alice is a friendly guide who answers briefly.\n\nBob: Hi Alice!\n\nAlice: Hello Bob, how can I help?\n\n"
    "Bob: Tell me about albatrosses.\n\nAlice: <think>"
)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_preset_chat_with_deepthink_equals_the_packages_greedy_output_on_the_runners_template(server: TestClient, runner_root: Path, strategy: str) -> None:
    load(server, strategy)
    server.post("/update-config", json=update_config_body(), headers=SHELL)
    deepthink = {"role": "assistant", "content": "<think>", "prefix": True}  # Chat.tsx, DeepThink on
    got = streamed_text(server.post("/v1/chat/completions", json=chat_body([*PRESET_MESSAGES, deepthink], **PRESET), headers=SHELL))
    stops = (*DEFAULT_CHAT_STOPS, "\n\nBob", "\n\nAlice")  # the names are one World token each
    expected = package_greedy_text(runner_root, DEEPTHINK_PROMPT, 24, stops)
    assert got == expected, f"{strategy}: {got!r} != the package's {expected!r}"


# ---- state-tuned files -----------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_state_tuned_file_equals_the_package_run_from_that_state_until_it_is_cleared(server: TestClient, runner_root: Path, strategy: str) -> None:
    load(server, strategy)
    tuned = torch.load(runner_root / "state-models" / "tuned.pth")
    prompt = "User: Write one line about the sea.\n\nAssistant:"
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "presence_penalty": 0, "frequency_penalty": 0}

    def complete() -> str:
        reply = server.post("/v1/completions", json=body, headers=SHELL)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"]

    plain = package_greedy_text(runner_root, prompt, 16, ())
    with_state = package_greedy_text(runner_root, prompt, 16, (), tuned)
    assert plain != with_state, "the test state must change the output"
    assert complete() == plain
    # startup.ts lists state files as 'state-models/<name>', relative to the runner's root
    assert server.post("/update-config", json=update_config_body(state="state-models/tuned.pth"), headers=SHELL).json() == "success"
    assert server.get("/status").json()["state"] == str(runner_root / "state-models" / "tuned.pth")
    assert complete() == with_state and complete() == with_state, "the second run may hit the prefix cache: same text"
    assert server.post("/update-config", json=update_config_body(state=""), headers=SHELL).json() == "success"
    assert complete() == plain, "after clearing, no cached state made from the file may be used"
    server.post("/update-config", json=update_config_body(state="state-models/tuned.pth"), headers=SHELL)
    assert complete() == with_state
    server.post("/update-config", json=update_config_body(state=""), headers=SHELL)


@pytest.mark.parametrize(
    ("state", "status", "text"),
    [
        ("state-models/three-layers.pth", 400, "state shape mismatch"),
        ("state-models/narrow-heads.pth", 400, "state shape mismatch"),
        ("state-models/a-model-not-a-state.pth", 400, "file format of the model or state model not supported"),
        ("state-models/notes.txt", 400, "file format of the model or state model not supported"),
        ("state-models/absent.pth", 404, "state file not found"),
    ],
)
def test_a_state_file_that_does_not_fit_is_refused_with_the_text_the_gui_matches(server: TestClient, runner_root: Path, state: str, status: int, text: str) -> None:
    load(server, STRATEGIES[0])
    server.post("/update-config", json=update_config_body(state="state-models/tuned.pth"), headers=SHELL)
    refused = server.post("/update-config", json=update_config_body(state=state), headers=SHELL)
    assert refused.status_code == status and text in refused.text, refused.text  # RunButton.tsx: error.includes(...)
    assert refused.json()["error"]["param"] == "state"
    assert server.get("/status").json()["state"] == str(runner_root / "state-models" / "tuned.pth"), "the previous state file stays"
    server.post("/update-config", json=update_config_body(state=""), headers=SHELL)


def test_a_state_file_sent_before_the_model_loads_applies_to_it(server: TestClient, runner_root: Path) -> None:
    """The GUI sends updateConfig without waiting, while switchModel is still loading."""
    server.post("/switch-model", json={"model": "", "strategy": ""})
    assert server.post("/update-config", json=update_config_body(state="state-models/tuned.pth"), headers=SHELL).json() == "success"
    load(server, "cpu fp32")
    prompt = "User: hi\n\nAssistant:"
    reply = server.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "frequency_penalty": 0}).json()
    tuned = torch.load(runner_root / "state-models" / "tuned.pth")
    assert reply["choices"][0]["text"] == package_greedy_text(runner_root, prompt, 8, (), tuned)
    server.post("/update-config", json=update_config_body(state=""))


# ---- global_penalty ----------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_global_penalty_counts_the_prompts_tokens_from_the_first_sampled_token(server: TestClient, runner_root: Path, strategy: str) -> None:
    load(server, strategy)
    server.post("/update-config", json=update_config_body(global_penalty=True), headers=SHELL)
    prompt = "the sea the sea the sea, the albatross glides over the sea"
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "presence_penalty": 0, "frequency_penalty": 1, "penalty_decay": 0.996}
    got = server.post("/v1/completions", json=body).json()["choices"][0]["text"]
    tokenizer = get_tokenizer()
    exempt = {tokenizer.encode(c)[0] for c in '\n,.:?!，。：？！"“”<>[]{}/\\|;；~`@#$%^&*()_+-=0123456789 ' if len(tokenizer.encode(c)) == 1}
    penalized = [t for t in tokenizer.encode(prompt) if t not in exempt]
    assert got == package_greedy_text(runner_root, prompt, 12, (), penalized=penalized)
    without = server.post("/v1/completions", json={**body, "global_penalty": False}).json()["choices"][0]["text"]
    assert without == package_greedy_text(runner_root, prompt, 12, (), penalized=[]), "global_penalty off: generated tokens only"
    server.post("/update-config", json=update_config_body(global_penalty=False))


# ---- include_stop_str_in_output on a real tokenizer ----------------------------------------------


def test_include_stop_str_in_output_keeps_the_matched_stop(server: TestClient) -> None:
    load(server, "cpu fp32")
    body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "frequency_penalty": 0}
    full = server.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), f"pick a visible stop from {full!r}"
    cut = server.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    kept = server.post("/v1/completions", json={**body, "stop": [stop], "include_stop_str_in_output": True}).json()["choices"][0]
    assert cut["finish_reason"] == kept["finish_reason"] == "stop"
    assert kept["text"] == cut["text"] + stop and full.startswith(kept["text"])


# ---- /file-to-text ----------------------------------------------------------------------------------


def test_file_to_text_with_a_txt_and_a_pdf_as_the_attachment_button_sends_them(server: TestClient) -> None:
    txt = server.post("/file-to-text?file_name=notes.txt", files={"file_data": ("notes.txt", b"line one\nline two\n", "text/plain")}, headers=SHELL)
    assert txt.status_code == 200 and txt.json()["pages"] == [{"page_content": "line one\nline two\n", "metadata": {"source": "notes.txt"}}]
    pdf = server.post("/file-to-text?file_name=report.pdf", files={"file_data": ("report.pdf", text_pdf(["First page", "Second page"], "Report"), "application/pdf")}, headers=SHELL)
    assert pdf.status_code == 200, pdf.text
    pages = pdf.json()["pages"]
    assert [p["page_content"] for p in pages] == ["First page", "Second page"]
    assert pages[1]["metadata"] == {"source": "report.pdf", "file_path": "report.pdf", "page": 1, "total_pages": 2, "Title": "Report"}


# ---- the GUI's sources -----------------------------------------------------------------------------


def test_the_guis_request_fields_are_the_ones_replayed_here() -> None:
    if not RUNNER_MIRROR.is_dir() or shutil.which("git") is None:
        pytest.skip(f"the RWKV-Runner mirror is not here ({RUNNER_MIRROR})")

    def source(path: str) -> str:
        return subprocess.run(["git", "-C", str(RUNNER_MIRROR), "show", f"HEAD:{path}"], capture_output=True, text=True, check=True).stdout

    def keys_of_call(text: str, call: str) -> set[str]:
        """The top-level keys of the first object literal after `call`."""
        at = text.index("{", text.index(call))
        depth, keys = 0, set()
        for line in text[at:].splitlines():
            if depth == 1 and (match := re.match(r"\s*(\w+):", line)):
                keys.add(match.group(1))
            depth += line.count("{") - line.count("}")
            if depth <= 0:
                return keys
        raise AssertionError(f"no object literal after {call!r}")

    run_button = source("frontend/src/components/RunButton.tsx")
    assert keys_of_call(run_button, "updateConfig(\n") == set(update_config_body())
    assert keys_of_call(run_button, "switchModel(\n") == {"model", "strategy", "tokenizer", "customCuda", "deploy"}
    chat = source("frontend/src/pages/Chat.tsx")
    chat_keys = keys_of_call(chat, "body: JSON.stringify({")
    assert {"stream", "model", "max_tokens", "temperature", "top_p", "presence_penalty", "frequency_penalty", "user_name", "assistant_name", "presystem"} <= chat_keys
    assert "content: '<think>',\n          prefix: true" in chat, "DeepThink's open assistant turn"
    assert "`/file-to-text?file_name=${attachmentName}`" in chat and "bodyForm.append('file_data'" in chat


def test_the_guis_polling_and_requests_log_no_warning(server: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    load(server, GUI_STRATEGY)
    deepthink = {"role": "assistant", "content": "<think>", "prefix": True}
    with caplog.at_level("WARNING"):
        for _ in range(2):
            server.get("/status", headers=SHELL)
            server.post("/update-config", json=update_config_body(), headers=SHELL)
            streamed_text(server.post("/v1/chat/completions", json=chat_body([*PRESET_MESSAGES, deepthink], **PRESET, max_tokens=4), headers=SHELL))
    assert [r.getMessage() for r in caplog.records if r.levelname in ("WARNING", "ERROR")] == []
