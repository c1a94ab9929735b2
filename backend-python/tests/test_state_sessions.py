"""State sessions over HTTP: continuing a saved state, branching dialogue nodes, status and delete,
across restarts and with forced cache eviction. Uses the history test double of
test_native_routes (its greedy text depends only on every token it consumed)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from runner.sessions import session_key
from runner_fakes import ScriptedBackend, install_backend, make_app, settings_with, sse_payloads
from test_native_routes import HistoryBackend, greedy_continuation, history_cache

TURNS = ["Hello there", "tell me more", "\n\nalready separated", "and then?", "bye"]
TOKENS = 6


class Server:
    """A test app on a history backend whose cache lives at `db_path`; `restart()` shuts the
    backend down (flushing its cache) and builds a fresh app and backend on the same file."""

    def __init__(self, db_path: Path, l1: int = 1 << 20, l2: int = 1 << 20) -> None:
        self.db_path, self.l1, self.l2 = db_path, l1, l2
        self._open()

    def _open(self) -> None:
        self.backend = HistoryBackend(history_cache(self.db_path, self.l1, self.l2))
        self.client = TestClient(make_app(settings_with(max_tokens=64), self.backend))
        self.client.__enter__()

    def close(self) -> None:
        self.client.__exit__(None, None, None)
        self.backend.shutdown()

    def restart(self) -> None:
        self.close()
        self._open()

    def state_turn(self, session_id: str, prompt: str, **fields: object) -> str:
        response = self.client.post("/state/chat/completions", json={"session_id": session_id, "contents": [prompt], "max_tokens": TOKENS, **fields})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"]

    def multi_turn(self, session_id: str, dialogue_idx: int, prompt: str) -> tuple[str, int]:
        response = self.client.post("/multi_state/chat/completions", json={"session_id": session_id, "dialogue_idx": dialogue_idx, "contents": [prompt], "max_tokens": TOKENS})
        assert response.status_code == 200, response.text
        body = response.json()
        return body["choices"][0]["message"]["content"], body["dialogue_idx"]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    running = Server(tmp_path / "states.sqlite3")
    yield running
    running.close()


def replayed_conversation(turns: list[str], replies: list[str]) -> str:
    """The single prompt holding the conversation up to the last turn's reply."""
    text = ""
    for number, prompt in enumerate(turns):
        if number > 0 and not prompt.startswith("\n\n"):
            prompt = "\n\n" + prompt
        text += prompt
        if number < len(replies):
            text += replies[number]
    return text


def test_five_state_turns_give_the_text_of_one_prompt_holding_the_whole_conversation(server: Server) -> None:
    replies: list[str] = []
    for number, prompt in enumerate(TURNS):
        reply = server.state_turn("chat-1", prompt)
        expected = greedy_continuation(replayed_conversation(TURNS[: number + 1], replies), TOKENS)
        assert reply == expected, f"turn {number + 1} differs from replaying the conversation in one prompt"
        replies.append(reply)


def test_a_state_session_continues_after_a_restart(server: Server) -> None:
    replies = [server.state_turn("chat-2", TURNS[0]), server.state_turn("chat-2", TURNS[1])]
    server.restart()
    status = server.client.post("/state/status").json()
    assert [(s["session_id"], s["cache_level"]) for s in status["sessions"]] == [("chat-2", "Database (Disk)")]
    for prompt in TURNS[2:]:
        replies.append(server.state_turn("chat-2", prompt))
    assert replies[-1] == greedy_continuation(replayed_conversation(TURNS, replies[:-1]), TOKENS)


def test_forced_eviction_to_disk_changes_nothing(tmp_path: Path) -> None:
    tiny = Server(tmp_path / "tiny.sqlite3", l1=1, l2=1)  # every entry falls through to SQLite at once
    try:
        replies = {"a": [], "b": []}
        for prompt in TURNS:
            for session in ("a", "b"):  # interleaved sessions evict each other
                replies[session].append(tiny.state_turn(session, prompt + session))
        for session in ("a", "b"):
            turns = [p + session for p in TURNS]
            assert replies[session][-1] == greedy_continuation(replayed_conversation(turns, replies[session][:-1]), TOKENS)
        assert tiny.backend.state_store.stats()["l3_hits"] > 0, "the states should have been read back from disk"
    finally:
        tiny.close()


def test_a_second_concurrent_turn_on_a_session_is_409(tmp_path: Path) -> None:
    slow = HistoryBackend(history_cache(tmp_path / "slow.sqlite3"), step_delay_s=0.02)
    with TestClient(make_app(settings_with(max_tokens=64), slow)) as client:
        body = {"session_id": "busy", "contents": ["x"], "max_tokens": 40, "stream": True}
        with client.stream("POST", "/state/chat/completions", json=body) as first:
            assert first.status_code == 200
            second = client.post("/state/chat/completions", json={**body, "stream": False})
            assert second.status_code == 409, second.text
        after = client.post("/state/chat/completions", json={**body, "stream": False, "max_tokens": 1})
        assert after.status_code == 200, "the session is free again once the first turn ended"
    slow.shutdown()


def test_an_aborted_turn_leaves_the_saved_state_unchanged(tmp_path: Path) -> None:
    slow = HistoryBackend(history_cache(tmp_path / "abort.sqlite3"), step_delay_s=0.01)
    with TestClient(make_app(settings_with(max_tokens=64), slow)) as client:
        first = client.post("/state/chat/completions", json={"session_id": "s", "contents": ["start"], "max_tokens": 4}).json()
        saved = slow.state_store.get(session_key("s")).tokens.tolist()
        with client.stream("POST", "/state/chat/completions", json={"session_id": "s", "contents": ["more"], "max_tokens": 50, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    break
        assert slow.aborted == 1
        assert slow.state_store.get(session_key("s")).tokens.tolist() == saved, "an aborted turn must not overwrite the saved state"
        assert first["choices"][0]["message"]["content"] == greedy_continuation("start", 4)
    slow.shutdown()


def test_state_turn_errors(server: Server) -> None:
    post = server.client.post
    missing = post("/state/chat/completions", json={"contents": ["x"]})
    assert missing.status_code == 400 and "session_id" in missing.json()["error"]["message"]
    two = post("/state/chat/completions", json={"session_id": "s", "contents": ["x", "y"]})
    assert two.status_code == 400 and "exactly one prompt" in two.json()["error"]["message"]
    assert post("/state/chat/completions", json={"session_id": "s", "contents": ["x"], "top_p": 3}).status_code == 422


def test_state_routes_on_a_backend_without_states_are_400(tmp_path: Path) -> None:
    app = make_app(settings_with())
    install_backend(app, ScriptedBackend(["a"]))
    with TestClient(app) as client:
        for path, body in [("/state/chat/completions", {"session_id": "s", "contents": ["x"]}),
                           ("/multi_state/chat/completions", {"session_id": "s", "dialogue_idx": 0, "contents": ["x"]}),
                           ("/state/status", {}), ("/state/delete", {"session_id": "s"})]:
            response = client.post(path, json=body)
            assert response.status_code == 400, f"{path}: {response.text}"
            assert "unsupported feature on this backend" in response.json()["error"]["message"]


def test_state_stream_reply_then_status_lists_the_session_in_l1(server: Server) -> None:
    response = server.client.post("/state/chat/completions", json={"session_id": "st", "contents": ["go"], "max_tokens": 5, "stream": True})
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    text = "".join(c["delta"]["content"] for p in payloads[:-1] for c in json.loads(p)["choices"])
    assert text == greedy_continuation("go", 5)
    status = server.client.post("/state/status", json={}).json()
    assert status["status"] == "success" and status["total_sessions"] == 1
    assert (status["l1_cache_count"], status["l2_cache_count"], status["database_count"]) == (1, 0, 0)
    entry = status["sessions"][0]
    assert entry["session_id"] == "st" and entry["cache_level"] == "L1 (VRAM)"
    assert isinstance(entry["timestamp"], float) and len(entry["last_updated"]) == len("2025-01-01 00:00:00")


def test_multi_state_numbers_nodes_and_branching_matches_a_replay(server: Server) -> None:
    first, one = server.multi_turn("tree", 0, "root question")
    second, two = server.multi_turn("tree", one, "follow up")
    assert (one, two) == (1, 2), "nodes are numbered per session without gaps"
    branch, three = server.multi_turn("tree", one, "another way")
    assert three == 3
    assert branch == greedy_continuation(replayed_conversation(["root question", "another way"], [first]), TOKENS), "branching from node 1 equals replaying to it"
    again, four = server.multi_turn("tree", 0, "root question")
    assert (again, four) == (first, 4), "dialogue_idx 0 starts from the empty root"


def test_multi_state_numbers_are_not_reused_after_a_restart(server: Server) -> None:
    server.multi_turn("tree", 0, "a")
    server.multi_turn("tree", 1, "b")
    deleted = server.client.post("/state/delete", json={"session_id": "tree", "delete_prefix": True})
    assert deleted.status_code == 200 and deleted.json()["deleted"] == ["tree:1", "tree:2"]
    server.restart()
    _, number = server.multi_turn("tree", 0, "c")
    assert number == 3, "a node number is never handed out twice"


def test_multi_state_stream_sends_the_dialogue_index_before_done(server: Server) -> None:
    server.multi_turn("s", 0, "a")
    response = server.client.post("/multi_state/chat/completions", json={"session_id": "s", "dialogue_idx": 1, "contents": ["b"], "max_tokens": 3, "stream": True})
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    assert json.loads(payloads[-2]) == {"object": "multi_state.dialogue_idx", "session_id": "s:2", "dialogue_idx": 2}


def test_multi_state_errors(server: Server) -> None:
    post = server.client.post
    unknown = post("/multi_state/chat/completions", json={"session_id": "s", "dialogue_idx": 7, "contents": ["x"]})
    assert unknown.status_code == 404 and "s:7" in unknown.json()["error"]["message"]
    missing = post("/multi_state/chat/completions", json={"session_id": "s", "contents": ["x"]})
    assert missing.status_code == 400 and "dialogue_idx" in missing.json()["error"]["message"]
    assert post("/multi_state/chat/completions", json={"session_id": "s", "dialogue_idx": -1, "contents": ["x"]}).status_code == 422


def test_delete_a_session_and_not_found(server: Server) -> None:
    server.state_turn("keep", "x")
    server.state_turn("gone", "y")
    response = server.client.post("/state/delete", json={"session_id": "gone"})
    assert response.status_code == 200 and response.json()["status"] == "success"
    assert [s["session_id"] for s in server.client.post("/state/status").json()["sessions"]] == ["keep"]
    again = server.client.post("/state/delete", json={"session_id": "gone"})
    assert again.status_code == 404
    assert again.json()["status"] == "not_found" and "gone" in again.json()["message"]  # rwkv_lightning's shape
    assert again.json()["error"] == {"message": again.json()["message"], "type": "not_found_error", "code": 404, "param": "session_id"}
    assert server.client.post("/state/delete", json={}).status_code == 400


def test_concurrent_turns_on_different_sessions_all_save(server: Server) -> None:
    results: dict[str, str] = {}

    def turn(session: str) -> None:
        results[session] = server.state_turn(session, f"prompt {session}")

    threads = [threading.Thread(target=turn, args=(f"s{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {f"s{i}": greedy_continuation(f"prompt s{i}", TOKENS) for i in range(4)}
    assert server.client.post("/state/status").json()["total_sessions"] == 4
