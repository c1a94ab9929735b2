"""The tiered, persistent state cache (see docs/state-cache.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from albatross.state import SlotState
from albatross_engine.state_cache.records import CacheEntryInfo, Tier
from albatross_engine.state_cache.tiered_cache import PREFIX_CACHE_KEY_PREFIX, StateCache, is_session_key

DEFAULT_L1_BYTES = 1 << 30
DEFAULT_L2_BYTES = 4 << 30
DEFAULT_L3_BYTES = 32 << 30


def build_state_cache(settings: Any, fingerprint: str, device: str | torch.device) -> StateCache[SlotState]:
    """The cache a backend uses, sized by the server settings (`state_cache_path`, `state_l1_bytes`,
    `state_l2_bytes`, `state_l3_bytes`); a setting that is absent or None keeps the default."""

    def setting(name: str, default: Any) -> Any:
        value = getattr(settings, name, None)
        return default if value is None else value

    path = setting("state_cache_path", None)
    if path is None:
        raise ValueError("the server settings name no state cache path")
    return StateCache(
        Path(path).expanduser(),
        fingerprint,
        device=device,
        l1_bytes=int(setting("state_l1_bytes", DEFAULT_L1_BYTES)),
        l2_bytes=int(setting("state_l2_bytes", DEFAULT_L2_BYTES)),
        l3_bytes=int(setting("state_l3_bytes", DEFAULT_L3_BYTES)),
    )


__all__ = [
    "PREFIX_CACHE_KEY_PREFIX",
    "CacheEntryInfo",
    "StateCache",
    "Tier",
    "build_state_cache",
    "is_session_key",
]
