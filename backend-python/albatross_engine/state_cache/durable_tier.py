"""L3, the tier that outlives the process: what `StateCache` needs from it.

Two implementations: `SqliteTier` (a local file, one process) and `RedisTier` (shared by every
replica). Both store one record per (model fingerprint, key), evict the oldest records past a byte
budget in the same transaction as a write, keep per-model counters that only rise, and hand out
turn locks. A shared tier (`shared = True`) may be changed by other processes at any time, so the
cache checks its memory copies against it (checksums) and keeps prefix-cache states out of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from albatross_engine.state_cache.records import StoredRecord
from runner.sessions import TurnLease


@dataclass(frozen=True, slots=True)
class Fence:
    """A write made under a turn lock: a shared tier refuses it once that lock is no longer held
    with this token (the lease expired and another replica may have taken the turn)."""

    lock_name: str
    token: str


class TurnLocks(Protocol):
    def acquire(self, name: str) -> TurnLease: ...

    def close(self) -> None: ...


class DurableTier(Protocol):
    @property
    def shared(self) -> bool: ...

    @property
    def location(self) -> str:
        """For log lines and error messages (a path, or a URL without its password)."""
        ...

    @property
    def locks(self) -> TurnLocks: ...

    def write(self, fingerprint: str, record: StoredRecord, fence: Fence | None = None) -> list[tuple[str, str]]:
        """Stores the record and evicts the oldest (any model) past the budget, atomically.
        Returns the (fingerprint, key) pairs evicted (possibly the new record itself)."""
        ...

    def read(self, fingerprint: str, key: str) -> StoredRecord | None: ...

    def checksum(self, fingerprint: str, key: str) -> str | None:
        """The stored record's checksum, None when there is none (cheaper than `read`)."""
        ...

    def contains(self, fingerprint: str, key: str) -> bool: ...

    def list_keys(self, fingerprint: str) -> list[tuple[str, float]]: ...

    def keys_with_prefix(self, fingerprint: str, prefix: str) -> list[str]: ...

    def delete(self, fingerprint: str, keys: list[str]) -> int: ...

    def delete_if_unchanged(self, fingerprint: str, key: str, row_checksum: str) -> bool: ...

    def read_counter(self, fingerprint: str, name: str) -> int: ...

    def raise_counter(self, fingerprint: str, name: str, value: int) -> None: ...

    def close(self) -> None: ...
