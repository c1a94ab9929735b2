"""L3: states in a SQLite file (WAL mode), one row per (model fingerprint, key).

Every write is one transaction (the row and the budget eviction together), so a crash leaves either
the old row or the new one. Two connections: one for writes (the writer thread, deletes, counters)
and one for reads, so a route or a worker reading a state does not wait behind a large write.

The file belongs to one server: its turn locks are in-process (`turn_locks.py`), and the only other
writers are that server's worker processes, which write prefix states alone (named by their content,
so never stale); the cache trusts its memory copies (`shared = False`). Those processes open the file
at the same moment, which is why the switch to WAL is retried (`_enter_wal`). `PRAGMA user_version`
numbers the key scheme; opening an older file migrates it (`key_migration.py`).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from pathlib import Path

from albatross_engine.state_cache.durable_tier import Fence
from albatross_engine.state_cache.key_migration import migrate_keys
from albatross_engine.state_cache.records import StoredRecord
from albatross_engine.state_cache.turn_locks import LocalTurnLocks

logger = logging.getLogger(__name__)

BUSY_TIMEOUT_S = 30.0  # how long a statement waits for another connection's lock

_SCHEMA = """
CREATE TABLE IF NOT EXISTS states (
    fingerprint TEXT NOT NULL,
    key TEXT NOT NULL,
    layout TEXT NOT NULL,
    dtype TEXT NOT NULL,
    nbytes INTEGER NOT NULL,
    checksum TEXT NOT NULL,
    payload BLOB NOT NULL,
    last_updated REAL NOT NULL,
    PRIMARY KEY (fingerprint, key)
);
CREATE INDEX IF NOT EXISTS states_by_age ON states (last_updated);
CREATE TABLE IF NOT EXISTS counters (
    fingerprint TEXT NOT NULL,
    name TEXT NOT NULL,
    value INTEGER NOT NULL,
    PRIMARY KEY (fingerprint, name)
);
"""


def _connect(path: Path) -> sqlite3.Connection:
    # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE ... COMMIT).
    connection = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
    try:
        _enter_wal(connection, path)
        connection.execute("PRAGMA synchronous=FULL")  # a committed turn survives an OS crash too
    except BaseException:
        connection.close()
        raise
    return connection


def _enter_wal(connection: sqlite3.Connection, path: Path, deadline_s: float = BUSY_TIMEOUT_S) -> None:
    """Puts the file in WAL mode, which it keeps. The switch needs the file to itself and SQLite
    answers SQLITE_BUSY at once, without its busy handler, while another connection opens the file
    (worker processes open the same file together: 1 open in 15 failed so with four threads), so
    a busy answer is retried here, for as long as any other statement would wait."""
    give_up = time.monotonic() + deadline_s
    pause = 0.001
    while True:
        try:
            (mode,) = connection.execute("PRAGMA journal_mode=WAL").fetchone()
            break
        except sqlite3.OperationalError as error:
            if not _is_busy(error) or time.monotonic() + pause > give_up:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    if str(mode).lower() != "wal":  # e.g. a file system without shared memory: the file still works, writers wait longer
        logger.warning("state cache %s: SQLite kept journal_mode=%s (WAL unavailable here)", path, mode)


def _is_busy(error: sqlite3.OperationalError) -> bool:
    code = getattr(error, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    return "locked" in str(error) or "busy" in str(error)


class SqliteTier:
    shared = False

    def __init__(self, path: Path, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError("the L3 budget must be >= 0 bytes")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.budget_bytes = budget_bytes
        self._write_connection = _connect(path)
        self._write_connection.executescript(_SCHEMA)
        migrate_keys(self._write_connection, path)
        self._read_connection = _connect(path)
        self._write_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self.location = str(path)
        self.locks = LocalTurnLocks()

    def close(self) -> None:
        with self._write_lock, self._read_lock:
            self._write_connection.close()
            self._read_connection.close()

    def write(self, fingerprint: str, record: StoredRecord, fence: Fence | None = None) -> list[tuple[str, str]]:
        """Stores the row and evicts the oldest rows (any model) past the budget, in one transaction.
        Returns the (fingerprint, key) pairs evicted; the new row itself is evicted when it alone
        exceeds the budget. `fence` needs no check: in-process locks cannot be lost."""
        with self._write_lock:
            connection = self._write_connection
            connection.execute("BEGIN IMMEDIATE")
            try:
                connection.execute(
                    "INSERT OR REPLACE INTO states (fingerprint, key, layout, dtype, nbytes, checksum, payload, last_updated)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (fingerprint, record.key, record.layout, record.dtype, record.nbytes, record.checksum, record.payload, record.last_updated),
                )
                evicted = self._evict_over_budget(connection)
                connection.execute("COMMIT")
            except BaseException:
                connection.execute("ROLLBACK")
                raise
        return evicted

    def _evict_over_budget(self, connection: sqlite3.Connection) -> list[tuple[str, str]]:
        (total,) = connection.execute("SELECT COALESCE(SUM(nbytes), 0) FROM states").fetchone()
        evicted: list[tuple[str, str]] = []
        if total <= self.budget_bytes:
            return evicted
        for fingerprint, key, nbytes in connection.execute("SELECT fingerprint, key, nbytes FROM states ORDER BY last_updated, rowid").fetchall():
            if total <= self.budget_bytes:
                break
            connection.execute("DELETE FROM states WHERE fingerprint = ? AND key = ?", (fingerprint, key))
            total -= nbytes
            evicted.append((fingerprint, key))
        return evicted

    def read(self, fingerprint: str, key: str) -> StoredRecord | None:
        with self._read_lock:
            row = self._read_connection.execute(
                "SELECT key, layout, dtype, nbytes, checksum, payload, last_updated FROM states WHERE fingerprint = ? AND key = ?",
                (fingerprint, key),
            ).fetchone()
        if row is None:
            return None
        return StoredRecord(key=row[0], layout=row[1], dtype=row[2], nbytes=row[3], checksum=row[4], payload=bytes(row[5]), last_updated=row[6])

    def checksum(self, fingerprint: str, key: str) -> str | None:
        with self._read_lock:
            row = self._read_connection.execute("SELECT checksum FROM states WHERE fingerprint = ? AND key = ?", (fingerprint, key)).fetchone()
        return None if row is None else str(row[0])

    def contains(self, fingerprint: str, key: str) -> bool:
        with self._read_lock:
            row = self._read_connection.execute("SELECT 1 FROM states WHERE fingerprint = ? AND key = ?", (fingerprint, key)).fetchone()
        return row is not None

    def list_keys(self, fingerprint: str) -> list[tuple[str, float]]:
        """(key, last_updated) of every row of this model."""
        with self._read_lock:
            rows = self._read_connection.execute("SELECT key, last_updated FROM states WHERE fingerprint = ? ORDER BY key", (fingerprint,)).fetchall()
        return [(key, last_updated) for key, last_updated in rows]

    def keys_with_prefix(self, fingerprint: str, prefix: str) -> list[str]:
        with self._read_lock:
            rows = self._read_connection.execute(
                "SELECT key FROM states WHERE fingerprint = ? AND substr(key, 1, ?) = ?", (fingerprint, len(prefix), prefix)
            ).fetchall()
        return [key for (key,) in rows]

    def count(self, fingerprint: str) -> int:
        with self._read_lock:
            (count,) = self._read_connection.execute("SELECT COUNT(*) FROM states WHERE fingerprint = ?", (fingerprint,)).fetchone()
        return int(count)

    def delete(self, fingerprint: str, keys: list[str]) -> int:
        if not keys:
            return 0
        with self._write_lock:
            connection = self._write_connection
            connection.execute("BEGIN IMMEDIATE")
            try:
                deleted = sum(connection.execute("DELETE FROM states WHERE fingerprint = ? AND key = ?", (fingerprint, key)).rowcount for key in keys)
                connection.execute("COMMIT")
            except BaseException:
                connection.execute("ROLLBACK")
                raise
        return deleted

    def read_counter(self, fingerprint: str, name: str) -> int:
        with self._read_lock:
            row = self._read_connection.execute("SELECT value FROM counters WHERE fingerprint = ? AND name = ?", (fingerprint, name)).fetchone()
        return 0 if row is None else int(row[0])

    def raise_counter(self, fingerprint: str, name: str, value: int) -> None:
        """Sets the counter to `value` unless it is already higher (counters never go back)."""
        with self._write_lock:
            self._write_connection.execute(
                "INSERT INTO counters (fingerprint, name, value) VALUES (?, ?, ?)"
                " ON CONFLICT (fingerprint, name) DO UPDATE SET value = MAX(value, excluded.value)",
                (fingerprint, name, value),
            )

    def delete_if_unchanged(self, fingerprint: str, key: str, row_checksum: str) -> bool:
        """Deletes the row only if it still holds the payload with `row_checksum` (drops a corrupt row
        without racing a fresh write of the same key)."""
        with self._write_lock:
            cursor = self._write_connection.execute(
                "DELETE FROM states WHERE fingerprint = ? AND key = ? AND checksum = ?", (fingerprint, key, row_checksum)
            )
        return cursor.rowcount > 0
