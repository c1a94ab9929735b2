"""Session bookkeeping for the state routes: one turn at a time per session, dialogue numbering.

Reservations live on the event loop; the numbering reads the state cache (SQLite), so routes call
`next_dialogue_index` in a thread.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any, Protocol


class SessionStateStore(Protocol):
    """What the state routes need from a backend's state cache
    (`albatross_engine.state_cache.StateCache` implements it)."""

    def contains(self, key: str) -> bool: ...

    def delete(self, key: str) -> bool: ...

    def delete_prefix(self, prefix: str) -> list[str]: ...

    def keys_with_prefix(self, prefix: str) -> set[str]: ...

    def read_counter(self, name: str) -> int: ...

    def raise_counter(self, name: str, value: int) -> None: ...

    def wait_persisted(self, key: str | None = None, timeout: float | None = None) -> bool: ...

    def sessions(self) -> Sequence[Any]:
        """Entries with `key`, `tier` ("L1", "L2" or "L3") and `last_updated` (epoch seconds)."""
        ...


class SessionBusy(Exception):
    """The session already has a turn in flight (the route answers 409)."""


class SessionReservation:
    """A session's turn in flight. `release()` is idempotent, so the owner can call it from every
    exit path (and a finalizer can too, for a stream whose body never ran)."""

    __slots__ = ("_owner", "key", "released")

    def __init__(self, owner: SessionReservations, key: str) -> None:
        self._owner = owner
        self.key = key
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._owner._busy.discard(self.key)


class SessionReservations:
    """One turn at a time per session. Reserving is synchronous (no await between the check and the
    mark), so two requests racing for one session cannot both pass."""

    def __init__(self) -> None:
        self._busy: set[str] = set()

    def busy(self, key: str) -> bool:
        return key in self._busy

    def reserve(self, key: str) -> SessionReservation:
        if key in self._busy:
            raise SessionBusy(key)
        self._busy.add(key)
        return SessionReservation(self, key)


def node_key(session_id: str, dialogue_idx: int) -> str:
    return f"{session_id}:{dialogue_idx}"


def dialogue_counter_name(session_id: str) -> str:
    return f"dialogue:{session_id}"


def highest_node_index(session_id: str, keys: Iterable[str]) -> int:
    """The largest n among keys `<session_id>:<n>` (0 when there is none)."""
    pattern = re.compile(re.escape(session_id) + r":([0-9]+)")
    indices = [int(match.group(1)) for key in keys if (match := pattern.fullmatch(key))]
    return max(indices, default=0)


def next_dialogue_index(store: SessionStateStore, session_id: str) -> int:
    """The number the session's next node gets: past both the durable counter (never reused after a
    restart or an eviction) and any node on record (a crash between saving a node and raising the
    counter). Blocking (SQLite): call it in a thread, under the session's lock."""
    counter = store.read_counter(dialogue_counter_name(session_id))
    return max(counter, highest_node_index(session_id, store.keys_with_prefix(f"{session_id}:"))) + 1


_MANAGEMENT_METHODS = ("contains", "delete", "delete_prefix", "keys_with_prefix", "sessions", "read_counter", "raise_counter", "wait_persisted")


def session_store_of(backend: object) -> SessionStateStore | None:
    """The backend's state cache when it keeps one the state routes can manage (the Albatross
    backend exposes it as `state_store`), else None."""
    store = getattr(backend, "state_store", None)
    if store is None or not all(callable(getattr(store, name, None)) for name in _MANAGEMENT_METHODS):
        return None
    return store
