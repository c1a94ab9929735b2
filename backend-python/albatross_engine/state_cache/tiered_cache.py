"""The tiered state cache: L1 on the model's device, L2 in host RAM, L3 durable (SQLite or Redis).

Implements the engine's `StateStore` protocol (get / put / contains) plus what the state routes
need (delete, delete_prefix, sessions, counters, turn locks, flush).

Durability policy: a session key (anything but `prefix:...`) is written through: `put` places the
state in L1 and queues it for the writer thread, which commits it to L3 in one transaction, so a
crash loses at most the turns whose write was still queued; `wait_persisted(key)` lets a route reply
only after its turn is stored, and raises when the write failed (the memory copy is dropped then,
so the cache never serves a state that L3 does not hold). Prefix-cache keys are written back: they
reach a local L3 only on `flush()` (shutdown), and one that falls out of L2 is dropped, because
losing it costs recomputation, never correctness, while writing it under load would cost gigabytes
of disk traffic. A shared L3 (Redis) never holds prefix states: they stay per process.

A shared L3 can change under this process (another replica's turn or delete), so `contains(key)` of
a session key compares the memory copy's checksum with L3's and reloads a stale copy: the state
routes call it before every turn, under the turn lock, so the worker's `get` then hits memory.

Copy-on-read and copy-on-write: `put` stores a copy and `get` returns a copy, so a running slot never
shares memory with a cached entry. Cached states are never mutated in place, which is what lets the
writer thread serialise an entry without holding the cache lock.

Lock order (never reversed): `_disk_order` -> `_lock` -> the SQLite tier's own locks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, cast

import torch

from albatross_engine.state_cache.durable_tier import DurableTier, Fence
from albatross_engine.state_cache.host_slab import HostSlab
from albatross_engine.state_cache.memory_tier import LruTier
from albatross_engine.state_cache.records import (
    CacheEntryInfo,
    CachedEntry,
    SerializableState,
    StateT,
    StoredRecord,
    checksum,
    copy_into,
    copy_state,
    copy_to_host,
    state_dtype,
    state_layout,
    state_nbytes,
    tensor_fields,
)
from albatross_engine.state_cache.sqlite_tier import SqliteTier
from runner.interface import PREFIX_CACHE_KEY_PREFIX, BackendError
from runner.sessions import TurnLease, turn_lock_of

logger = logging.getLogger(__name__)

_CPU = torch.device("cpu")


def is_session_key(key: str) -> bool:
    """Session states are written through to disk; prefix-cache states are written back."""
    return not key.startswith(PREFIX_CACHE_KEY_PREFIX)


def _default_state_type() -> type[SerializableState]:
    from albatross.state import SlotState

    return SlotState


@dataclass(slots=True)
class _WriteJob:
    key: str
    state: SerializableState  # a private CPU copy, never mutated
    last_updated: float
    landed: torch.cuda.Event | None = None  # the copy is complete once this has (None: already)
    seq: int = 0  # the put it comes from (CachedEntry.seq)
    fence: Fence | None = None


@dataclass(slots=True)
class CacheStats:
    l1_hits: int = 0
    l2_hits: int = 0
    l3_hits: int = 0
    prefix_dropped: int = 0
    misses: int = 0
    puts: int = 0
    disk_writes: int = 0
    disk_write_errors: int = 0
    corrupt_rows_dropped: int = 0
    disk_evictions: int = 0
    stale_copies_dropped: int = 0  # memory copies a shared L3 had changed or deleted


class _FencedLease:
    """A turn lease whose token fences the writes made under it; releasing forgets the token."""

    __slots__ = ("_cache", "_lease", "name")

    def __init__(self, cache: StateCache, name: str, lease: TurnLease) -> None:
        self._cache, self._lease, self.name = cache, lease, name

    def release(self) -> None:
        self._cache._forget_fence(self.name, self._lease)
        self._lease.release()


class StateCache(Generic[StateT]):
    """States of one type (`state_type`, default `SlotState`) keyed by text, for one model."""

    def __init__(
        self,
        store: str | Path | DurableTier,
        fingerprint: str,
        *,
        device: str | torch.device = "cpu",
        l1_bytes: int = 1 << 30,
        l2_bytes: int = 4 << 30,
        l3_bytes: int = 32 << 30,
        state_type: type[StateT] | None = None,
        write_through: Callable[[str], bool] = is_session_key,
    ) -> None:
        if not fingerprint:
            raise ValueError("a state cache needs the model's fingerprint")
        self.fingerprint = fingerprint
        self.device = torch.device(device)
        self._l3: DurableTier = SqliteTier(Path(store), l3_bytes) if isinstance(store, (str, Path)) else store
        self.location = self._l3.location
        # Every state held here was put as, or decoded into, this type (hence the casts in get).
        self._state_type = cast("type[StateT]", state_type if state_type is not None else _default_state_type())
        self._write_through = write_through
        self._l1 = LruTier(l1_bytes)
        self._l2 = LruTier(l2_bytes)
        # States demoted from a GPU land in one page-locked arena (host_slab.py), never in memory
        # allocated on the engine's thread.
        self._slab = HostSlab(l2_bytes) if self.device.type == "cuda" and l2_bytes > 0 else None
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._disk_order = threading.Lock()
        self._pending: dict[str, _WriteJob] = {}  # the newest queued disk write of each key
        self._failed: dict[str, str] = {}  # keys whose newest write failed -> why
        self._fences: dict[str, tuple[TurnLease, str]] = {}  # turn lock name -> (lease, token)
        self._seq = 0
        self._queue: queue.SimpleQueue[_WriteJob | None] = queue.SimpleQueue()
        self._stats = CacheStats()
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="state-cache-writer", daemon=True)
        self._writer.start()
        logger.info(
            "state cache at %s (model %s): L1 %d bytes on %s, L2 %d bytes, L3 %d bytes",
            self.location, fingerprint[:12], l1_bytes, self.device, l2_bytes, l3_bytes,
        )

    @property
    def shared(self) -> bool:
        """L3 is shared with other processes (Redis)."""
        return self._l3.shared

    def _on_l3(self, key: str) -> bool:
        """Whether L3 may hold the key: every key on a local L3, only session keys on a shared one."""
        return not self._l3.shared or self._write_through(key)

    # ---- StateStore protocol -------------------------------------------------------------------

    def get(self, key: str) -> Any | None:
        """A private copy of the state on the cache's device, or None. A hit moves the entry to L1."""
        with self._lock:
            entry = self._l1.touch(key)
            if entry is not None:
                self._stats.l1_hits += 1
                return copy_state(entry.state, self.device)
            entry = self._l2.pop(key)
            if entry is not None:
                self._stats.l2_hits += 1
                return self._promote(key, entry.state, entry.last_updated, dirty=entry.dirty, landed=entry.landed, leaving=entry)
            job = self._pending.get(key)
            if job is not None:
                self._stats.l2_hits += 1
                return self._promote(key, job.state, job.last_updated, dirty=False, landed=job.landed, seq=job.seq)
            if not self._on_l3(key):
                self._stats.misses += 1
                return None
        return self._load_from_l3(key)

    def _load_from_l3(self, key: str) -> Any | None:
        """Reads outside the lock (a large or remote read must not hold up the engine's cache calls)."""
        record = self._l3.read(self.fingerprint, key)
        state = None if record is None else self._decode(record)
        with self._lock:
            if record is None or state is None:
                self._stats.misses += 1
                return None
            if key in self._l1 or key in self._l2 or key in self._pending:  # a put raced the read: it is newer
                return self.get(key)
            self._stats.l3_hits += 1
            return self._promote(key, state, record.last_updated, dirty=False, checksum=record.checksum)

    def put(self, key: str, state: Any) -> None:
        cached = copy_state(state, self.device)
        now = time.time()
        durable = self._write_through(key)
        with self._lock:
            self._check_open()
            self._stats.puts += 1
            self._seq += 1
            self._failed.pop(key, None)
            self._release(self._l2.pop(key))
            self._l1.insert(key, CachedEntry(cached, state_nbytes(cached), now, dirty=not durable, seq=self._seq))
            if durable:
                self._enqueue(key, cached, now, seq=self._seq)
            self._rebalance()

    def contains(self, key: str) -> bool:
        """Whether a state is saved under `key`. On a shared L3, a session key is checked against L3
        (a stale memory copy is dropped) and a state found only there is brought into memory."""
        if self._l3.shared and self._write_through(key):
            return self._revalidate(key)
        with self._lock:
            if key in self._l1 or key in self._l2 or key in self._pending:
                return True
        return self._on_l3(key) and self._l3.contains(self.fingerprint, key)

    def _revalidate(self, key: str) -> bool:
        with self._lock:
            if key in self._pending:  # this process's own write, newer than what L3 holds yet
                return True
        current = self._l3.checksum(self.fingerprint, key)
        with self._lock:
            if key in self._pending:
                return True
            entry = self._l1.touch(key) or self._l2.touch(key)
            if entry is not None and current is not None and entry.checksum == current:
                return True
            if entry is not None:
                self._stats.stale_copies_dropped += 1
                self._release(self._l2.pop(key))
                self._l1.pop(key)
        return current is not None and self._load_from_l3(key) is not None

    # ---- management (state routes, shutdown) ----------------------------------------------------

    def delete(self, key: str) -> bool:
        """Removes the key from every tier. True when some tier held it."""
        return bool(self._delete_keys([key]))

    def delete_prefix(self, prefix: str) -> list[str]:
        """Removes every key starting with `prefix` from every tier; returns the keys removed."""
        if not prefix:
            raise ValueError("delete_prefix needs a non-empty prefix")
        return self._delete_keys(sorted(self.keys_with_prefix(prefix)))

    def keys_with_prefix(self, prefix: str) -> set[str]:
        with self._lock:
            keys = {k for k in (*self._l1.keys(), *self._l2.keys(), *self._pending) if k.startswith(prefix)}
        keys.update(self._l3.keys_with_prefix(self.fingerprint, prefix))
        return keys

    def sessions(self) -> list[CacheEntryInfo]:
        """Every key once, at the fastest tier holding it (a queued write counts as host RAM). On a
        shared L3 a session key is listed only while L3 (or this process's queued write) holds it:
        another replica may have deleted it since this process cached it."""
        on_l3 = self._l3.list_keys(self.fingerprint)
        stored = {key for key, _ in on_l3}
        listed: dict[str, CacheEntryInfo] = {}
        with self._lock:
            for key, job in self._pending.items():
                listed[key] = CacheEntryInfo(key, "L2", job.last_updated)
            for tier_name, tier in (("L1", self._l1), ("L2", self._l2)):
                for key, entry in tier.items():
                    if key in listed and listed[key].tier == "L1":
                        continue
                    if self._l3.shared and self._write_through(key) and key not in stored and key not in self._pending:
                        continue
                    if tier_name == "L1" or key not in listed:
                        listed[key] = CacheEntryInfo(key, tier_name, entry.last_updated)  # type: ignore[arg-type]
        for key, last_updated in on_l3:
            listed.setdefault(key, CacheEntryInfo(key, "L3", last_updated))
        return sorted(listed.values(), key=lambda info: info.key)

    def read_counter(self, name: str) -> int:
        """A durable per-model counter (0 when never set); dialogue numbering uses it."""
        return self._l3.read_counter(self.fingerprint, name)

    def raise_counter(self, name: str, value: int) -> None:
        self._l3.raise_counter(self.fingerprint, name, value)

    def acquire_turn(self, lock_name: str) -> TurnLease:
        """The turn lock `lock_name` (runner.sessions names them), from L3: in-process for SQLite, a
        lease every replica sees for Redis. Raises SessionBusy when it is held. Writes of keys under
        it carry its token, so a shared L3 refuses them once the lease is lost."""
        lease = self._l3.locks.acquire(lock_name)
        token = getattr(lease, "token", "")
        if token:
            with self._lock:
                self._fences[lock_name] = (lease, token)
        return _FencedLease(self, lock_name, lease)

    def _forget_fence(self, lock_name: str, lease: TurnLease) -> None:
        with self._lock:
            held = self._fences.get(lock_name)
            if held is not None and held[0] is lease:
                del self._fences[lock_name]

    def wait_persisted(self, key: str | None = None, timeout: float | None = None) -> bool:
        """Blocks until the queued write of `key` (of every key when None) is done; False on timeout.
        Raises BackendError(503) when the newest write of `key` failed: the turn is not saved."""
        with self._changed:
            if key is None:
                return self._changed.wait_for(lambda: not self._pending, timeout)
            if not self._changed.wait_for(lambda: key not in self._pending, timeout):
                return False
            reason = self._failed.get(key)
        if reason is not None:
            raise BackendError(503, f"the state {key!r} could not be saved to {self.location}: {reason}")
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Writes every memory entry that is not on disk yet and waits for the writes (shutdown)."""
        with self._lock:
            for tier in (self._l1, self._l2):
                for key, entry in tier.items():
                    if entry.dirty and self._on_l3(key):
                        entry.dirty = False
                        self._enqueue(key, entry.state, entry.last_updated, entry.landed, borrowed=entry.slot is not None, seq=entry.seq)
        return self.wait_persisted(timeout=timeout)

    def close(self, timeout: float | None = None) -> None:
        """Flushes, stops the writer thread and closes the database. Idempotent. `timeout`: the
        seconds the flush may take; what is still unwritten then is dropped with a warning (a
        worker process's own prefix cache at shutdown: its states are named by their content and
        only save a later prefill, while the server kills a worker that does not stop in time).
        None waits for every write."""
        with self._lock:
            if self._closed:
                return
        if not self.flush(timeout):
            with self._changed:
                dropped = len(self._pending)
                self._pending.clear()  # the writer skips jobs that are no longer pending
                self._changed.notify_all()
            logger.warning("state cache: closing with %d states not written to %s: the %.0f s shutdown budget ran out",
                           dropped, self.location, timeout)  # fmt: skip
        with self._lock:
            self._closed = True
        self._queue.put(None)
        self._writer.join()
        self._l3.locks.close()
        self._l3.close()
        if self._slab is not None:
            self._slab.close()

    def stats(self) -> dict[str, int]:
        with self._lock:
            counts = {
                "l1_entries": len(self._l1),
                "l2_entries": len(self._l2),
                "l1_bytes": self._l1.used_bytes,
                "l2_bytes": self._l2.used_bytes,
                "pending_writes": len(self._pending),
            }
            s = self._stats
            return {
                "l1_hits": s.l1_hits,
                "l2_hits": s.l2_hits,
                "l3_hits": s.l3_hits,
                "prefix_dropped": s.prefix_dropped,
                "misses": s.misses,
                "puts": s.puts,
                "disk_writes": s.disk_writes,
                "disk_write_errors": s.disk_write_errors,
                "corrupt_rows_dropped": s.corrupt_rows_dropped,
                "disk_evictions": s.disk_evictions,
                "stale_copies_dropped": s.stale_copies_dropped,
                **counts,
            }

    # ---- internals ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the state cache is closed")

    def _promote(
        self, key: str, state: Any, last_updated: float, *, dirty: bool, landed: torch.cuda.Event | None = None,
        leaving: CachedEntry | None = None, checksum: str | None = None, seq: int = 0,
    ) -> Any:
        if landed is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_event(landed)  # the device waits, not this thread
        elif landed is not None:
            landed.synchronize()
        on_device = copy_state(state, self.device)
        # The copy out of the L2 entry's slot is issued; a later copy into that slot waits for it
        # (records.copy_into), so the slot is free for the demotion this promotion may cause.
        if leaving is not None:
            checksum, seq = leaving.checksum, leaving.seq
        self._release(leaving)
        self._l1.insert(key, CachedEntry(on_device, state_nbytes(on_device), last_updated, dirty=dirty, checksum=checksum, seq=seq))
        self._rebalance()
        return copy_state(on_device, self.device)

    def _rebalance(self) -> None:
        for key, entry in list(self._l1.evict_over_budget()):
            demoted = self._demote(entry)
            if demoted is not None:
                self._l2.insert(key, demoted)
            elif entry.dirty:  # no host slot: a prefix state is dropped (a session state is on disk)
                self._stats.prefix_dropped += 1
        for _key, entry in list(self._l2.evict_over_budget()):
            # Only prefix-cache entries are dirty (sessions are written through). One falling out of
            # host memory is dropped, not written: under load that would mean gigabytes of disk
            # writes (32 MB a state at 7.2B) to save a recomputable prefill.
            self._release(entry)
            if entry.dirty:
                self._stats.prefix_dropped += 1

    def _demote(self, entry: CachedEntry) -> CachedEntry | None:
        """An L2 entry for an entry leaving L1, or None when host memory has no room for it.

        Demotion must not stall the engine: a synchronous copy to pageable memory waited for the
        step in flight (~20 ms per 32 MB state at 7.2B), which under a flood of new prompts (one
        prompt-end state each) cut the chat route's prefill rate 4-6x on the H200. From a GPU the
        state is copied into a slot of the page-locked slab without waiting."""
        if self.device == _CPU:
            return CachedEntry(entry.state, entry.nbytes, entry.last_updated, dirty=entry.dirty, landed=entry.landed, checksum=entry.checksum, seq=entry.seq)
        slab = self._slab
        if slab is None or not slab.fits(entry.state):
            return None
        slot = slab.take(entry.state)
        while slot is None and (oldest := self._l2.pop_oldest()) is not None:  # the slab is full: LRU makes room
            self._release(oldest[1])
            if oldest[1].dirty:
                self._stats.prefix_dropped += 1
            slot = slab.take(entry.state)
        if slot is None:
            return None
        host_state = slab.view(slot, entry.state)
        landed = copy_into(entry.state, host_state)
        return CachedEntry(
            host_state, entry.nbytes, entry.last_updated, dirty=entry.dirty, landed=landed, slot=slot, checksum=entry.checksum, seq=entry.seq
        )

    def _release(self, entry: CachedEntry | None) -> None:
        """An entry left L2: its slab slot is free again."""
        if entry is not None and entry.slot is not None and self._slab is not None:
            self._slab.give_back(entry.slot)
            entry.slot = None

    def _enqueue(
        self, key: str, state: Any, last_updated: float, landed: torch.cuda.Event | None = None, borrowed: bool = False, seq: int = 0
    ) -> None:
        if borrowed:  # it lives in a slab slot that may be reused before the writer reads it (flush only)
            if landed is not None:
                landed.synchronize()
            host_state, landed = copy_state(state, _CPU), None
        elif _on_cpu(state):
            host_state = state
        else:
            host_state, landed = copy_to_host(state)  # the writer thread waits for it, not the caller
        job = _WriteJob(key, host_state, last_updated, landed, seq, self._fence_of(key))
        self._pending[key] = job
        self._queue.put(job)

    def _fence_of(self, key: str) -> Fence | None:
        lock_name = turn_lock_of(key)
        held = None if lock_name is None else self._fences.get(lock_name)
        return None if held is None or lock_name is None else Fence(lock_name, held[1])

    def _write_loop(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                with self._disk_order:
                    with self._lock:
                        current = self._pending.get(job.key) is job
                    if current:
                        if job.landed is not None:
                            job.landed.synchronize()
                        record = self._encode(job)
                        evicted = self._l3.write(self.fingerprint, record, job.fence)
                        self._after_disk_write(job, record.checksum, evicted)
            except Exception as error:
                self._after_failed_write(job, error)
            finally:
                with self._changed:
                    if self._pending.get(job.key) is job:
                        del self._pending[job.key]
                    self._changed.notify_all()

    def _after_disk_write(self, job: _WriteJob, checksum: str, evicted: list[tuple[str, str]]) -> None:
        with self._lock:
            self._stats.disk_writes += 1
            self._stats.disk_evictions += len(evicted)
            for tier in (self._l1, self._l2):
                entry = tier.touch(job.key)
                if entry is not None and entry.seq == job.seq:
                    entry.checksum = checksum
            for fingerprint, key in evicted:
                if fingerprint == self.fingerprint:
                    self._mark_dirty(key)  # still in memory: written again on flush

    def _after_failed_write(self, job: _WriteJob, error: BaseException) -> None:
        with self._lock:
            self._stats.disk_write_errors += 1
            if not self._write_through(job.key):
                logger.exception("state cache: writing %r to %s failed; it stays in memory only", job.key, self.location)
                self._mark_dirty(job.key)
                return
            # A turn's state that L3 does not hold must not be served either: the client is told
            # the turn failed (wait_persisted raises), so the session goes on from what L3 holds.
            logger.error("state cache: writing %r to %s failed: %s", job.key, self.location, error)
            self._failed[job.key] = str(error) or type(error).__name__
            for tier in (self._l1, self._l2):
                entry = tier.touch(job.key)
                if entry is not None and entry.seq == job.seq:
                    self._release(tier.pop(job.key))

    def _mark_dirty(self, key: str) -> None:
        for tier in (self._l1, self._l2):
            entry = tier.touch(key)
            if entry is not None:
                entry.dirty = True

    def _delete_keys(self, keys: list[str]) -> list[str]:
        removed: set[str] = set()
        with self._disk_order:
            with self._changed:
                for key in keys:
                    in_l1 = self._l1.pop(key) is not None
                    l2_entry = self._l2.pop(key)
                    self._release(l2_entry)
                    in_l2 = l2_entry is not None
                    queued = self._pending.pop(key, None) is not None
                    if in_l1 or in_l2 or queued:
                        removed.add(key)
                self._changed.notify_all()
            for key in keys:
                if self._l3.delete(self.fingerprint, [key]):
                    removed.add(key)
        return sorted(removed)

    def _encode(self, job: _WriteJob) -> StoredRecord:
        payload = job.state.to_bytes()
        return StoredRecord(
            key=job.key,
            layout=state_layout(job.state),
            dtype=state_dtype(job.state),
            nbytes=state_nbytes(job.state),
            checksum=checksum(payload),
            payload=payload,
            last_updated=job.last_updated,
        )

    def _decode(self, record: StoredRecord) -> Any | None:
        """The state of a row, or None (and the row dropped) when the row is corrupt."""
        problem: str | None = None
        state = None
        if checksum(record.payload) != record.checksum:
            problem = "checksum mismatch"
        else:
            try:
                state = self._state_type.from_bytes(record.payload)
            except Exception as error:  # any decoding failure means the row cannot be trusted
                problem = f"undecodable payload ({error})"
            else:
                if state_layout(state) != record.layout:
                    problem = f"layout {state_layout(state)} differs from the stored {record.layout}"
        if problem is None:
            return state
        logger.warning("state cache: dropping corrupt row %r from %s: %s", record.key, self.location, problem)
        self._stats.corrupt_rows_dropped += 1
        self._l3.delete_if_unchanged(self.fingerprint, record.key, record.checksum)
        return None


def _on_cpu(state: Any) -> bool:
    return all(t.device.type == "cpu" for t in tensor_fields(state).values())
