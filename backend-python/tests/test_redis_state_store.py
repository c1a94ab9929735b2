"""The Redis state tier against a real redis-server: two caches on one Redis act as two replicas
(records, checksums, budget, revalidation of memory copies, turn locks with leases and fencing, and
an outage that fails state calls with 503 while prefix-cache states keep working)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import pytest
import redis
import torch

from albatross.state import SlotState
from albatross_engine.state_cache import StateCache
from albatross_engine.state_cache.redis_tier import RedisTier, redacted
from albatross_engine.state_cache.store_url import parse_store_url
from runner.interface import BackendError
from runner.sessions import SessionBusy, session_key, session_turn_lock
from redis_server import RedisServer, redis_server  # noqa: F401 - the fixture

LAYERS, WIDTH, HEADS, HEAD_SIZE = 2, 128, 2, 64
PREFIX_KEY = "prefix:" + "ab" * 32


def random_state(seed: int) -> SlotState:
    generator = torch.Generator().manual_seed(seed)
    return SlotState(
        torch.randn(LAYERS, WIDTH, generator=generator),
        torch.randn(LAYERS, WIDTH, generator=generator),
        torch.randn(LAYERS, HEADS, HEAD_SIZE, HEAD_SIZE, generator=generator),
    )


ENTRY_BYTES = random_state(0).nbytes


def same(a: SlotState | None, b: SlotState) -> bool:
    return a is not None and all(torch.equal(getattr(a, n), getattr(b, n)) for n in ("att_shift", "ffn_shift", "wkv"))


@pytest.fixture
def replicas(redis_server: RedisServer) -> Iterator[Callable[..., StateCache]]:  # noqa: F811
    made: list[StateCache] = []

    def make(fingerprint: str = "model-a", l3: int = 100 * ENTRY_BYTES, lease_s: float = 30.0) -> StateCache:
        cache = StateCache(RedisTier(redis_server.url, l3, lease_s), fingerprint, l1_bytes=10 * ENTRY_BYTES, l2_bytes=10 * ENTRY_BYTES)
        made.append(cache)
        return cache

    yield make
    for cache in made:
        try:
            cache.close()
        except BackendError:
            pass  # a test that stopped Redis


def put_persisted(cache: StateCache, key: str, state: SlotState) -> None:
    cache.put(key, state)
    assert cache.wait_persisted(key, timeout=30)


def test_store_urls_parse_and_passwords_stay_out_of_messages() -> None:
    assert parse_store_url("sqlite:///states.sqlite3").path is not None
    assert str(parse_store_url("sqlite:////var/lib/a.sqlite3").path) == "/var/lib/a.sqlite3"
    assert parse_store_url("redis://10.0.0.5:6379/2").kind == "redis"
    with pytest.raises(ValueError, match="unknown state store"):
        parse_store_url("postgres://x")
    assert redacted("redis://:s3cret@host:6379/0") == "redis://:***@host:6379/0"
    assert "s3cret" not in redacted("redis://user:s3cret@host:6379/0")


def test_a_session_saved_by_one_replica_is_loaded_by_another(replicas) -> None:
    a, b = replicas(), replicas()
    state = random_state(1)
    put_persisted(a, session_key("s"), state)
    assert b.contains(session_key("s"))
    assert same(b.get(session_key("s")), state)
    assert [(i.key, i.tier) for i in b.sessions()] == [("session:s", "L1")], "contains() brought it into memory"


def test_a_stale_memory_copy_is_reloaded_and_a_deleted_one_is_gone(replicas) -> None:
    a, b = replicas(), replicas()
    key = session_key("s")
    put_persisted(a, key, random_state(1))
    assert b.contains(key) and b.get(key) is not None
    newer = random_state(2)
    put_persisted(a, key, newer)  # another replica's turn: b's L1 copy is now stale
    assert b.contains(key)
    assert same(b.get(key), newer), "the replica must continue from the newest stored state, not its L1 copy"
    assert b.stats()["stale_copies_dropped"] == 1
    assert a.delete(key)
    assert not b.contains(key) and b.get(key) is None
    assert b.sessions() == []


def test_records_are_keyed_by_fingerprint_and_checksummed(replicas, redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    a, other_model = replicas("model-a"), replicas("model-b")
    put_persisted(a, session_key("s"), random_state(1))
    assert not other_model.contains(session_key("s")) and other_model.sessions() == []
    client = redis.Redis.from_url(redis_server.url)
    client.hset(b"albatross:state:model-a:session:s", "payload", b"\x00" * 16)  # corrupted in storage
    reader = replicas("model-a")
    with caplog.at_level(logging.WARNING):
        assert reader.get(session_key("s")) is None
    assert "checksum mismatch" in caplog.text
    assert client.exists(b"albatross:state:model-a:session:s") == 0, "a corrupt record is deleted"
    assert int(client.get(b"albatross:bytes")) == 0, "the byte total follows deletes"


def test_the_budget_evicts_the_oldest_records_of_any_model(replicas, redis_server: RedisServer) -> None:  # noqa: F811
    a, b = replicas("model-a", l3=3 * ENTRY_BYTES), replicas("model-b", l3=3 * ENTRY_BYTES)
    put_persisted(a, session_key("1"), random_state(1))
    put_persisted(b, session_key("2"), random_state(2))
    put_persisted(a, session_key("3"), random_state(3))
    put_persisted(b, session_key("4"), random_state(4))
    client = redis.Redis.from_url(redis_server.url)
    assert client.exists(b"albatross:state:model-a:session:1") == 0, "the oldest record goes first"
    assert [k for k, _ in a._l3.list_keys("model-a")] == ["session:3"]
    assert int(client.get(b"albatross:bytes")) == 3 * ENTRY_BYTES


def test_a_turn_lock_is_held_across_replicas_and_released(replicas) -> None:
    a, b = replicas(), replicas()
    lease = a.acquire_turn(session_turn_lock("s"))
    with pytest.raises(SessionBusy):
        b.acquire_turn(session_turn_lock("s"))
    lease.release()
    lease.release()  # idempotent
    for _ in range(200):  # release runs on the keeper thread: it never blocks the caller
        try:
            b.acquire_turn(session_turn_lock("s")).release()
            break
        except SessionBusy:
            time.sleep(0.01)
    else:
        pytest.fail("the released lock was never free again")


def test_a_dead_replicas_lock_expires_after_its_lease(replicas, redis_server: RedisServer) -> None:  # noqa: F811
    b = replicas(lease_s=30.0)
    client = redis.Redis.from_url(redis_server.url)
    client.set(b"albatross:lock:session:s", "a-dead-replica", px=1500)  # its keeper died with it
    with pytest.raises(SessionBusy):
        b.acquire_turn(session_turn_lock("s"))
    deadline = time.monotonic() + 30
    while True:
        try:
            b.acquire_turn(session_turn_lock("s")).release()
            break
        except SessionBusy:
            assert time.monotonic() < deadline, "the lock never expired"
            time.sleep(0.1)


def test_a_live_turn_keeps_its_lock_past_the_lease(replicas) -> None:
    a, b = replicas(lease_s=0.6), replicas(lease_s=0.6)
    lease = a.acquire_turn(session_turn_lock("s"))
    time.sleep(1.5)  # more than two leases: only the renewals keep it
    with pytest.raises(SessionBusy):
        b.acquire_turn(session_turn_lock("s"))
    lease.release()


def test_a_write_under_a_lost_lock_is_refused_and_not_served(replicas, redis_server: RedisServer) -> None:  # noqa: F811
    a, b = replicas(), replicas()
    key = session_key("s")
    put_persisted(a, key, random_state(1))
    lease = a.acquire_turn(session_turn_lock("s"))
    redis.Redis.from_url(redis_server.url).set(b"albatross:lock:session:s", "another-replica")  # expired and taken
    a.put(key, random_state(2))
    with pytest.raises(BackendError) as refused:
        a.wait_persisted(key, timeout=30)
    assert refused.value.status_code == 503 and "lock was lost" in refused.value.message
    assert same(b.get(key), random_state(1)), "the store keeps the state of the last acknowledged turn"
    assert same(a.get(key), random_state(1)), "the refused state is not served from memory either"
    lease.release()


def test_prefix_states_stay_in_memory_and_never_reach_redis(replicas, redis_server: RedisServer) -> None:  # noqa: F811
    a = replicas()
    a.put(PREFIX_KEY, random_state(5))
    assert a.flush(timeout=30)
    client = redis.Redis.from_url(redis_server.url)
    assert client.keys(b"albatross:state:*") == []
    assert a.contains(PREFIX_KEY) and same(a.get(PREFIX_KEY), random_state(5))


def test_redis_down_fails_state_calls_with_503_and_prefix_states_keep_working(replicas, redis_server: RedisServer) -> None:  # noqa: F811
    a = replicas()
    put_persisted(a, session_key("s"), random_state(1))
    a.put(PREFIX_KEY, random_state(5))
    redis_server.stop()
    for call in (lambda: a.contains(session_key("s")), lambda: a.acquire_turn("session:x"), a.sessions, lambda: a.read_counter("n")):
        with pytest.raises(BackendError) as down:
            call()
        assert down.value.status_code == 503 and "unreachable" in down.value.message
    assert a.contains(PREFIX_KEY) and same(a.get(PREFIX_KEY), random_state(5)), "prefix states need no Redis"
    a.put(session_key("t"), random_state(2))
    with pytest.raises(BackendError) as unsaved:
        a.wait_persisted(session_key("t"), timeout=60)
    assert unsaved.value.status_code == 503
    redis_server.start()  # the outage ends: the client reconnects by itself
    assert a.contains(session_key("s"))
    assert not a.contains(session_key("t")), "the turn whose write failed was never stored"


def test_the_store_lease_and_drain_flags_parse_with_their_environment_twins() -> None:
    from runner.settings import settings_from_args

    settings = settings_from_args([], environ={"RWKV_STATE_STORE": "redis://127.0.0.1:6379/1", "RWKV_STATE_LOCK_LEASE": "12.5"})
    assert (settings.state_store, settings.state_lock_lease, settings.drain_timeout) == ("redis://127.0.0.1:6379/1", 12.5, 30.0)
    assert settings_from_args(["--state-store", "sqlite:////var/a.sqlite3", "--drain-timeout", "5"], environ={}).drain_timeout == 5.0
    for argv in (["--state-store", "postgres://x"], ["--state-store", "sqlite:///"], ["--drain-timeout", "0"], ["--state-lock-lease", "-1"]):
        with pytest.raises(SystemExit):
            settings_from_args(argv, environ={})
