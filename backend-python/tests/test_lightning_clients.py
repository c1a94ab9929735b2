"""rwkv_lightning's own clients, run unmodified from its sources against this server (the Albatross
engine on the CPU, a tiny random model, a state cache, a password): its `test/test_curl.sh` smoke
script (bash + curl, every request must answer 2xx) and the request functions of `webui_rwkv.py`
(the module without its Gradio page, `requests` talking to the live server).

The sources are read from the mirrored rwkv_lightning repository (LIGHTNING_MIRROR, a git
directory); without it these tests are skipped.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runner.app import create_app
from runner_fakes import live_server, settings_with

MIRROR = Path(os.environ.get("LIGHTNING_MIRROR", "/work/.mirror/RWKV-Vibe+rwkv_lightning/repo"))
PASSWORD = "lightning-test-pw"


def mirror_file(path: str) -> str:
    if not MIRROR.is_dir() or shutil.which("git") is None:
        pytest.skip(f"the rwkv_lightning mirror is not here ({MIRROR})")
    shown = subprocess.run(["git", "-C", str(MIRROR), "show", f"HEAD:{path}"], capture_output=True, text=True, check=False)
    if shown.returncode != 0:
        pytest.skip(f"{path} is not in the rwkv_lightning mirror: {shown.stderr.strip()}")
    return shown.stdout


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    settings = settings_with(
        model_path=str(tiny_checkpoint),
        strategy="albatross workers=1 batch=32",
        password=PASSWORD,
        state_cache_path=tmp_path_factory.mktemp("lightning-states") / "states.sqlite3",
    )
    with live_server(create_app(settings)) as base_url:
        yield base_url


def test_rwkv_lightnings_curl_smoke_script_passes(server: str, tmp_path: Path) -> None:
    if shutil.which("bash") is None or shutil.which("curl") is None:
        pytest.skip("needs bash and curl")
    script = tmp_path / "test_curl.sh"
    script.write_text(mirror_file("test/test_curl.sh"))
    env = {**os.environ, "BASE_URL": server, "PASSWORD": PASSWORD, "MAX_TOKENS": "16", "STATE_MEMORY_ROUNDS": "2"}
    run = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=600, check=False)
    assert run.returncode == 0, f"test_curl.sh failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    assert "All requested curl smoke tests finished." in run.stdout


def webui_functions() -> dict[str, Any]:
    """webui_rwkv.py's module body before its Gradio page, with a stand-in for `gradio` (only
    `gr.update` is used by the request functions)."""
    tree = ast.parse(mirror_file("webui_rwkv.py"))
    body: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.With) or (isinstance(node, ast.If) and "__name__" in ast.unparse(node.test)):
            break  # `with gr.Blocks(...)`: the page itself
        body.append(node)
    module = ast.Module(body=body, type_ignores=[])
    gradio = types.ModuleType("gradio")
    gradio.update = lambda **kwargs: kwargs  # type: ignore[attr-defined]
    namespace: dict[str, Any] = {"__name__": "webui_rwkv"}
    saved = sys.modules.get("gradio")
    sys.modules["gradio"] = gradio
    try:
        exec(compile(module, "webui_rwkv.py", "exec"), namespace)  # the client under test
    finally:
        if saved is None:
            sys.modules.pop("gradio", None)
        else:
            sys.modules["gradio"] = saved
    return namespace


SAMPLING = {"max_tokens": 12, "temperature": 1.0, "top_k": 50, "top_p": 0.6, "alpha_presence": 1.0, "alpha_frequency": 0.1, "alpha_decay": 0.996, "chunk_size": 4}
STOPS = '["\\nUser:"]'


def test_webui_state_chat_and_clearing_the_session(server: str) -> None:
    webui = webui_functions()
    session = "webui-session"
    history: list[dict[str, str]] = []
    for question in ("Remember the code blue-17.", "What was the code?"):
        updates = list(webui["stream_chat"](question, history, server + "/state/chat/completions", PASSWORD, session, *SAMPLING.values(), STOPS))
        history, status = updates[-1]
        assert status.startswith("完成"), f"stream_chat ended with {status!r}: {history[-1]}"
        assert not history[-1]["content"].startswith("["), history[-1]["content"]  # "[请求失败]" / "[网络错误]"
    assert len(history) == 4
    cleared = webui["clear_session_state"](server + "/state/delete", PASSWORD, session)
    assert cleared == f"已清空后端会话状态: {session}"


def test_webui_batch_file_and_32_prompt_streams(server: str, tmp_path: Path) -> None:
    webui = webui_functions()
    questions = tmp_path / "questions.txt"
    questions.write_text("What is RWKV?\nName a colour.\nCount to three.\n", encoding="utf-8")
    batch = list(webui["run_batch_file_stream"](str(questions), server + "/v1/chat/completions", PASSWORD, *SAMPLING.values(), STOPS, 2))
    assert batch[-1][0].startswith("完成"), batch[-1][0]
    assert batch[-1][-2] is not None, "a finished batch run offers its results file"
    many = list(webui["run_prompt_32_stream"]("Write a haiku.", False, server + "/v1/chat/completions", PASSWORD, *SAMPLING.values(), STOPS))
    assert many[-1][0].startswith("完成"), many[-1][0]
    assert all("失败" not in str(slot) and "异常" not in str(slot) for slot in many[-1][1:33])


def test_webui_html_grid_stream(server: str) -> None:
    webui = webui_functions()
    sampling = {**SAMPLING, "max_tokens": 16}
    updates = list(
        webui["stream_html_grid_api"]("User: Write HTML: a clock\n\nAssistant: <think></think", server + "/v1/chat/completions", PASSWORD, sampling["max_tokens"], 3, *list(sampling.values())[1:], STOPS)
    )
    text, status, meta = updates[-1]
    assert meta["done"] is True and len(meta["token_counts"]) == 3, (status, meta)
    assert sum(meta["token_counts"]) > 0 and "失败" not in status and "错误" not in status, status
