"""Turn locks in Redis: one turn per session across every replica, with a lease.

A lock is `SET lock:<name> <token> NX PX <lease>`. While its turn runs, a keeper thread renews it
every third of the lease, so a live replica keeps it however long the turn takes, and a dead
replica's lock expires within one lease (default 30 s, `--state-lock-lease`). The token fences the
turn's writes (redis_tier.py): once a lease is lost, its turn can no longer store a state that a
newer turn may have superseded. Release and renewal compare the token first (a lock that expired
and was taken by another replica is never removed by the old holder). Released from a plain thread,
a lock is gone when `release()` returns (a route releases it that way before its reply, so the
client's next turn never meets it); released on an event loop (a finalizer), it is queued for the
keeper thread, so the loop cannot stall on a dead Redis.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import redis

from runner.sessions import SessionBusy

logger = logging.getLogger(__name__)

T = TypeVar("T")
Call = Callable[[str, Callable[[], T]], T]  # runs a Redis operation, turning outages into 503s

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisLease:
    __slots__ = ("_owner", "name", "token", "released", "lost")

    def __init__(self, owner: RedisTurnLocks, name: str, token: str) -> None:
        self._owner = owner
        self.name = name
        self.token = token
        self.released = False
        self.lost = False  # the keeper found it expired or taken: writes under it are refused

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._owner._release_lease(self)


class RedisTurnLocks:
    def __init__(self, client: redis.Redis, lease_s: float, call: Call[Any], key_prefix: str) -> None:
        if lease_s <= 0:
            raise ValueError("a lock lease must be > 0 seconds")
        self.lease_s = lease_s
        self._client = client
        self._call = call
        self._prefix = key_prefix
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._held: dict[str, RedisLease] = {}  # token -> lease
        self._releases: list[RedisLease] = []
        self._wake = threading.Condition()
        self._closed = False
        self._keeper: threading.Thread | None = None

    def key_of(self, name: str) -> bytes:
        return (self._prefix + name).encode("utf-8", "surrogatepass")

    def acquire(self, name: str) -> RedisLease:
        token = secrets.token_hex(16)
        lease_ms = max(1, int(self.lease_s * 1000))
        taken = self._call("a turn lock", lambda: self._client.set(self.key_of(name), token, nx=True, px=lease_ms))
        if not taken:
            raise SessionBusy(name)
        lease = RedisLease(self, name, token)
        with self._wake:
            self._held[token] = lease
            self._start_keeper()
        return lease

    def _release_lease(self, lease: RedisLease) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # a plain thread: release now
            with self._wake:
                self._held.pop(lease.token, None)
            self._try(functools.partial(self._release_script, lease), "release", lease)
            return
        with self._wake:
            self._held.pop(lease.token, None)
            self._releases.append(lease)
            self._wake.notify()

    def _start_keeper(self) -> None:
        if self._keeper is None and not self._closed:
            self._keeper = threading.Thread(target=self._keep, name="state-lock-keeper", daemon=True)
            self._keeper.start()

    def _keep(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._closed or bool(self._releases), timeout=self.lease_s / 3)
                releases, self._releases = self._releases, []
                held = list(self._held.values())
                closed = self._closed
            for lease in releases:
                self._try(functools.partial(self._release_script, lease), "release", lease)
            if closed:
                return
            for lease in held:
                renewed = self._try(functools.partial(self._renew_script, lease), "renew", lease)
                if renewed == 0 and not lease.released:
                    lease.lost = True
                    logger.error("turn lock %r expired while its turn ran (Redis unreachable for a whole lease?)", lease.name)
                    with self._wake:
                        self._held.pop(lease.token, None)

    def _release_script(self, lease: RedisLease) -> Any:
        return self._release(keys=[self.key_of(lease.name)], args=[lease.token])

    def _renew_script(self, lease: RedisLease) -> Any:
        return self._renew(keys=[self.key_of(lease.name)], args=[lease.token, int(self.lease_s * 1000)])

    def _try(self, operation: Callable[[], Any], what: str, lease: RedisLease) -> Any:
        try:
            return operation()
        except Exception as error:  # the lease runs out by itself: a failure costs at most one lease
            logger.warning("turn lock %r: %s failed: %s", lease.name, what, error)
            return None

    def close(self) -> None:
        """Releases every lock still held and stops the keeper."""
        with self._wake:
            self._closed = True
            self._releases.extend(self._held.values())
            self._held.clear()
            keeper = self._keeper
            self._wake.notify()
        if keeper is not None:
            keeper.join(timeout=10)
