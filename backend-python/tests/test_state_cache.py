"""The tiered state cache: L1 device / L2 host / L3 SQLite, LRU demotion, durability, corruption."""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

import pytest
import torch

from albatross.state import SlotState
from albatross_engine.state_cache import StateCache
from albatross_engine.state_cache.host_slab import HostSlab
from albatross_engine.state_cache.records import StoredRecord
from albatross_engine.state_cache.sqlite_tier import SqliteTier

LAYERS, WIDTH, HEADS, HEAD_SIZE = 2, 128, 2, 64


def random_state(seed: int) -> SlotState:
    generator = torch.Generator().manual_seed(seed)
    return SlotState(
        torch.randn(LAYERS, WIDTH, generator=generator),
        torch.randn(LAYERS, WIDTH, generator=generator),
        torch.randn(LAYERS, HEADS, HEAD_SIZE, HEAD_SIZE, generator=generator),
    )


ENTRY_BYTES = random_state(0).nbytes


def assert_same_state(actual: SlotState | None, expected: SlotState, what: str) -> None:
    assert actual is not None, f"{what}: the cache returned nothing"
    for name in ("att_shift", "ffn_shift", "wkv"):
        assert torch.equal(getattr(actual, name), getattr(expected, name)), f"{what}: {name} differs from what was put"


def tiers(cache: StateCache) -> dict[str, str]:
    return {info.key: info.tier for info in cache.sessions()}


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "states.sqlite3"


@pytest.fixture
def make_cache(db_path: Path, open_caches: list[StateCache]):
    def make(fingerprint: str = "model-a", l1: int = 100 * ENTRY_BYTES, l2: int = 100 * ENTRY_BYTES, l3: int = 1000 * ENTRY_BYTES) -> StateCache:
        cache = StateCache(db_path, fingerprint, l1_bytes=l1, l2_bytes=l2, l3_bytes=l3)
        open_caches.append(cache)
        return cache

    return make


def rows_on_disk(db_path: Path) -> dict[tuple[str, str], bytes]:
    with sqlite3.connect(db_path) as connection:
        return {(fp, key): bytes(payload) for fp, key, payload in connection.execute("SELECT fingerprint, key, payload FROM states")}


def test_get_returns_what_was_put_as_a_private_copy(make_cache) -> None:
    cache = make_cache()
    original = random_state(1)
    expected = original.clone()
    cache.put("s1", original)
    original.wkv.add_(1.0)  # the caller reuses its tensors (a running slot)
    first = cache.get("s1")
    assert_same_state(first, expected, "after the caller mutated its own copy")
    assert first is not None
    first.att_shift.zero_()
    assert_same_state(cache.get("s1"), expected, "after the reader mutated the returned copy")


def test_missing_key_is_none_and_not_contained(make_cache) -> None:
    cache = make_cache()
    assert cache.get("nobody") is None
    assert not cache.contains("nobody")


def test_least_recently_used_entry_moves_from_l1_to_l2_and_back_on_a_hit(make_cache) -> None:
    cache = make_cache(l1=ENTRY_BYTES)
    cache.put("a", random_state(1))
    cache.put("b", random_state(2))
    assert tiers(cache) == {"a": "L2", "b": "L1"}, "the older entry should have moved down to L2"
    assert_same_state(cache.get("a"), random_state(1), "an L2 hit")
    assert tiers(cache) == {"a": "L1", "b": "L2"}, "a hit promotes to L1 and demotes the other"
    assert cache.stats()["l2_hits"] == 1


def test_entries_past_l2_live_on_disk_and_load_back(make_cache) -> None:
    cache = make_cache(l1=ENTRY_BYTES, l2=ENTRY_BYTES)
    for index in range(4):
        cache.put(f"s{index}", random_state(index))
    assert cache.wait_persisted(timeout=10)
    assert tiers(cache) == {"s0": "L3", "s1": "L3", "s2": "L2", "s3": "L1"}
    assert_same_state(cache.get("s0"), random_state(0), "s0 read back from disk")
    assert cache.stats()["l3_hits"] == 1
    assert tiers(cache) == {"s0": "L1", "s1": "L3", "s2": "L3", "s3": "L2"}, "a disk hit promotes to L1 and pushes the rest down"
    for index in range(1, 4):
        assert_same_state(cache.get(f"s{index}"), random_state(index), f"s{index} after eviction")


def test_session_state_is_on_disk_once_persisted_without_a_flush(make_cache, db_path: Path) -> None:
    cache = make_cache()
    cache.put("turn", random_state(3))
    assert cache.wait_persisted("turn", timeout=10)
    stored = rows_on_disk(db_path)
    assert ("model-a", "turn") in stored, f"rows on disk: {sorted(stored)}"
    assert SlotState.from_bytes(stored[("model-a", "turn")]).wkv.equal(random_state(3).wkv)


def test_prefix_cache_states_reach_disk_only_on_flush(make_cache, db_path: Path) -> None:
    cache = make_cache()
    cache.put("prefix:abc", random_state(4))
    cache.wait_persisted(timeout=10)
    assert ("model-a", "prefix:abc") not in rows_on_disk(db_path), "prefix states are written back, not through"
    assert cache.flush(timeout=10)
    assert ("model-a", "prefix:abc") in rows_on_disk(db_path), "flush must write every memory entry"


def test_a_bounded_close_drops_what_it_could_not_write_and_still_closes(
    make_cache, db_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker process's shutdown: the flush may take `timeout` seconds, then what is unwritten
    is dropped. The writer is held at its disk lock, so no write can finish within the budget."""
    cache = make_cache()
    for index in range(4):
        cache.put(f"prefix:{index}", random_state(index))
    cache.wait_persisted(timeout=10)
    closed = threading.Event()
    with cache._disk_order:  # the writer waits here for every write
        closer = threading.Thread(target=lambda: (cache.close(timeout=0.05), closed.set()))
        with caplog.at_level(logging.WARNING):
            closer.start()
            for _ in range(1000):  # until the flush gave up and dropped the queued writes
                with cache._lock:
                    if cache._pending == {} and "shutdown budget ran out" in caplog.text:
                        break
                threading.Event().wait(0.01)
    closer.join(timeout=30)
    assert closed.is_set(), "close returned"
    assert "closing with 4 states not written" in caplog.text, caplog.text
    assert not rows_on_disk(db_path), "no write could start: the writer skipped every dropped job"
    cache.close()  # idempotent


def test_a_prefix_state_falling_out_of_host_memory_is_dropped_not_written(make_cache, db_path: Path) -> None:
    cache = make_cache(l1=ENTRY_BYTES, l2=ENTRY_BYTES)
    for index in range(3):
        cache.put(f"prefix:{index}", random_state(index))
    cache.wait_persisted(timeout=10)
    assert not rows_on_disk(db_path), "no prefix state is written under memory pressure"
    assert tiers(cache) == {"prefix:1": "L2", "prefix:2": "L1"}
    assert cache.get("prefix:0") is None, "the oldest prefix state was dropped"
    assert cache.stats()["prefix_dropped"] == 1


def test_states_survive_a_restart(make_cache) -> None:
    first = make_cache()
    first.put("kept", random_state(5))
    first.put("prefix:p", random_state(6))
    first.close()
    second = make_cache()
    assert tiers(second) == {"kept": "L3", "prefix:p": "L3"}
    assert_same_state(second.get("kept"), random_state(5), "a session after restart")
    assert_same_state(second.get("prefix:p"), random_state(6), "a flushed prefix state after restart")


def test_a_state_saved_for_one_model_is_never_loaded_into_another(make_cache) -> None:
    model_a = make_cache("model-a")
    model_a.put("shared-name", random_state(7))
    model_a.wait_persisted(timeout=10)
    model_b = make_cache("model-b")
    assert model_b.get("shared-name") is None
    assert not model_b.contains("shared-name")
    assert model_b.sessions() == []
    assert not model_b.delete("shared-name"), "deleting in model b must not touch model a's row"
    assert_same_state(model_a.get("shared-name"), random_state(7), "model a's own state")


def test_a_corrupt_row_is_dropped_with_a_warning_and_never_loaded(make_cache, db_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    writer = make_cache()
    writer.put("bad", random_state(8))
    writer.close()
    with sqlite3.connect(db_path) as connection:
        (payload,) = connection.execute("SELECT payload FROM states WHERE key = 'bad'").fetchone()
        flipped = bytearray(payload)
        flipped[-5] ^= 0xFF
        connection.execute("UPDATE states SET payload = ? WHERE key = 'bad'", (bytes(flipped),))
    reader = make_cache()
    with caplog.at_level(logging.WARNING):
        assert reader.get("bad") is None, "a row whose checksum fails must not load"
    assert "corrupt row 'bad'" in caplog.text
    assert ("model-a", "bad") not in rows_on_disk(db_path), "the corrupt row should be gone"
    assert reader.stats()["corrupt_rows_dropped"] == 1


def test_a_row_that_does_not_decode_is_dropped_even_with_a_matching_checksum(make_cache, db_path: Path) -> None:
    import hashlib

    writer = make_cache()
    writer.put("truncated", random_state(9))
    writer.close()
    with sqlite3.connect(db_path) as connection:
        (payload,) = connection.execute("SELECT payload FROM states WHERE key = 'truncated'").fetchone()
        short = bytes(payload)[:-64]
        connection.execute(
            "UPDATE states SET payload = ?, checksum = ? WHERE key = 'truncated'", (short, hashlib.sha256(short).hexdigest())
        )
    reader = make_cache()
    assert reader.get("truncated") is None
    assert not reader.contains("truncated")


def test_disk_budget_evicts_the_oldest_rows(make_cache, db_path: Path) -> None:
    cache = make_cache(l1=0, l2=0, l3=2 * ENTRY_BYTES)
    for index in range(3):
        cache.put(f"s{index}", random_state(index))
        assert cache.wait_persisted(timeout=10)
    assert sorted(key for _, key in rows_on_disk(db_path)) == ["s1", "s2"], "the oldest row should have been evicted"
    assert cache.get("s0") is None


def test_delete_removes_a_key_from_every_tier(make_cache, db_path: Path) -> None:
    cache = make_cache(l1=ENTRY_BYTES)
    cache.put("a", random_state(1))
    cache.put("b", random_state(2))
    cache.wait_persisted(timeout=10)
    assert cache.delete("a") and cache.delete("b")
    assert cache.get("a") is None and cache.get("b") is None
    assert rows_on_disk(db_path) == {}
    assert not cache.delete("a"), "a second delete finds nothing"


def test_delete_prefix_removes_every_matching_key_only(make_cache) -> None:
    cache = make_cache(l1=ENTRY_BYTES, l2=ENTRY_BYTES)
    for key in ("chat:1", "chat:2", "chat:3", "chatter:1", "other"):
        cache.put(key, random_state(len(key)))
    cache.wait_persisted(timeout=10)
    assert cache.delete_prefix("chat:") == ["chat:1", "chat:2", "chat:3"]
    assert sorted(tiers(cache)) == ["chatter:1", "other"]


def test_counters_only_rise_and_survive_a_restart(make_cache) -> None:
    first = make_cache()
    assert first.read_counter("dialogue:s") == 0
    first.raise_counter("dialogue:s", 3)
    first.raise_counter("dialogue:s", 2)
    assert first.read_counter("dialogue:s") == 3
    first.close()
    assert make_cache().read_counter("dialogue:s") == 3
    assert make_cache("model-b").read_counter("dialogue:s") == 0, "counters are per model"


def test_concurrent_puts_and_gets_from_threads_stay_consistent(make_cache) -> None:
    cache = make_cache(l1=2 * ENTRY_BYTES, l2=2 * ENTRY_BYTES)
    states = {f"k{index}": random_state(100 + index) for index in range(6)}
    errors: list[str] = []

    def worker(offset: int) -> None:
        for round_ in range(5):
            for index, (key, state) in enumerate(states.items()):
                if (index + offset + round_) % 2:
                    cache.put(key, state)
                else:
                    got = cache.get(key)
                    if got is not None and not torch.equal(got.wkv, state.wkv):
                        errors.append(f"{key} returned another state")

    threads = [threading.Thread(target=worker, args=(offset,)) for offset in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert cache.flush(timeout=10)
    for key, state in states.items():
        assert_same_state(cache.get(key), state, key)


# ---------------------------------------------------------------------------- on a GPU

def _on_gpu(state: SlotState) -> SlotState:
    return SlotState(*(getattr(state, name).cuda() for name in ("att_shift", "ffn_shift", "wkv")))


def _to_host(state: SlotState | None) -> SlotState | None:
    return None if state is None else SlotState(*(getattr(state, name).cpu() for name in ("att_shift", "ffn_shift", "wkv")))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_demotion_to_host_memory_does_not_wait_for_the_device(db_path: Path, open_caches: list[StateCache]) -> None:
    cache = StateCache(db_path, "model-a", device="cuda", l1_bytes=2 * ENTRY_BYTES, l2_bytes=100 * ENTRY_BYTES)
    open_caches.append(cache)
    assert cache._slab is not None and cache._slab.wait_ready(30)  # allocated in the background
    expected = [random_state(seed) for seed in range(6)]
    on_gpu = [_on_gpu(state) for state in expected]  # before the sleep: a pageable upload would wait for it
    for index, state in enumerate(on_gpu):  # the pinned blocks are allocated (once) outside the checked window
        cache.put(f"warm-up:{index}", state)
    cache.delete_prefix("warm-up:")
    torch.cuda.synchronize()
    busy = torch.cuda.Event()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of device time queued ahead of the puts (an ordering check, not a timing)
    busy.record()
    for index, state in enumerate(on_gpu):
        cache.put(f"prefix:{index}", state)
    assert not busy.query(), "put() waited for the device: demoting 4 entries must not synchronise"
    assert cache.stats()["l2_entries"] == 4
    for index, state in enumerate(expected):  # L2 hits come back through the device, still equal
        assert_same_state(_to_host(cache.get(f"prefix:{index}")), state, f"entry {index}")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_a_demotion_copies_beside_the_compute_stream_after_what_came_before(db_path: Path, open_caches: list[StateCache]) -> None:
    """The copy to host memory waits for the work issued before it on the current stream (here the
    L1 copy queued behind a sleep), then runs beside the work issued after it: it lands while a
    long kernel queued after the put still runs. Ordering checks, not timings."""
    cache = StateCache(db_path, "model-a", device="cuda", l1_bytes=1 * ENTRY_BYTES, l2_bytes=10 * ENTRY_BYTES)
    open_caches.append(cache)
    assert cache._slab is not None and cache._slab.wait_ready(30)
    expected = [random_state(300 + seed) for seed in range(2)]
    on_gpu = [_on_gpu(state) for state in expected]
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the L1 copies of the puts below queue behind this
    cache.put("prefix:0", on_gpu[0])
    cache.put("prefix:1", on_gpu[1])  # L1 holds one: prefix:0 goes to L2
    torch.cuda._sleep(4_000_000_000)  # compute issued after the demotion (~2 s)
    busy = torch.cuda.Event()
    busy.record()
    (entry,) = [entry for key, entry in cache._l2.items() if key == "prefix:0"]
    assert entry.landed is not None
    entry.landed.synchronize()
    assert not busy.query(), "the demotion waited for compute issued after it"
    assert_same_state(SlotState(*(getattr(entry.state, name).clone() for name in ("att_shift", "ffn_shift", "wkv"))), expected[0], "the demoted copy")
    torch.cuda.synchronize()
    assert_same_state(_to_host(cache.get("prefix:0")), expected[0], "prefix:0 through the device")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_device_states_reach_disk_intact_through_pinned_copies(db_path: Path, open_caches: list[StateCache]) -> None:
    cache = StateCache(db_path, "model-a", device="cuda", l1_bytes=1 * ENTRY_BYTES, l2_bytes=100 * ENTRY_BYTES)
    open_caches.append(cache)
    assert cache._slab is not None and cache._slab.wait_ready(30)
    expected = {f"session-{i}": random_state(100 + i) for i in range(3)}
    expected |= {f"prefix:{i}": random_state(200 + i) for i in range(3)}
    torch.cuda._sleep(200_000_000)  # the copies land after this; the writer must wait for them
    for key, state in expected.items():
        cache.put(key, _on_gpu(state))
    assert cache.flush(timeout=60)
    cache.close()
    reopened = StateCache(db_path, "model-a", l1_bytes=100 * ENTRY_BYTES, l2_bytes=100 * ENTRY_BYTES)
    open_caches.append(reopened)
    for key, state in expected.items():
        assert_same_state(reopened.get(key), state, key)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_host_slots_are_reused_and_keep_the_newest_states_intact(db_path: Path, open_caches: list[StateCache]) -> None:
    # L2's budget holds 5 states: 40 demotions cycle every slot many times over.
    cache = StateCache(db_path, "model-a", device="cuda", l1_bytes=2 * ENTRY_BYTES, l2_bytes=5 * ENTRY_BYTES + 1000)
    open_caches.append(cache)
    assert cache._slab is not None and cache._slab.wait_ready(30)
    expected = {f"prefix:{i}": random_state(300 + i) for i in range(42)}
    for key, state in expected.items():
        cache.put(key, _on_gpu(state))
    stats = cache.stats()
    assert stats["l1_entries"] == 2 and stats["l2_entries"] == 5, stats
    assert stats["prefix_dropped"] == 35, stats
    for key in list(expected)[-7:]:  # the 5 newest demoted and the 2 still in L1
        assert_same_state(_to_host(cache.get(key)), expected[key], key)
    assert cache.get("prefix:0") is None


def test_host_slab_cuts_equal_slots_and_refuses_larger_states() -> None:
    slab = HostSlab(10 * ENTRY_BYTES + 4096, pin=False)
    assert slab.wait_ready(10)
    state = random_state(1)
    slots = [slab.take(state) for _ in range(10)]
    assert None not in slots and len(set(slots)) == 10
    assert slab.take(state) is None, "every slot is taken"
    views = [slab.view(slot, state) for slot in slots[:2]]
    views[0].wkv.copy_(state.wkv)
    views[1].wkv.fill_(7.0)
    assert torch.equal(views[0].wkv, state.wkv), "slots must not overlap"
    slab.give_back(slots[0])
    assert slab.take(state) == slots[0]
    bigger = SlotState(torch.zeros(LAYERS, 2 * WIDTH), torch.zeros(LAYERS, 2 * WIDTH), state.wkv)
    assert not slab.fits(bigger) and slab.take(bigger) is None
    slab.close()



def open_together_and_write(path: Path, openers: int) -> tuple[list[SqliteTier], list[str]]:
    """`openers` threads open `path` at one moment and each writes a row: the tiers, and what failed."""
    start = threading.Barrier(openers)
    failures: list[str] = []
    tiers: list[SqliteTier] = []

    def open_and_write(index: int) -> None:
        start.wait()
        try:
            tier = SqliteTier(path, budget_bytes=1 << 20)
            tiers.append(tier)
            tier.write("model-a", StoredRecord(f"prefix:{index}", "layout", "float32", 1, "sum", b"x", float(index)))
        except Exception as error:
            failures.append(f"{type(error).__name__}: {error}")

    threads = [threading.Thread(target=open_and_write, args=(i,)) for i in range(openers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return tiers, failures


def test_connections_opening_one_new_file_at_once_all_open_it_and_write(tmp_path: Path) -> None:
    """Worker processes open the server's database together. SQLite answers a second connection's
    switch to WAL with 'database is locked' at once, without waiting (1 round in 15 failed so before
    the switch was retried): every opener must get the file, in WAL mode, and write to it."""
    openers = 4
    for round_index in range(60):
        path = tmp_path / f"round{round_index}.sqlite3"
        tiers, failures = open_together_and_write(path, openers)
        try:
            assert failures == [], f"round {round_index}: {failures}"
            assert sorted(key for key, _ in tiers[0].list_keys("model-a")) == [f"prefix:{i}" for i in range(openers)]
            with sqlite3.connect(path) as connection:
                assert connection.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        finally:
            for tier in tiers:
                tier.close()
