"""State sessions and dialogue nodes live in separate key spaces: a session named `X:1` is not node
1 of tree `X`, deleting a tree's nodes spares a session named `X:...`, and a database written
before the spaces were separated is migrated when it opens."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import torch

from albatross_engine.state_cache.key_migration import KEY_SCHEME_VERSION
from runner.sessions import legacy_key_name, names_of, node_index, parse_state_key
from test_native_routes import HistoryState, greedy_continuation
from test_state_sessions import TOKENS, Server, replayed_conversation


def status_names(server: Server) -> list[tuple[str, str]]:
    return [(s["session_id"], s["kind"]) for s in server.client.post("/state/status").json()["sessions"]]


def test_a_session_named_like_a_node_never_reads_or_overwrites_that_node(tmp_path: Path) -> None:
    server = Server(tmp_path / "states.sqlite3")
    try:
        root_reply, one = server.multi_turn("X", 0, "root question")
        assert one == 1
        session_reply = server.state_turn("X:1", "hello")
        assert session_reply == greedy_continuation("hello", TOKENS), "a new state session starts from the zero state, not from node X:1"
        branch, _ = server.multi_turn("X", 1, "follow up")
        expected = greedy_continuation(replayed_conversation(["root question", "follow up"], [root_reply]), TOKENS)
        assert branch == expected, "node X:1 must still hold the tree's turn, not the session's"
        assert status_names(server) == [("X:1", "dialogue_node"), ("X:1", "session"), ("X:2", "dialogue_node")]
    finally:
        server.close()


def test_delete_prefix_removes_the_tree_and_its_session_only(tmp_path: Path) -> None:
    server = Server(tmp_path / "states.sqlite3")
    try:
        server.state_turn("X", "a session named X")
        server.multi_turn("X", 0, "root")
        server.multi_turn("X", 1, "more")
        server.state_turn("X:1", "a session named X:1")
        server.multi_turn("X:1", 0, "the tree of X:1")
        response = server.client.post("/state/delete", json={"session_id": "X", "delete_prefix": True})
        assert response.status_code == 200, response.text
        assert sorted(response.json()["deleted"]) == ["X", "X:1", "X:2"]
        assert status_names(server) == [("X:1", "session"), ("X:1:1", "dialogue_node")]
    finally:
        server.close()


def test_delete_by_a_node_name_removes_that_node_and_the_session_of_that_name(tmp_path: Path) -> None:
    server = Server(tmp_path / "states.sqlite3")
    try:
        server.multi_turn("t", 0, "root")
        server.multi_turn("t", 1, "more")
        response = server.client.post("/state/delete", json={"session_id": "t:1"})
        assert response.status_code == 200 and response.json()["deleted"] == ["t:1"]
        assert status_names(server) == [("t:2", "dialogue_node")]
    finally:
        server.close()


def test_names_and_keys_read_back_unambiguously() -> None:
    assert parse_state_key("node:a:b:12").public == "a:b:12"
    assert parse_state_key("node:a:b:12").session_id == "a:b"
    assert parse_state_key("session:a:12").kind == "session"
    assert parse_state_key("prefix:00ff") is None and parse_state_key("node:a:x") is None
    assert node_index("node:X:7", "X") == 7 and node_index("node:X:1:2", "X") is None
    assert [n.key for n in names_of("X:3")] == ["session:X:3", "node:X:3"]
    assert [n.key for n in names_of("X")] == ["session:X"]


def test_legacy_keys_are_nodes_only_where_their_tree_was_numbered() -> None:
    counters = {"tree": 4}
    assert legacy_key_name("tree:3", counters).key == "node:tree:3"
    assert legacy_key_name("tree:5", counters).key == "node:tree:5", "one past the counter: saved, crash before the raise"
    assert legacy_key_name("tree:9", counters).key == "session:tree:9"
    assert legacy_key_name("user:1", counters).key == "session:user:1"
    assert legacy_key_name("plain", counters).key == "session:plain"
    assert legacy_key_name("prefix:abc", counters) is None


def _old_database(path: Path, fingerprint: str) -> dict[str, list[int]]:
    """A database as the single-key-space code wrote it: a session, a numbered tree, a session whose
    name looks like a node, and a prefix state."""
    rows = {"chat": [104, 105], "tree:1": [1, 2, 3], "tree:2": [1, 2, 3, 4], "user:1": [7], "prefix:" + "0" * 64: [9, 9]}
    connection = sqlite3.connect(path)
    connection.executescript(
        "CREATE TABLE states (fingerprint TEXT NOT NULL, key TEXT NOT NULL, layout TEXT NOT NULL, dtype TEXT NOT NULL,"
        " nbytes INTEGER NOT NULL, checksum TEXT NOT NULL, payload BLOB NOT NULL, last_updated REAL NOT NULL, PRIMARY KEY (fingerprint, key));"
        "CREATE TABLE counters (fingerprint TEXT NOT NULL, name TEXT NOT NULL, value INTEGER NOT NULL, PRIMARY KEY (fingerprint, name));"
    )
    from albatross_engine.state_cache.records import checksum, state_dtype, state_layout, state_nbytes

    for key, tokens in rows.items():
        state = HistoryState(torch.tensor(tokens, dtype=torch.int64))
        payload = state.to_bytes()
        connection.execute(
            "INSERT INTO states VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (fingerprint, key, state_layout(state), state_dtype(state), state_nbytes(state), checksum(payload), payload, 1.0),
        )
    connection.execute("INSERT INTO counters VALUES (?, 'dialogue:tree', 2)", (fingerprint,))
    connection.commit()
    connection.close()
    return rows


def test_an_old_database_is_migrated_into_the_key_spaces_once(tmp_path: Path) -> None:
    db_path = tmp_path / "old.sqlite3"
    rows = _old_database(db_path, "history-model")
    server = Server(db_path)
    try:
        assert status_names(server) == [("chat", "session"), ("tree:1", "dialogue_node"), ("tree:2", "dialogue_node"), ("user:1", "session")]
        store = server.backend.state_store
        assert store.get("node:tree:2").tokens.tolist() == rows["tree:2"]
        assert store.get("session:user:1").tokens.tolist() == rows["user:1"]
        assert store.get("prefix:" + "0" * 64).tokens.tolist() == rows["prefix:" + "0" * 64], "prefix states keep their keys"
        _, number = server.multi_turn("tree", 2, "continue the migrated node")
        assert number == 3, "numbering goes on after the migrated nodes"
    finally:
        server.close()
    with sqlite3.connect(db_path) as connection:
        assert connection.execute("PRAGMA user_version").fetchone()[0] == KEY_SCHEME_VERSION
        keys = sorted(key for (key,) in connection.execute("SELECT key FROM states"))
    assert keys == ["node:tree:1", "node:tree:2", "node:tree:3", "prefix:" + "0" * 64, "session:chat", "session:user:1"]
    reopened = Server(db_path)  # a second open changes nothing
    try:
        assert [name for name, _ in status_names(reopened)] == ["chat", "tree:1", "tree:2", "tree:3", "user:1"]
    finally:
        reopened.close()
