"""`--state-store`: where the durable tier (L3) lives, as a URL.

- `sqlite:///relative/path.sqlite3` or `sqlite:////absolute/path.sqlite3` (SQLAlchemy's spelling):
  a local file, the embedded default (`--state-cache-path` names it when no URL is given);
- `redis://[:password@]HOST:PORT/DB`, `rediss://...` (TLS) or `unix:///path/redis.sock?db=N`: a
  Redis shared by every replica (redis_tier.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from albatross_engine.state_cache.durable_tier import DurableTier

SQLITE_SCHEME = "sqlite:///"
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


@dataclass(frozen=True, slots=True)
class StoreLocation:
    kind: Literal["sqlite", "redis"]
    url: str
    path: Path | None = None  # sqlite only


def parse_store_url(url: str) -> StoreLocation:
    text = url.strip()
    if text.startswith(SQLITE_SCHEME):
        path = text[len(SQLITE_SCHEME) :]
        if not path:
            raise ValueError(f"{url!r} names no file: sqlite:///relative.sqlite3 or sqlite:////absolute.sqlite3")
        return StoreLocation("sqlite", text, Path(path).expanduser())
    if text.startswith(REDIS_SCHEMES):
        return StoreLocation("redis", text)
    raise ValueError(f"unknown state store {url!r}: use sqlite:///path.sqlite3 or redis://HOST:PORT/DB")


def open_durable_tier(location: StoreLocation, budget_bytes: int, lock_lease_s: float) -> DurableTier:
    if location.kind == "sqlite":
        from albatross_engine.state_cache.sqlite_tier import SqliteTier

        assert location.path is not None
        return SqliteTier(location.path, budget_bytes)
    from albatross_engine.state_cache.redis_tier import RedisTier  # the redis client is imported only when used

    return RedisTier(location.url, budget_bytes, lock_lease_s)
