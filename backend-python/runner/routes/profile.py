"""Route-level profile counters (ALBATROSS_PROFILE=1), answered as RWKV-Runner answers them."""

from __future__ import annotations

from fastapi import APIRouter, Request

from runner.context import context

router = APIRouter()


@router.get("/albatross/profile")
async def read_profile(request: Request, reset: bool = False) -> dict[str, object]:
    """RWKV-Runner's counters (zeros unless ALBATROSS_PROFILE=1), plus `enabled`."""
    profile = context(request).profile
    snapshot = profile.snapshot()
    if reset:
        profile.reset()
    return snapshot


@router.post("/albatross/profile/reset")
async def reset_profile(request: Request) -> dict[str, object]:
    context(request).profile.reset()
    return {"success": True}
