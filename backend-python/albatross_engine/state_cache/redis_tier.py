"""L3 in Redis, shared by every replica: state sessions, dialogue nodes, their numbering and the turn
locks live here, so any replica can continue any session.

Layout (one logical database, every key under `albatross:`):
- `state:<fingerprint>:<key>` a hash: layout, dtype, nbytes, checksum, payload, last_updated (the
  same record as a SQLite row, checked the same way when read back);
- `keys:<fingerprint>` a sorted set of the model's keys, all at score 0 (listing by prefix is a
  lexicographic range);
- `age` a sorted set of `<fingerprint>\\n<key>` by last_updated, and `bytes` the total payload size:
  the byte budget evicts the oldest records of any model, as SQLite's does;
- `counters:<fingerprint>` a hash of counters that only rise;
- `lock:<name>` turn locks (`redis_locks.py`).

Every change of a record runs as one Lua script, so a write and its eviction, or a delete and its
index updates, are atomic, and a write under a lost turn lock is refused (fencing). This needs a
standalone Redis (or one primary), not Redis Cluster: the scripts touch keys they compute.

Redis unreachable: every call raises `BackendError(503)`, at once for a refused connection and after
SOCKET_TIMEOUT_S for one that hangs. Nothing here runs on the engine's step path unless a state
misses memory, and prefix-cache states never come here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import redis

from albatross_engine.state_cache.durable_tier import Fence
from albatross_engine.state_cache.records import StoredRecord
from albatross_engine.state_cache.redis_locks import RedisTurnLocks
from runner.interface import BackendError

logger = logging.getLogger(__name__)

NAMESPACE = "albatross:"
CONNECT_TIMEOUT_S = 2.0
SOCKET_TIMEOUT_S = 10.0  # a 7.2B state is 32 MB: reading one over a slow link takes a while
FENCED = "FENCED"

T = TypeVar("T")

# KEYS: state, keys index, age index, bytes total, lock (or a dummy). ARGV: fingerprint, key,
# layout, dtype, nbytes, checksum, payload, last_updated, budget, fence token ("" = unfenced),
# namespace. Returns the evicted "<fingerprint>\n<key>" members.
_WRITE = """
if ARGV[10] ~= '' and redis.call('GET', KEYS[5]) ~= ARGV[10] then
  return redis.error_reply('FENCED the turn lock was lost before the state was stored')
end
local old = redis.call('HGET', KEYS[1], 'nbytes')
if old then redis.call('DECRBY', KEYS[4], old) end
redis.call('HSET', KEYS[1], 'layout', ARGV[3], 'dtype', ARGV[4], 'nbytes', ARGV[5], 'checksum', ARGV[6],
           'payload', ARGV[7], 'last_updated', ARGV[8])
redis.call('ZADD', KEYS[2], 0, ARGV[2])
redis.call('ZADD', KEYS[3], ARGV[8], ARGV[1] .. '\\n' .. ARGV[2])
local total = redis.call('INCRBY', KEYS[4], ARGV[5])
local budget = tonumber(ARGV[9])
local evicted = {}
while total > budget do
  local oldest = redis.call('ZRANGE', KEYS[3], 0, 0)
  if #oldest == 0 then break end
  local member = oldest[1]
  local cut = string.find(member, '\\n', 1, true)
  local fingerprint, key = string.sub(member, 1, cut - 1), string.sub(member, cut + 1)
  local state = ARGV[11] .. 'state:' .. fingerprint .. ':' .. key
  local size = redis.call('HGET', state, 'nbytes')
  redis.call('DEL', state)
  redis.call('ZREM', KEYS[3], member)
  redis.call('ZREM', ARGV[11] .. 'keys:' .. fingerprint, key)
  if size then total = redis.call('DECRBY', KEYS[4], size) end
  table.insert(evicted, member)
end
return evicted
"""

# KEYS: state, keys index, age index, bytes total. ARGV: key, member, required checksum ("" = any).
_DELETE = """
local size = redis.call('HGET', KEYS[1], 'nbytes')
if not size then return 0 end
if ARGV[3] ~= '' and redis.call('HGET', KEYS[1], 'checksum') ~= ARGV[3] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('DECRBY', KEYS[4], size)
return 1
"""

_RAISE_COUNTER = """
local current = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if tonumber(ARGV[2]) > current then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
return 1
"""

_RECORD_FIELDS = (b"layout", b"dtype", b"nbytes", b"checksum", b"payload", b"last_updated")


def _text(value: str) -> bytes:
    # Keys come from clients: a lone surrogate must not make a key unwritable.
    return value.encode("utf-8", "surrogatepass")


def _untext(value: bytes) -> str:
    return value.decode("utf-8", "surrogatepass")


def redacted(url: str) -> str:
    """The URL without its password, for logs and error messages."""
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    return f"{scheme}{sep}{credentials.split(':')[0] + ':***@' if at else ''}{host}"


class RedisTier:
    shared = True

    def __init__(self, url: str, budget_bytes: int, lock_lease_s: float = 30.0, client: redis.Redis | None = None) -> None:
        if budget_bytes < 0:
            raise ValueError("the L3 budget must be >= 0 bytes")
        self.budget_bytes = budget_bytes
        self.location = redacted(url)
        # Any: redis-py types every reply as bytes | str | ... whatever the connection decodes; ours
        # never decodes (payloads are binary), so replies are bytes, ints and lists of them.
        self._client: Any = client or redis.Redis.from_url(
            url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=SOCKET_TIMEOUT_S, health_check_interval=30
        )
        self._write_script = self._client.register_script(_WRITE)
        self._delete_script = self._client.register_script(_DELETE)
        self._raise_script = self._client.register_script(_RAISE_COUNTER)
        self.locks = RedisTurnLocks(self._client, lock_lease_s, self._call, NAMESPACE + "lock:")

    # ---- keys -------------------------------------------------------------------------------------

    @staticmethod
    def _state(fingerprint: str, key: str) -> bytes:
        return _text(f"{NAMESPACE}state:{fingerprint}:{key}")

    @staticmethod
    def _index(fingerprint: str) -> bytes:
        return _text(f"{NAMESPACE}keys:{fingerprint}")

    @staticmethod
    def _member(fingerprint: str, key: str) -> bytes:
        return _text(f"{fingerprint}\n{key}")

    _AGE = _text(NAMESPACE + "age")
    _BYTES = _text(NAMESPACE + "bytes")

    # ---- errors -----------------------------------------------------------------------------------

    def _call(self, what: str, operation: Callable[[], T]) -> T:
        with self._unavailable_as_503(what):
            return operation()

    @contextmanager
    def _unavailable_as_503(self, what: str) -> Iterator[None]:
        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError) as error:
            raise BackendError(503, f"the state store at {self.location} is unreachable ({what}): {error}") from error
        except redis.ResponseError as error:
            if str(error).startswith(FENCED):
                raise BackendError(409, str(error)[len(FENCED) :].strip()) from error
            raise BackendError(503, f"the state store at {self.location} refused {what}: {error}") from error

    # ---- records ----------------------------------------------------------------------------------

    def write(self, fingerprint: str, record: StoredRecord, fence: Fence | None = None) -> list[tuple[str, str]]:
        lock_key = self.locks.key_of(fence.lock_name) if fence is not None else self._BYTES  # any key: unused unfenced
        keys = [self._state(fingerprint, record.key), self._index(fingerprint), self._AGE, self._BYTES, lock_key]
        args: list[Any] = [
            fingerprint, _text(record.key), record.layout, record.dtype, record.nbytes, record.checksum, record.payload,
            repr(record.last_updated), self.budget_bytes, fence.token if fence is not None else "", NAMESPACE,
        ]
        evicted = self._call("a state write", lambda: self._write_script(keys=keys, args=args))
        pairs = []
        for member in evicted:
            evicted_fingerprint, _, key = _untext(member).partition("\n")
            pairs.append((evicted_fingerprint, key))
        return pairs

    def read(self, fingerprint: str, key: str) -> StoredRecord | None:
        values = self._call("a state read", lambda: self._client.hmget(self._state(fingerprint, key), _RECORD_FIELDS))
        if any(v is None for v in values):
            return None
        layout, dtype, nbytes, row_checksum, payload, last_updated = values
        return StoredRecord(
            key=key, layout=layout.decode(), dtype=dtype.decode(), nbytes=int(nbytes), checksum=row_checksum.decode(),
            payload=bytes(payload), last_updated=float(last_updated),
        )

    def checksum(self, fingerprint: str, key: str) -> str | None:
        value = self._call("a state lookup", lambda: self._client.hget(self._state(fingerprint, key), "checksum"))
        return None if value is None else value.decode()

    def contains(self, fingerprint: str, key: str) -> bool:
        return bool(self._call("a state lookup", lambda: self._client.exists(self._state(fingerprint, key))))

    def list_keys(self, fingerprint: str) -> list[tuple[str, float]]:
        def listing() -> list[tuple[str, float]]:
            keys = self._client.zrange(self._index(fingerprint), 0, -1)
            if not keys:
                return []
            scores = self._client.zmscore(self._AGE, [_text(f"{fingerprint}\n") + k for k in keys])
            return [(_untext(k), float(s)) for k, s in zip(keys, scores) if s is not None]

        return self._call("listing states", listing)

    def keys_with_prefix(self, fingerprint: str, prefix: str) -> list[str]:
        low = b"[" + _text(prefix)
        high = b"[" + _text(prefix) + b"\xff"  # 0xff never occurs in UTF-8: past every key with the prefix
        keys = self._call("listing states", lambda: self._client.zrangebylex(self._index(fingerprint), low, high))
        return [_untext(k) for k in keys]

    def count(self, fingerprint: str) -> int:
        return int(self._call("counting states", lambda: self._client.zcard(self._index(fingerprint))))

    def delete(self, fingerprint: str, keys: list[str]) -> int:
        return sum(self._delete(fingerprint, key, "") for key in keys)

    def delete_if_unchanged(self, fingerprint: str, key: str, row_checksum: str) -> bool:
        return bool(self._delete(fingerprint, key, row_checksum))

    def _delete(self, fingerprint: str, key: str, required_checksum: str) -> int:
        keys = [self._state(fingerprint, key), self._index(fingerprint), self._AGE, self._BYTES]
        args: list[Any] = [_text(key), self._member(fingerprint, key), required_checksum]
        return int(self._call("a state delete", lambda: self._delete_script(keys=keys, args=args)))

    # ---- counters ---------------------------------------------------------------------------------

    def read_counter(self, fingerprint: str, name: str) -> int:
        value = self._call("a counter read", lambda: self._client.hget(_text(f"{NAMESPACE}counters:{fingerprint}"), _text(name)))
        return 0 if value is None else int(value)

    def raise_counter(self, fingerprint: str, name: str, value: int) -> None:
        key = _text(f"{NAMESPACE}counters:{fingerprint}")
        self._call("a counter update", lambda: self._raise_script(keys=[key], args=[_text(name), value]))

    def close(self) -> None:
        self._client.close()
