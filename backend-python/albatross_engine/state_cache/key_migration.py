"""Moves the keys of a state database written before sessions and dialogue nodes had separate key
spaces into those spaces (see `runner.sessions`), in one transaction, once.

Before, a session `X:1` and node 1 of dialogue tree `X` were the same row. A row `<s>:<n>` is taken
for a node when the database holds a numbering counter for tree `<s>` (`legacy_key_name`), for a
state session otherwise. Prefix-cache rows keep their keys.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

from runner.sessions import dialogue_counter_name, legacy_key_name

logger = logging.getLogger(__name__)

KEY_SCHEME_VERSION = 1  # PRAGMA user_version of a database whose keys are in their spaces
_COUNTER_PREFIX = dialogue_counter_name("")
_PARKED = "\x00"  # no key holds NUL (session ids refuse it): parks old keys while new ones are written


def migrate_keys(connection: sqlite3.Connection, path: Path) -> int:
    """Migrates the database behind `connection` (autocommit mode) if it is older than
    KEY_SCHEME_VERSION; returns the number of rows whose key changed."""
    (version,) = connection.execute("PRAGMA user_version").fetchone()
    if version >= KEY_SCHEME_VERSION:
        return 0
    connection.execute("BEGIN IMMEDIATE")
    try:
        counters: dict[str, dict[str, int]] = {}
        for fingerprint, name, value in connection.execute("SELECT fingerprint, name, value FROM counters"):
            if name.startswith(_COUNTER_PREFIX):
                counters.setdefault(fingerprint, {})[name[len(_COUNTER_PREFIX) :]] = int(value)
        moves: list[tuple[str, str, str]] = []
        for fingerprint, key in connection.execute("SELECT fingerprint, key FROM states").fetchall():
            name = legacy_key_name(key, counters.get(fingerprint, {}))
            if name is not None:
                moves.append((fingerprint, key, name.key))
        # Park every old key first, so that a new key can never meet an old row of the same text.
        connection.executemany("UPDATE states SET key = ? WHERE fingerprint = ? AND key = ?", [(_PARKED + old, fp, old) for fp, old, _ in moves])
        connection.executemany("UPDATE states SET key = ? WHERE fingerprint = ? AND key = ?", [(new, fp, _PARKED + old) for fp, old, new in moves])
        connection.execute(f"PRAGMA user_version = {KEY_SCHEME_VERSION}")
        connection.execute("COMMIT")
    except BaseException:
        connection.execute("ROLLBACK")
        raise
    if moves:
        nodes = sum(1 for _, _, new in moves if not new.startswith("session:"))
        logger.info("state cache %s: moved %d saved states into their key spaces (%d sessions, %d dialogue nodes)", path, len(moves), len(moves) - nodes, nodes)
    return len(moves)
