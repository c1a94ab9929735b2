"""A byte-budgeted LRU map of cached states (one instance per memory tier: L1 device, L2 host).

Not thread-safe on its own: the tiered cache calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from albatross_engine.state_cache.records import CachedEntry


class LruTier:
    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError("a tier budget must be >= 0 bytes")
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[str, CachedEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def keys(self) -> list[str]:
        return list(self._entries)

    def items(self) -> list[tuple[str, CachedEntry]]:
        return list(self._entries.items())

    def touch(self, key: str) -> CachedEntry | None:
        """The entry, marked most recently used."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def insert(self, key: str, entry: CachedEntry) -> None:
        self.pop(key)
        self._entries[key] = entry
        self.used_bytes += entry.nbytes

    def pop(self, key: str) -> CachedEntry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.used_bytes -= entry.nbytes
        return entry

    def pop_oldest(self) -> tuple[str, CachedEntry] | None:
        """Removes and returns the least recently used entry (None when empty)."""
        if not self._entries:
            return None
        key, entry = self._entries.popitem(last=False)
        self.used_bytes -= entry.nbytes
        return key, entry

    def evict_over_budget(self) -> Iterator[tuple[str, CachedEntry]]:
        """Removes and yields least recently used entries until the tier fits its budget."""
        while self._entries and self.used_bytes > self.budget_bytes:
            key, entry = self._entries.popitem(last=False)
            self.used_bytes -= entry.nbytes
            yield key, entry
