"""Session bookkeeping for the state routes: the key spaces of saved states, one turn at a time per
session, dialogue numbering.

Key spaces. A state session and a `multi_state` dialogue tree are different things that clients
name with the same `session_id` text, and a dialogue node's public name `<session_id>:<n>` is also a
valid session id. So each kind has its own key space in the state store: `session:<session_id>`
for a state session, `node:<session_id>:<n>` for node n of a tree (prompt-prefix states are
`prefix:<sha256>`, the engine's). `node:<s>:<n>` reads back unambiguously because n is digits and
the session id is everything before the last colon.

Turns. The state store hands out turn locks (`acquire_turn`): in-process for SQLite, leases in
Redis shared by every replica. Numbering reads the store, so routes call `next_dialogue_index` in a
thread.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

SESSION_SPACE = "session:"
NODE_SPACE = "node:"
TREE_LOCK_SPACE = "tree:"  # the lock of a whole dialogue tree (numbering), not a state key

StateKind = Literal["session", "dialogue_node"]


def session_key(session_id: str) -> str:
    return SESSION_SPACE + session_id


def node_key(session_id: str, dialogue_idx: int) -> str:
    return f"{NODE_SPACE}{session_id}:{dialogue_idx}"


def node_space(session_id: str) -> str:
    """The prefix of the session's node keys. It also starts the nodes of a session named
    `<session_id>:...`, so whatever lists by it filters with `node_index`."""
    return f"{NODE_SPACE}{session_id}:"


def node_index(key: str, session_id: str) -> int | None:
    """n when `key` is node n of `session_id` (and of no other session), else None."""
    space = node_space(session_id)
    if not key.startswith(space):
        return None
    rest = key[len(space) :]
    return int(rest) if rest.isdigit() and rest.isascii() else None


@dataclass(frozen=True, slots=True)
class StateName:
    """What a state key means to a client."""

    kind: StateKind
    session_id: str
    dialogue_idx: int | None = None

    @property
    def public(self) -> str:
        """The name the API shows: the session id, or `<session_id>:<n>` for a node."""
        return self.session_id if self.dialogue_idx is None else f"{self.session_id}:{self.dialogue_idx}"

    @property
    def key(self) -> str:
        return session_key(self.session_id) if self.dialogue_idx is None else node_key(self.session_id, self.dialogue_idx)


def parse_state_key(key: str) -> StateName | None:
    """The session or node a key holds; None for a prefix-cache state or any other key."""
    if key.startswith(SESSION_SPACE):
        return StateName("session", key[len(SESSION_SPACE) :])
    if key.startswith(NODE_SPACE):
        session_id, sep, number = key[len(NODE_SPACE) :].rpartition(":")
        if sep and number.isdigit() and number.isascii():
            return StateName("dialogue_node", session_id, int(number))
    return None


def names_of(public_name: str) -> list[StateName]:
    """Every state a client-given name can mean: the state session of that name and, when the name
    reads `<s>:<n>`, node n of s (the name the stream event gave that node)."""
    names = [StateName("session", public_name)]
    session_id, sep, number = public_name.rpartition(":")
    if sep and number.isdigit() and number.isascii():
        names.append(StateName("dialogue_node", session_id, int(number)))
    return names


def session_turn_lock(session_id: str) -> str:
    return session_key(session_id)


def tree_turn_lock(session_id: str) -> str:
    return TREE_LOCK_SPACE + session_id


def turn_lock_of(key: str) -> str | None:
    """The turn lock a write of `key` happens under (a session's own, a node's tree's), or None."""
    name = parse_state_key(key)
    if name is None:
        return None
    return session_turn_lock(name.session_id) if name.dialogue_idx is None else tree_turn_lock(name.session_id)


class SessionBusy(Exception):
    """The session already has a turn in flight (the route answers 409)."""


class TurnLease(Protocol):
    """A turn lock held. `release()` is idempotent. On an event loop it never blocks (a finalizer
    may call it) and may complete a moment later; from a thread the lock is free once it returns."""

    def release(self) -> None: ...


class SessionStateStore(Protocol):
    """What the state routes need from a backend's state cache
    (`albatross_engine.state_cache.StateCache` implements it). Calls may block (disk, network):
    routes make them in a thread. A store that cannot reach its storage raises
    `runner.interface.BackendError(503)`."""

    def contains(self, key: str) -> bool: ...

    def delete(self, key: str) -> bool: ...

    def keys_with_prefix(self, prefix: str) -> set[str]: ...

    def read_counter(self, name: str) -> int: ...

    def raise_counter(self, name: str, value: int) -> None: ...

    def wait_persisted(self, key: str | None = None, timeout: float | None = None) -> bool: ...

    def acquire_turn(self, lock_name: str) -> TurnLease:
        """Raises SessionBusy when another turn (on any replica sharing the store) holds it."""
        ...

    def sessions(self) -> Sequence[Any]:
        """Entries with `key`, `tier` ("L1", "L2" or "L3") and `last_updated` (epoch seconds)."""
        ...


def dialogue_counter_name(session_id: str) -> str:
    return f"dialogue:{session_id}"


def highest_node_index(session_id: str, keys: Iterable[str]) -> int:
    """The largest n among the keys of the session's nodes (0 when there is none)."""
    return max((n for key in keys if (n := node_index(key, session_id)) is not None), default=0)


def next_dialogue_index(store: SessionStateStore, session_id: str) -> int:
    """The number the session's next node gets: past both the durable counter (never reused after a
    restart or an eviction) and any node on record (a crash between saving a node and raising the
    counter). Blocking: call it in a thread, under the tree's turn lock."""
    counter = store.read_counter(dialogue_counter_name(session_id))
    return max(counter, highest_node_index(session_id, store.keys_with_prefix(node_space(session_id)))) + 1


_MANAGEMENT_METHODS = ("contains", "delete", "keys_with_prefix", "sessions", "read_counter", "raise_counter", "wait_persisted", "acquire_turn")


def session_store_of(backend: object) -> SessionStateStore | None:
    """The backend's state cache when it keeps one the state routes can manage (the Albatross
    backend exposes it as `state_store`), else None."""
    store = getattr(backend, "state_store", None)
    if store is None or not all(callable(getattr(store, name, None)) for name in _MANAGEMENT_METHODS):
        return None
    return store


LEGACY_NODE = re.compile(r"(?s)(.*):([0-9]+)")


def legacy_key_name(key: str, dialogue_counters: dict[str, int]) -> StateName | None:
    """What a key of the single key space used before sessions and nodes were separated meant.

    `<s>:<n>` was a dialogue node when the tree `<s>` has a numbering counter (every acknowledged
    node raised it; n may be one past it when a crash came between the save and the raise), else a
    state session of that name. Prefix-cache keys (`prefix:`) are not names: None."""
    if key.startswith("prefix:"):
        return None
    match = LEGACY_NODE.fullmatch(key)
    if match is not None:
        session_id, number = match.group(1), int(match.group(2))
        counter = dialogue_counters.get(session_id)
        if counter is not None and number <= counter + 1:
            return StateName("dialogue_node", session_id, number)
    return StateName("session", key)
