"""The tiered, persistent state cache (see docs/state-cache.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from albatross.state import SlotState
from albatross_engine.state_cache.records import CacheEntryInfo, Tier
from albatross_engine.state_cache.store_url import StoreLocation, open_durable_tier, parse_store_url
from albatross_engine.state_cache.tiered_cache import PREFIX_CACHE_KEY_PREFIX, StateCache, is_session_key

DEFAULT_L1_BYTES = 1 << 30
DEFAULT_L2_BYTES = 4 << 30
DEFAULT_L3_BYTES = 32 << 30
DEFAULT_LOCK_LEASE_S = 30.0


def build_state_cache(settings: Any, fingerprint: str, device: str | torch.device) -> StateCache[SlotState]:
    """The cache a backend uses, sized by the server settings: `state_store` (a URL, see
    store_url.py; None: SQLite at `state_cache_path`), `state_l1_bytes`, `state_l2_bytes`,
    `state_l3_bytes`, `state_lock_lease`. A setting that is absent or None keeps the default."""

    def setting(name: str, default: Any) -> Any:
        value = getattr(settings, name, None)
        return default if value is None else value

    url = setting("state_store", None)
    if url is None:
        path = setting("state_cache_path", None)
        if path is None:
            raise ValueError("the server settings name no state store")
        location = StoreLocation("sqlite", f"sqlite:///{path}", Path(path).expanduser())
    else:
        location = parse_store_url(str(url))
    tier = open_durable_tier(location, int(setting("state_l3_bytes", DEFAULT_L3_BYTES)), float(setting("state_lock_lease", DEFAULT_LOCK_LEASE_S)))
    return StateCache(
        tier,
        fingerprint,
        device=device,
        l1_bytes=int(setting("state_l1_bytes", DEFAULT_L1_BYTES)),
        l2_bytes=int(setting("state_l2_bytes", DEFAULT_L2_BYTES)),
    )


__all__ = [
    "PREFIX_CACHE_KEY_PREFIX",
    "CacheEntryInfo",
    "StateCache",
    "Tier",
    "build_state_cache",
    "parse_store_url",
    "is_session_key",
]
