"""Starting states other than zeros: a state file's key space (sessions and prefixes never mix
with those made without it), and penalties that start from a prompt (global_penalty)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from albatross.sampler import PenaltyPool, SamplingBatch
from albatross_engine.initial_state import NamespacedStateStore, namespace_for
from albatross_engine.state_cache import StateCache
from albatross_engine.state_store import PrefixHasher
from runner.app import create_app
from runner.interface import SamplingParams
from runner_fakes import settings_with


@pytest.mark.parametrize(("decay", "presence", "frequency"), [(0.996, 0.5, 1.0), (1.0, 2.0, 0.2), (0.0, 1.0, 1.0), (0.5, -0.3, 0.7)])
def test_a_seeded_slot_equals_updating_it_once_per_id(decay: float, presence: float, frequency: float) -> None:
    vocab = 50
    rng = random.Random(int(decay * 1000) + 7)
    ids = [rng.randrange(vocab) for _ in range(300)]
    settings = SamplingParams(presence_penalty=presence, frequency_penalty=frequency, penalty_decay=decay)
    sequential = PenaltyPool(2, vocab)
    batch = SamplingBatch.from_params([settings], [0], [0])
    for token in ids:
        sequential.update(torch.tensor([1]), torch.tensor([token]), batch)
    seeded = PenaltyPool(2, vocab)
    seeded.seed(1, ids, settings)
    assert torch.allclose(seeded.penalties, sequential.penalties, rtol=1e-5, atol=1e-6), (seeded.penalties[1] - sequential.penalties[1]).abs().max()
    assert torch.equal(seeded.seen, sequential.seen)
    assert not seeded.penalties[0].any(), "other slots are untouched"


def test_seeding_with_no_ids_leaves_the_slot_fresh() -> None:
    pool = PenaltyPool(1, 8)
    pool.seed(0, [], SamplingParams())
    assert not pool.penalties.any() and not pool.seen.any()


def test_prefix_keys_of_two_starting_states_differ_for_the_same_prompt() -> None:
    tokens = [5, 6, 7, 8]
    plain, salted = PrefixHasher(tokens), PrefixHasher(tokens, b"initial-state:abc\n")
    assert plain.key_at(4) != salted.key_at(4)
    assert PrefixHasher(tokens, b"initial-state:abc\n").key_at(2) == PrefixHasher(tokens[:2], b"initial-state:abc\n").key_at(2)


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[StateCache]:
    store = StateCache(tmp_path / "states.sqlite3", "fingerprint-x", device="cpu")
    try:
        yield store
    finally:
        store.close()


def test_a_namespaced_view_sees_and_changes_only_its_own_keys(cache: StateCache) -> None:
    state = _state()
    cache.put("s", state)
    view = NamespacedStateStore(cache, namespace_for("abc"))
    assert not view.contains("s"), "a session made without the state file is not the file's"
    view.put("s", state)
    view.put("s:1", state)
    view.raise_counter("dialogue:s", 1)
    assert view.contains("s") and cache.contains("initial-state:abc/s") and cache.contains("s")
    assert view.keys_with_prefix("s:") == {"s:1"}
    assert [info.key for info in view.sessions()] == ["s", "s:1"]
    assert (view.read_counter("dialogue:s"), cache.read_counter("dialogue:s")) == (1, 0)
    assert view.wait_persisted("s", 10)
    assert view.delete_prefix("s:") == ["s:1"] and view.delete("s")
    assert not view.contains("s") and cache.contains("s"), "deleting in the view leaves the other space alone"
    assert view.stats() == cache.stats()


def _state() -> object:
    from albatross.state import SlotState

    return SlotState(torch.zeros(2, 128), torch.zeros(2, 128), torch.zeros(2, 2, 64, 64))


@pytest.mark.parametrize("strategy", ["albatross workers=1 batch=4", "albatross workers=2 batch=4 device=cpu worker_mode=process"],
                         ids=["one worker thread", "two worker processes"])  # fmt: skip
def test_a_state_session_made_with_a_state_file_is_not_continued_without_it(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    generator = torch.Generator().manual_seed(3)
    torch.save({f"blocks.{i}.att.time_state": torch.randn(2, 64, 64, generator=generator) for i in range(2)}, tmp_path / "tuned.pth")
    monkeypatch.chdir(tmp_path)
    settings = settings_with(model_path=str(tiny_checkpoint), strategy=strategy, state_cache_path=tmp_path / "states.sqlite3")
    turn = {"session_id": "s", "contents": ["User: hi\n\nAssistant:"], "max_tokens": 6, "temperature": 0, "stop_tokens": []}
    with TestClient(create_app(settings)) as client:
        fresh = client.post("/state/chat/completions", json={**turn, "session_id": "zero"}).json()["choices"][0]["message"]["content"]
        assert client.post("/update-config", json={"state": "tuned.pth"}).json() == "success"
        tuned = client.post("/state/chat/completions", json=turn).json()["choices"][0]["message"]["content"]
        assert tuned != fresh, "the state file must change the first turn"
        listed = [entry["session_id"] for entry in client.post("/state/status", json={}).json()["sessions"]]
        assert listed == ["s"], "with the file set, its own sessions are listed under their names"
        assert client.post("/update-config", json={"state": ""}).json() == "success"
        again = client.post("/state/chat/completions", json=turn).json()["choices"][0]["message"]["content"]
        assert again == fresh, "without the file, session s is new: it starts from zeros"
