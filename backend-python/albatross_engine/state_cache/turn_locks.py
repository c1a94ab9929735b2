"""Turn locks of one process: what a state store on a local SQLite file hands out.

A session (or a dialogue tree) runs one turn at a time. With SQLite the store belongs to one
process, so a lock is an entry in a set; it cannot outlive the process, so it needs no lease.
`redis_locks.py` is the twin shared by every replica of a Redis store.
"""

from __future__ import annotations

import threading

from runner.sessions import SessionBusy


class LocalLease:
    __slots__ = ("_owner", "name", "token", "released")

    def __init__(self, owner: LocalTurnLocks, name: str) -> None:
        self._owner = owner
        self.name = name
        self.token = ""  # local locks cannot be lost, so writes under them need no fencing token
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._owner._release(self.name)


class LocalTurnLocks:
    def __init__(self) -> None:
        self._held: set[str] = set()
        self._lock = threading.Lock()

    def acquire(self, name: str) -> LocalLease:
        with self._lock:
            if name in self._held:
                raise SessionBusy(name)
            self._held.add(name)
        return LocalLease(self, name)

    def held(self, name: str) -> bool:
        with self._lock:
            return name in self._held

    def _release(self, name: str) -> None:
        with self._lock:
            self._held.discard(name)

    def close(self) -> None:
        pass
